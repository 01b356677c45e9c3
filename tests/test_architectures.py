"""Every model family, engine by engine, against Hugging Face transformers on small random checkpoints it made
(tests/fixtures/make_models.py; transformers' greedy tokens and logits in tests/fixtures/models/expected.json).

Each engine computes in float32 from the checkpoints' bfloat16 weights, as transformers did for the reference, so
they differ only by the order of float32 sums: the last prompt position's logits agree within LOGITS_ATOL, and the
greedy tokens are equal (every reference step's two best logits are at least 2e-3 apart, far above that noise). The
numpy engine keeps its KV cache in float16, which moves these logits by up to 2.5e-3 (Gemma 3; 0.2-1.5e-3 the
others): its logits are held to FLOAT16_KV_LOGITS_ATOL, and its greedy tokens are still every one equal.
The same tokens come whatever the step's shape: the prompt in chunks, beside another request in one batch, and split
over two shards as a pipeline computes it."""
import json
from pathlib import Path
from typing import List, Optional

import numpy as np
import pytest

from exo.inference.models import UnsupportedModel
from exo.inference.shard import Shard
from exo.inference.weights import load_shard_weights

pytestmark = pytest.mark.model

FIXTURES = Path(__file__).parent / "fixtures" / "models"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
LOGITS_ATOL = 1e-3
FLOAT16_KV_LOGITS_ATOL = 4e-3


def logits_atol(engine: str) -> float:
  return FLOAT16_KV_LOGITS_ATOL if engine == "numpy" else LOGITS_ATOL
OTHER_PROMPT = [3, 99, 400, 21, 7]


def model_class(engine: str):
  if engine == "numpy":
    from exo.inference.numpy.llama import Llama
  elif engine == "mlx":
    from exo.inference.mlx.llama import Llama
  else:
    from exo.inference.tinygrad.llama import Llama
  return Llama


def layer_count(path: Path) -> int:
  config = json.loads((path / "config.json").read_text())
  return (config.get("text_config") or config)["num_hidden_layers"]  # a multimodal model's: its text model's


def shard_models(engine: str, name: str, cuts: List[int] = ()) -> list:
  """The model as a pipeline computes it: one model per shard, split after each layer in `cuts`."""
  path = FIXTURES / name
  n_layers = layer_count(path)
  bounds = [-1, *cuts, n_layers - 1]
  models = []
  for start, end in zip(bounds, bounds[1:]):
    shard = Shard(name, start + 1, end, n_layers)
    config, weights = load_shard_weights(path, shard, keep_quantized=engine != "tinygrad")  # as each engine loads
    models.append(model_class(engine)(config, shard, weights))
  return models


def forward(models: list, inputs: list, caches: list) -> list:
  """One step through every shard in turn: each shard's outputs are the next one's inputs."""
  for model, model_caches in zip(models, caches):
    inputs = model.forward(inputs, model_caches)
  return inputs


def greedy(models: list, prompts: List[List[int]], new_tokens: int, chunk: int = 0):
  """Each prompt's greedy continuation, all requests in every step together, and each one's logits at its last
  prompt position. `chunk`: the prompts go in pieces of that many tokens, as chunked prefill sends them."""
  caches = [[m.new_cache() for _ in prompts] for m in models]
  pieces = [[p[i:i + chunk] for i in range(0, len(p), chunk)] if chunk else [p] for p in prompts]
  for step in range(max(len(p) for p in pieces)):
    rows = [r for r in range(len(prompts)) if step < len(pieces[r])]
    out = forward(models, [np.array(pieces[r][step]) for r in rows], [[c[r] for r in rows] for c in caches])
    for r, logits in zip(rows, out):
      if step == len(pieces[r]) - 1:
        pieces[r] = logits  # the last prompt piece's logits
  first_logits = [np.asarray(p).reshape(-1) for p in pieces]
  tokens = [[int(np.argmax(l))] for l in first_logits]
  for _ in range(new_tokens - 1):
    out = forward(models, [np.array(t[-1:]) for t in tokens], caches)
    for t, logits in zip(tokens, out):
      t.append(int(np.argmax(logits)))
  return tokens, first_logits


