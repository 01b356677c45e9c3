"""Weights and tokenizers from both layouts: GGUF (the embedded SmolLM2) and Hugging Face directories."""
import json
import math

import numpy as np
import pytest
from safetensors.numpy import save_file

from exo.inference.numpy.llama import Llama
from exo.inference.tokenizers import resolve_tokenizer
from exo.inference.llama_layout import rope_inv_freq
from exo.inference.weights import LlamaConfig, load_shard_weights
from tests.support.checkpoints import write_hf_dir
from tests.support.models import smollm2_shard

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def gguf_model(smollm2_path):
  return load_shard_weights(smollm2_path, smollm2_shard())


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_path):
  return resolve_tokenizer(smollm2_path)


def test_hf_directory_gives_the_same_model(tmp_path, gguf_model, gguf_tokenizer):
  config, weights = gguf_model
  hf = write_hf_dir(tmp_path / "smollm2", config, weights, gguf_tokenizer)
  hf_config, hf_weights = load_shard_weights(hf, smollm2_shard())
  assert hf_config.n_layers == 30 and hf_config.n_kv_heads == 3 and hf_config.tie_word_embeddings
  ids = np.array(gguf_tokenizer.encode("The capital of France is"))
  a = Llama(config, smollm2_shard(), weights)
  b = Llama(hf_config, smollm2_shard(), hf_weights)
  np.testing.assert_array_equal(a.forward([ids], [a.new_cache()])[0], b.forward([ids], [b.new_cache()])[0])

  hf_tokenizer = resolve_tokenizer(hf)
  conversation = [{"role": "user", "content": "Hi there! 123"}]
  assert hf_tokenizer.encode(hf_tokenizer.apply_chat_template(conversation)) == gguf_tokenizer.encode(gguf_tokenizer.apply_chat_template(conversation))


def test_a_shard_reads_only_its_layers(tmp_path, gguf_model, gguf_tokenizer):
  config, weights = gguf_model
  hf = write_hf_dir(tmp_path / "smollm2", config, weights, gguf_tokenizer)
  _, middle = load_shard_weights(hf, smollm2_shard(10, 19))
  layers = {int(n.split(".")[2]) for n in middle if n.startswith("model.layers.")}
  assert layers == set(range(10, 20))
  assert "model.embed_tokens.weight" not in middle and "model.norm.weight" not in middle


def test_bfloat16_safetensors_without_index(tmp_path):
  rng = np.random.default_rng(0)
  shapes = {"model.embed_tokens.weight": (10, 8), "model.norm.weight": (8,), "lm_head.weight": (10, 8),
            "model.layers.0.input_layernorm.weight": (8,), "model.layers.0.post_attention_layernorm.weight": (8,),
            "model.layers.0.self_attn.q_proj.weight": (8, 8), "model.layers.0.self_attn.k_proj.weight": (4, 8),
            "model.layers.0.self_attn.v_proj.weight": (4, 8), "model.layers.0.self_attn.o_proj.weight": (8, 8),
            "model.layers.0.mlp.gate_proj.weight": (16, 8), "model.layers.0.mlp.up_proj.weight": (16, 8), "model.layers.0.mlp.down_proj.weight": (8, 16)}
  f32 = {n: rng.normal(size=s).astype(np.float32) for n, s in shapes.items()}
  bf16_bits = {n: (w.view(np.uint32) >> 16).astype(np.uint16) for n, w in f32.items()}
  path = tmp_path / "tiny"
  path.mkdir()
  (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                                                 "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10}))
  save_file(bf16_bits, str(path / "model.safetensors"))
  raw = (path / "model.safetensors").read_bytes()  # numpy has no bfloat16: relabel the uint16 tensors as BF16
  header_len = int.from_bytes(raw[:8], "little")
  header = raw[8:8 + header_len].replace(b'"U16"', b'"BF16"')
  (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + header_len:])
  loaded_config, loaded = load_shard_weights(path, type(smollm2_shard())("tiny", 0, 0, 1))
  assert not loaded_config.tie_word_embeddings
  for name, bits in bf16_bits.items():
    np.testing.assert_array_equal(loaded[name], (bits.astype(np.uint32) << 16).view(np.float32))


