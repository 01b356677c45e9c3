"""A decoder embedding model (a tiny random Qwen3 wrapped as Qwen3-Embedding is: Transformer, last-token Pooling,
Normalize; made by tests/fixtures/make_qwen3_embedding.py) run by the numpy engine's decoder gives
sentence-transformers' vectors (stored in its reference.json), one text at a time, as one batch of different lengths,
and with the checkpoint's query prompt."""
import json
from pathlib import Path

import numpy as np
import pytest

from exo.embeddings.decoder import DecoderStates
from exo.embeddings.model import EmbeddingModel

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3_embedding"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
TEXTS = [t["text"] for t in REFERENCE["texts"]]


def expected(key: str) -> np.ndarray:
  return np.array([t[key] for t in REFERENCE["texts"]], dtype=np.float64)


def cosines(vectors: np.ndarray, reference: np.ndarray) -> np.ndarray:
  return (vectors * reference).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(reference, axis=1)


@pytest.fixture(scope="module")
def model():
  return EmbeddingModel(FIXTURE)


def test_reads_its_sentence_transformers_configuration(model):
  assert isinstance(model.transformer, DecoderStates)
  assert (model.pooling.mode, model.pooling.normalize) == ("lasttoken", True)
  assert model.dimensions == 64 and model.max_tokens == 512
  assert model.prompts["query"] == REFERENCE["query_prompt"] and model.prompt(None) == ""


def test_tokens_end_with_endoftext_as_its_tokenizer_appends_it(model):
  ids = model.tokenize(TEXTS)
  assert ids == [t["tokens"] for t in REFERENCE["texts"]]
  assert len({len(i) for i in ids}) > 3  # a batch of different lengths
  assert all(i[-1] == model.tokenizer.token_to_id("<|endoftext|>") for i in ids)


def test_each_text_alone_equals_sentence_transformers(model):
  vectors = np.concatenate([model.embed([ids]) for ids in model.tokenize(TEXTS)])
  assert cosines(vectors, expected("alone")).min() >= 0.9999, cosines(vectors, expected("alone"))
  assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)


def test_a_batch_of_different_lengths_equals_each_alone(model):
  ids = model.tokenize(TEXTS)
  batched = model.embed(ids)
  assert cosines(batched, expected("batched")).min() >= 0.9999, cosines(batched, expected("batched"))
  assert np.abs(batched - np.concatenate([model.embed([i]) for i in ids])).max() < 1e-5


def test_the_query_prompt_is_put_before_the_text(model):
  queries = model.embed(model.tokenize(TEXTS, model.prompt("query")))
  assert cosines(queries, expected("query")).min() >= 0.9999
  assert cosines(queries, expected("alone")).max() < 0.99  # the prompt changes the vectors: the check above means something
  with pytest.raises(KeyError):
    model.prompt("passage")


def test_a_long_input_runs_in_pieces_as_it_would_whole(model, monkeypatch):
  import exo.embeddings.decoder as decoder
  ids = model.tokenize(TEXTS)
  whole = model.embed(ids)
  monkeypatch.setattr(decoder, "CHUNK", 7)  # every input but the shortest in several passes through its cache
  pauses = []
  assert np.abs(model.embed(ids, pause=lambda: pauses.append(1)) - whole).max() < 1e-5
  assert len(pauses) == -(-max(len(i) for i in ids) // 7) - 1  # the batcher may give chat the cores between passes


def test_truncation_keeps_the_closing_endoftext(model):
  ids = model.tokenize(["word " * 600])[0]
  cut = model.truncate(ids)
  assert len(ids) > 512 and len(cut) == 512 and cut[-1] == ids[-1] and cut[:511] == ids[:511]