def check(engine: str, name: str, **variant) -> None:
  expected = EXPECTED[name]
  cuts = variant.pop("cuts", [])
  prompts = [expected["prompt"]] + ([OTHER_PROMPT] if variant.pop("batched", False) else [])
  tokens, logits = greedy(shard_models(engine, name, cuts), prompts, len(expected["tokens"]), **variant)
  np.testing.assert_allclose(logits[0], expected["last_prompt_logits"], atol=logits_atol(engine))
  assert tokens[0] == expected["tokens"]


DENSE = ["llama", "llama_rope_llama3", "llama_rope_llama3_v4", "llama_attention_bias", "mistral", "qwen2", "qwen2_yarn", "qwen3", "granite", "phi3",
         "olmo2"]
SLIDING = ["gemma2", "gemma3_text", "gemma3_text_v4"]  # sliding-window layers, soft-capping, Gemma's norms
# Gemma 3 4B and larger (Gemma3ForConditionalGeneration): the text model beside a vision tower, its weights under
# either version's names; the transformers 4 form's text_config leaves out what Gemma 3's defaults give
SLIDING += ["gemma3", "gemma3_v4"]
MOE = ["mixtral", "qwen3_moe"]  # mixtures of experts (Qwen3-MoE's layer 1 dense); the pipeline's cut lies between MoE layers
# gpt-oss: sinks, a sliding layer then a full one (the pipeline cuts between them), biased clamped experts, yarn.
# DeepSeek-V3: latent attention, a dense layer then two MoE layers with grouped routing and a shared expert, yarn;
# in both config forms.
MOE += ["gpt_oss", "deepseek_v3", "deepseek_v3_v4"]
# gpt-oss as OpenAI ships it: the experts in MXFP4 (tests/fixtures/make_mxfp4.py), against transformers' dequantised model
MOE += ["gpt_oss_mxfp4"]


@pytest.mark.parametrize("name", DENSE + SLIDING + MOE)
@pytest.mark.parametrize("engine", ["numpy", "mlx"])
def test_greedy_tokens_equal_transformers(engine, name):
  check(engine, name)


@pytest.mark.parametrize("name", DENSE + SLIDING + MOE)
@pytest.mark.parametrize("engine", ["numpy", "mlx"])
def test_chunked_batched_and_pipelined_steps_give_the_same_tokens(engine, name):
  check(engine, name, chunk=3, batched=True, cuts=[0])


def check_on_tinygrads_thread(name: str, **variant) -> None:
  """As the engine runs it: on tinygrad's one thread, whose SQLite kernel cache refuses any other (a test module of
  the same process may have opened it there first)."""
  from exo.inference.tinygrad.engine import tinygrad_thread
  tinygrad_thread().submit(check, "tinygrad", name, **variant).result()


TINYGRAD_MOE = ["mixtral", "qwen3_moe"]  # softmax-routed gated experts; gpt-oss's and DeepSeek's experts are refused


@pytest.mark.parametrize("name", DENSE + SLIDING + TINYGRAD_MOE)
def test_tinygrad_greedy_tokens_equal_transformers(name):
  check_on_tinygrads_thread(name)


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text", "mixtral"])  # tinygrad compiles every new step shape: three models stand for the rest
def test_tinygrad_chunked_batched_and_pipelined_steps_give_the_same_tokens(name):
  check_on_tinygrads_thread(name, chunk=3, batched=True, cuts=[0])


def test_tinygrad_decodes_a_mixture_of_experts_through_replayed_jits_of_the_picked_experts_only():
  """Decoding one request replays the captured jits (routing is an input, not a shape), and its step runs only the
  experts its row picked: mixtral's fixture has 4 experts and picks 2 a token."""
  def decode():
    [model] = shard_models("tinygrad", "mixtral")
    tokens, _ = greedy([model], [EXPECTED["mixtral"]["prompt"]], 6)
    assert tokens[0] == EXPECTED["mixtral"]["tokens"][:6]
    return model
  from exo.inference.tinygrad.engine import tinygrad_thread
  model = tinygrad_thread().submit(decode).result()
  decode_experts = model.jits[("moe_experts", 1, 2)][0]
  assert decode_experts.cnt >= 2, "the decode step should be replaying its captured experts' jit"
  assert not any(key[0] == "moe_experts" and key[1:] == (1, 4) for key in model.jits), "a decode step ran experts no row picked"