def test_llama3_rope_scaling_matches_the_published_rule():
  scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
  config = LlamaConfig(hidden_size=2048, intermediate_size=8192, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                       head_dim=64, rope_theta=500000.0, rope_scaling=scaling)
  got = rope_inv_freq(config)
  for i, f in enumerate(got):
    base = 1.0 / 500000.0 ** (2 * i / 64)
    wavelen = 2 * math.pi / base
    if wavelen < 8192 / 4.0:
      want = base
    elif wavelen > 8192 / 1.0:
      want = base / 8.0
    else:
      smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
      want = (1 - smooth) * base / 8.0 + smooth * base
    assert f == pytest.approx(want, rel=1e-6)


def test_chat_template_renders_like_hugging_face(gguf_tokenizer):
  text = gguf_tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
  assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                  "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
  ids = gguf_tokenizer.encode(text)
  assert ids[:3] == [1, 9690, 198] and ids.count(2) == 2, "special tokens are single ids"
  assert gguf_tokenizer.decode(ids) == text


@pytest.mark.parametrize("file", ["chat_template.jinja", "chat_template.json"])
def test_a_chat_template_beside_the_tokenizer_config_is_read(tmp_path, gguf_tokenizer, file):
  """Where tokenizer_config.json has no template: transformers 5's chat_template.jinja, or an image-and-text model's
  chat_template.json (its processor's)."""
  from tests.support.checkpoints import write_tokenizer
  write_tokenizer(tmp_path, gguf_tokenizer)
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  template = config.pop("chat_template") + "{{ 'from the file' }}"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  (tmp_path / file).write_text(json.dumps({"chat_template": template}) if file.endswith(".json") else template)
  rendered = resolve_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
  assert rendered.endswith("from the file") and "Hi" in rendered


def test_end_of_turn_ids(gguf_tokenizer):
  assert gguf_tokenizer.eos_token_id == 2  # <|im_end|>
  assert {0, 2} <= gguf_tokenizer.eos_token_ids  # <|endoftext|> ends generation too


def test_digits_split_individually(gguf_tokenizer):
  assert gguf_tokenizer.encode("12345") == [33, 34, 35, 36, 37]


def test_the_gguf_reader_reads_what_the_gguf_package_reads(smollm2_path):
  import gguf
  from exo.inference.weights import gguf_reader
  theirs, ours = gguf.GGUFReader(str(smollm2_path)), gguf_reader(str(smollm2_path))
  assert list(ours.fields) == list(theirs.fields) and ours.data_offset == theirs.data_offset
  for name, field in theirs.fields.items():
    mine = ours.fields[name]
    assert mine.types == field.types and mine.data == field.data and len(mine.parts) == len(field.parts), name
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(mine.parts, field.parts)), name
  assert [(t.name, t.tensor_type, t.data.dtype, t.data.shape) for t in ours.tensors] == [(t.name, t.tensor_type, t.data.dtype, t.data.shape) for t in theirs.tensors]
  assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))


def test_a_parsed_gguf_is_shared_while_held_and_kept_by_nobody_after(smollm2_path):
  """A load's weights and tokenizer share one parse of the file's metadata (tens of MB of small arrays for SmolLM2's
  vocabulary); reading the config afterwards, as the API does for every model it serves, keeps none of it."""
  import gc
  import weakref

  from exo.inference import weights
  reader = weights.gguf_reader(smollm2_path)
  assert weights.gguf_reader(str(smollm2_path)) is reader
  parsed = weakref.ref(reader)
  del reader
  gc.collect()
  assert parsed() is None
  assert weights.load_config(smollm2_path).n_layers == 30
  gc.collect()
  assert not weights._live_readers
  assert weights.load_config(str(smollm2_path)) == weights.load_config(smollm2_path)


def test_one_tokenizer_per_unchanged_file_while_anyone_holds_it(tmp_path, gguf_tokenizer, smollm2_path):
  """The API and the engine of a node get the same tokenizer for a model; a tokenizer file rewritten since is read
  again."""
  assert resolve_tokenizer(smollm2_path) is gguf_tokenizer
  folder = tmp_path / "tokenizer"
  folder.mkdir()
  (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": gguf_tokenizer.eos_token}))
  gguf_tokenizer.backend.save(str(folder / "tokenizer.json"))
  first = resolve_tokenizer(folder)
  assert resolve_tokenizer(folder) is first and first is not gguf_tokenizer
  from tokenizers import Tokenizer as HFTokenizer
  grown = HFTokenizer.from_file(str(folder / "tokenizer.json"))
  grown.add_tokens(["<a-token-added-since>"])
  grown.save(str(folder / "tokenizer.json"))
  again = resolve_tokenizer(folder)
  assert again is not first and again.vocab_size == first.vocab_size + 1