@pytest.mark.parametrize("name, field", [("gpt_oss", "num_experts_per_tok"), ("deepseek_v3", "num_experts_per_tok")])
def test_tinygrad_refuses_what_it_does_not_compute_by_name(name, field):
  with pytest.raises(UnsupportedModel, match="is not implemented by the tinygrad engine") as refused:
    shard_models("tinygrad", name)
  assert refused.value.field == field


@pytest.mark.parametrize("name, change", [
  ("llama_rope_llama3", {"rope_scaling": None}), ("qwen2_yarn", {"rope_scaling": None}),
  ("gpt_oss", {"rope_scaling": None}), ("gpt_oss", {"attention_sinks": False}), ("gpt_oss", {"swiglu_limit": 1e9}),
  ("gpt_oss", {"sliding_layers": ()}), ("gpt_oss", "router.bias"), ("gpt_oss", "gate_up_proj_bias"),
  ("deepseek_v3", {"rope_scaling": None}), ("deepseek_v3", {"rope_interleaved": False}), ("deepseek_v3", {"expert_groups_searched": 4}),
  ("deepseek_v3", {"routed_scaling_factor": 1.0}), ("deepseek_v3", {"shared_expert_intermediate_size": 0}),
  ("deepseek_v3", "e_score_correction_bias"),
  ("gemma3_v4", {"rope_theta": 10000.0}),  # Gemma 3's default base (its config.json leaves it out), not the usual 10,000
])
def test_each_feature_a_fixture_tests_changes_its_logits(name, change):
  """The fixture would catch an engine that left the feature out: computed without it, the logits differ from
  transformers' by ten times what the other tests allow."""
  from exo.inference.numpy.llama import Llama
  path = FIXTURES / name
  n_layers = layer_count(path)
  shard = Shard(name, 0, n_layers - 1, n_layers)
  config, weights = load_shard_weights(path, shard)
  if isinstance(change, str):  # a tensor the checkpoint holds, zeroed
    weights = {n: np.zeros_like(w) if n.endswith(change) else w for n, w in weights.items()}
  else:
    config = config.__class__(**{**config.__dict__, **change})
  _, logits = greedy([Llama(config, shard, weights)], [EXPECTED[name]["prompt"]], 1)
  assert np.abs(logits[0] - EXPECTED[name]["last_prompt_logits"]).max() > 10 * LOGITS_ATOL


# mlx-lm (0.32) reads these checkpoints' configs as transformers does. The others it reads otherwise: it takes no
# `rope_parameters` (the transformers 5 form) for Llama, Qwen2, Granite, Gemma 3, DeepSeek-V3 or Qwen3-MoE (whose `num_experts`
# transformers 5 writes as `num_local_experts`, which mlx-lm does not read either), and its Gemma 2 attends every
# layer over the whole context, where transformers (and exo) slide every other layer's window. Nor does it load
# gpt-oss's experts as transformers stores them (stacked, gate and up interleaved): its conversion leaves names its
# model lacks (test_gpt_oss_in_mlx_lms_layout_answers_as_mlx_lm rewrites the fixture in mlx-lm's own layout).
MLX_LM_READS = ["llama", "llama_rope_llama3_v4", "mistral", "qwen2_yarn", "qwen3", "phi3", "olmo2", "gemma3_text_v4", "gemma3_v4", "mixtral",
                "deepseek_v3_v4"]


def mlx_lm_greedy(name: str, new_tokens: int, path: Optional[Path] = None):
  """mlx-lm's greedy tokens and last prompt logits (on `path`, else the fixture), its model in float32 as ours
  computes on the CPU."""
  import mlx.core as mx
  from mlx.utils import tree_map
  from mlx_lm.utils import load_model
  model, _ = load_model(path or FIXTURES / name)
  model.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters()))
  ids = list(EXPECTED[name]["prompt"])
  first = None
  for _ in range(new_tokens):  # the whole sequence each step: no cache to get wrong, and the model is tiny
    logits = np.array(model(mx.array([ids]))[0, -1].astype(mx.float32))
    first = logits if first is None else first
    ids.append(int(np.argmax(logits)))
  return ids[len(EXPECTED[name]["prompt"]):], first


@pytest.mark.parametrize("name", MLX_LM_READS)
def test_mlx_equals_mlx_lm(name):
  expected_tokens, expected_logits = mlx_lm_greedy(name, len(EXPECTED[name]["tokens"]))
  tokens, logits = greedy(shard_models("mlx", name), [EXPECTED[name]["prompt"]], len(expected_tokens))
  np.testing.assert_allclose(logits[0], expected_logits, atol=LOGITS_ATOL)
  assert tokens[0] == expected_tokens


@pytest.mark.parametrize("engine", ["mlx", "numpy"])
def test_gpt_oss_in_mlx_lms_layout_answers_as_mlx_lm(engine, tmp_path):
  """gpt-oss as mlx-lm keeps it (each expert projection stacked), which mlx-lm reads (not transformers' layout). Its
  SwiGLU clamps at a fixed 7 (no `swiglu_limit`), so the checkpoint says 7 too."""
  from tests.support.checkpoints import gpt_oss_in_mlx_lms_layout
  path = gpt_oss_in_mlx_lms_layout(FIXTURES / "gpt_oss", tmp_path / "gpt_oss", swiglu_limit=7.0)
  expected_tokens, expected_logits = mlx_lm_greedy("gpt_oss", len(EXPECTED["gpt_oss"]["tokens"]), path)
  shard = Shard("gpt_oss", 0, 1, 2)
  config, weights = load_shard_weights(path, shard, keep_quantized=engine == "mlx")
  assert "model.layers.0.mlp.experts.gate_proj.weight" in weights
  tokens, logits = greedy([model_class(engine)(config, shard, weights)], [EXPECTED["gpt_oss"]["prompt"]], len(expected_tokens))
  np.testing.assert_allclose(logits[0], expected_logits, atol=LOGITS_ATOL)
  assert tokens[0] == expected_tokens


# mlx-lm's 4-bit conversions: every family it reads, and the mixtures of experts as mlx-lm reads them
# (mlx_lm_readable_checkpoint): experts stacked by projection (`switch_mlp`), quantized expert by expert. DeepSeek
# also in groups of 32, which quantize more of its small matrices: q_b and kv_b's output half (`unembed_out`).
QUANTIZED_MOE = ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3_v4"]


@pytest.mark.parametrize("name, group_size", [(n, 64) for n in MLX_LM_READS if n not in MOE] + [(n, 64) for n in QUANTIZED_MOE] + [("deepseek_v3_v4", 32)])
@pytest.mark.parametrize("engine", ["mlx", "numpy"])
def test_mlx_lms_4_bit_conversion_kept_quantized_answers_as_mlx_lm(engine, name, group_size, tmp_path):
  """mlx-lm's own 4-bit conversion of the checkpoint, kept quantized by exo's MLX and numpy engines, answers as
  mlx-lm does."""
  from tests.support.checkpoints import mlx_convert, mlx_lm_readable_checkpoint
  quantized = mlx_convert(mlx_lm_readable_checkpoint(name, tmp_path / "float"), tmp_path / "q4", q_group_size=group_size)
  expected_tokens, expected_logits = mlx_lm_greedy(name, len(EXPECTED[name]["tokens"]), quantized)
  n_layers = layer_count(quantized)
  shard = Shard(name, 0, n_layers - 1, n_layers)
  config, weights = load_shard_weights(quantized, shard, keep_quantized=True)
  assert any(type(w).__name__ == "QuantizedWeight" for w in weights.values())
  if name in MOE:  # the experts came quantized, and the model keeps them so
    assert any(n.endswith("switch_mlp.gate_proj.weight") or n.endswith("experts.gate_proj.weight") for n, w in weights.items()
               if type(w).__name__ == "QuantizedWeight")
  model = model_class(engine)(config, shard, weights)
  if name in MOE:
    moe_layer = model.layers[max(config.moe_layers)]
    if engine == "numpy":
      assert type(moe_layer["experts"][0][0]).__name__ == "PackedMatrix"
    else:
      assert moe_layer["experts_gate_up"].quantized is not None
  tokens, logits = greedy([model], [EXPECTED[name]["prompt"]], len(expected_tokens))
  np.testing.assert_allclose(logits[0], expected_logits, atol=logits_atol(engine))
  assert tokens[0] == expected_tokens


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_tinygrad_dequantises_mlx_lms_quantized_experts_and_answers_as_mlx_lm(name, tmp_path):
  from tests.support.checkpoints import mlx_convert, mlx_lm_readable_checkpoint
  quantized = mlx_convert(mlx_lm_readable_checkpoint(name, tmp_path / "float"), tmp_path / "q4")
  expected_tokens, expected_logits = mlx_lm_greedy(name, len(EXPECTED[name]["tokens"]), quantized)
  n_layers = layer_count(quantized)
  shard = Shard(name, 0, n_layers - 1, n_layers)

  def run():
    config, weights = load_shard_weights(quantized, shard)
    return greedy([model_class("tinygrad")(config, shard, weights)], [EXPECTED[name]["prompt"]], len(expected_tokens))
  from exo.inference.tinygrad.engine import tinygrad_thread
  tokens, logits = tinygrad_thread().submit(run).result()
  np.testing.assert_allclose(logits[0], expected_logits, atol=LOGITS_ATOL)
  assert tokens[0] == expected_tokens


@pytest.mark.parametrize("engine", ["numpy", "mlx"])
def test_deepseeks_kv_b_proj_quantized_whole_answers_as_its_dequantised_values(engine, tmp_path):
  """kv_b_proj quantized whole (heads * (nope + v), latent), as mlx-lm's conversions stored it before splitting it by
  head: read dequantised (its key half is used transposed, across its quantization groups), it answers as the same
  checkpoint with those values in float. (mlx-lm cannot read it here: it requantizes the key half along nope, 16
  wide in the fixture, narrower than any group.)"""
  from safetensors.numpy import save_file
  from exo.inference.quantize import quantize
  from exo.inference.weights import _read_safetensors, _safetensors_header
  from tests.support.checkpoints import fixture_checkpoint
  source = FIXTURES / "deepseek_v3_v4" / "model.safetensors"
  weights = _read_safetensors(source, [n for n in _safetensors_header(source)[0] if n != "__metadata__"])
  quantized, dequantised = dict(weights), dict(weights)
  for name in [n for n in weights if n.endswith("kv_b_proj.weight")]:
    q = quantize(weights[name], 4)
    layer = name[:-len(".weight")]
    quantized.update({name: q.packed, f"{layer}.scales": q.scales.astype(np.float32), f"{layer}.biases": q.biases.astype(np.float32)})
    dequantised[name] = q.dequantize()
  shard = Shard("deepseek_v3_v4", 0, 2, 3)
  answers = []
  for kind, tensors in (("quantized", quantized), ("dequantised", dequantised)):
    path = fixture_checkpoint("deepseek_v3_v4", tmp_path / kind)
    save_file(tensors, str(path / "model.safetensors"))
    if kind == "quantized":
      config = json.loads((path / "config.json").read_text())
      (path / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 32, "bits": 4}}))
    config, loaded = load_shard_weights(path, shard, keep_quantized=True)
    assert (type(loaded["model.layers.1.self_attn.kv_b_proj.weight"]).__name__ == "QuantizedWeight") == (kind == "quantized")
    answers.append(greedy([model_class(engine)(config, shard, loaded)], [EXPECTED["deepseek_v3_v4"]["prompt"]], 12))
  (tokens, logits), (expected_tokens, expected_logits) = answers
  np.testing.assert_allclose(logits[0], expected_logits[0], atol=1e-5)
  assert tokens[0] == expected_tokens[0]


@pytest.mark.parametrize("engine", ["numpy", "mlx"])
def test_gpt_oss_mxfp4_experts_stay_quantized(engine):
  """The MXFP4 experts are held as the checkpoint's bytes, each expert's own matrices: by MLX in its own mxfp4 mode,
  by numpy's 4-bit kernels reading E2M1 codes."""
  [model] = shard_models(engine, "gpt_oss_mxfp4")
  for layer in model.layers:
    if engine == "numpy":
      gate_up, down = layer["experts"][0]
      assert type(gate_up).__name__ == type(down).__name__ == "PackedMatrix" and gate_up.bits == down.bits == 4 and gate_up.fp4
    else:
      assert layer["experts_gate_up"].quantized.format == {"group_size": 32, "bits": 4, "mode": "mxfp4"}


@pytest.mark.parametrize("engine", ["numpy", "mlx"])
def test_placement_counts_mxfp4_experts_at_the_bytes_the_engine_holds(engine):
  """Placement's bytes a weight (model_size.weight_bytes, from the checkpoint's headers) for gpt-oss in MXFP4 are
  what the engine's model really holds: its experts' matrices as kept, every other matrix at the float width."""
  from exo.topology.model_size import _checkpoint_weight_bytes
  path = FIXTURES / "gpt_oss_mxfp4"
  per_weight = _checkpoint_weight_bytes(str(path), 4.0)
  [model] = shard_models(engine, "gpt_oss_mxfp4")
  expert_weights, expert_bytes = 0, 0
  for layer in model.layers:
    for name in ("gate_up", "down"):
      if engine == "numpy":
        matrices = [pair[name == "down"] for pair in layer["experts"]]
        expert_bytes += sum(m.nbytes for m in matrices)
        expert_weights += sum(m.shape[0] * m.shape[1] for m in matrices)
      else:
        experts = layer[f"experts_{name}"].quantized
        expert_bytes += sum(a.nbytes for a in experts.arrays())
        expert_weights += experts.weight.size * 8  # eight 4-bit codes a word
  config = model.config
  assert expert_weights == config.n_layers * config.n_experts * 3 * config.hidden_size * config.expert_intermediate_size
  from exo.inference.weights import _safetensors_header
  header = _safetensors_header(path / "model.safetensors")[0]
  float_weights = sum(int(np.prod(m["shape"])) for n, m in header.items() if n != "__metadata__" and len(m["shape"]) >= 2 and not n.endswith(("_blocks", "_scales")))
  assert per_weight == pytest.approx((expert_bytes + 4 * float_weights) / (expert_weights + float_weights))
  assert per_weight < 4.0


class LocalFiles:
  """A downloader for checkpoints already on disk: the shard's model id is its path."""

  async def ensure_shard(self, shard, engine_classname):
    return Path(shard.model_id)


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "mixtral", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("engine_name", ["numpy", "mlx"])
async def test_a_prompt_started_from_a_cached_prefix_gives_the_logits_of_one_computed_whole(engine_name, name, tmp_path):
  from exo.inference.engines import get_inference_engine
  from exo.inference.prefix_cache import BLOCK, block_keys
  from tests.support.checkpoints import fixture_checkpoint
  path = fixture_checkpoint(name, tmp_path / name)
  n_layers = layer_count(path)
  shard = Shard(str(path), 0, n_layers - 1, n_layers)
  engine = get_inference_engine(engine_name, LocalFiles())
  await engine.ensure_shard(shard)
  shared = EXPECTED[name]["prompt"] + OTHER_PROMPT + [40, 41, 42]  # two blocks and more: past Gemma's window of 4
  first, second = np.array(shared + [7, 8, 9]), np.array(shared + [300, 301, 302])
  await engine.infer_tensor("first", shard, first[None])
  engine.remember_prefix("first", block_keys(shard.model_id, first))
  await engine.finish_request("first")
  reused = await engine.start_from_prefix("second", shard, block_keys(shard.model_id, second), len(second) - 1)
  assert reused == 2 * BLOCK
  cached, _ = await engine.infer_tensor("second", shard, second[None, reused:])
  whole, _ = await engine.infer_tensor("whole", shard, second[None])
  np.testing.assert_allclose(cached, whole, atol=LOGITS_ATOL)


@pytest.mark.parametrize("engine", ["numpy", "mlx"])
def test_latent_attention_caches_only_the_latent_and_the_rope_key(engine):
  """DeepSeek-V3's cache holds kv_lora_rank + qk_rope_head_dim values a position and layer (32 + 8 here), not
  every head's key and value (4 heads x (24 + 16))."""
  [model] = shard_models(engine, "deepseek_v3")
  cache = model.new_cache()
  model.forward([np.array(EXPECTED["deepseek_v3"]["prompt"])], [cache])
  if engine == "numpy":
    assert cache.pool.slot_shape[:3] == (3, 1, 1) and cache.pool.slot_shape[-1] == 32 + 8
  else:
    assert cache.values == [] and [k.shape[0] for k in cache.keys] == [1] * 3 and {k.shape[-1] for k in cache.keys} == {32 + 8}
