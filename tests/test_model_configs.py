"""config.json as each family and each transformers version writes it: read to the same decoder, and a field that
changes the math without an implementation refused by name (never ignored)."""
import json
import math
from pathlib import Path

import pytest

from exo.inference.models import UnsupportedModel, model_config
from exo.inference.models.config import rope_parameters

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "fixtures" / "models"
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def config_json(**fields) -> dict:
  return {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 512, **fields}


def test_both_config_forms_give_the_same_rope():
  v4 = config_json(rope_theta=500000.0, rope_scaling=LLAMA3)
  v5 = config_json(rope_parameters={**LLAMA3, "rope_theta": 500000.0})
  assert rope_parameters(v4) == rope_parameters(v5) == (500000.0, LLAMA3)
  assert model_config(v5).rope_theta == model_config(v4).rope_theta == 500000.0
  assert model_config(v5).rope_scaling["factor"] == model_config(v4).rope_scaling["factor"] == 8.0
  assert model_config(config_json(rope_parameters={"rope_type": "default", "rope_theta": 1e6})).rope_scaling is None
  assert model_config(config_json(rope_parameters={"rope_type": "default", "rope_theta": 1e6})).rope_theta == 1e6
  assert model_config(config_json(rope_scaling={"type": "linear", "factor": 2.0})).rope_scaling["rope_type"] == "linear"


def test_the_fixtures_in_both_forms_read_alike():
  v4, v5 = (model_config(json.loads((FIXTURES / name / "config.json").read_text())) for name in ("llama_rope_llama3_v4", "llama_rope_llama3"))
  assert "rope_parameters" in (FIXTURES / "llama_rope_llama3" / "config.json").read_text()
  assert "rope_parameters" not in (FIXTURES / "llama_rope_llama3_v4" / "config.json").read_text()
  assert (v4.rope_theta, v4.rope_scaling) == (v5.rope_theta, v5.rope_scaling)


@pytest.mark.parametrize("fields, field", [
  (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "rope_parameters.original_max_position_embeddings"),
  (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type"),
  (dict(rope_scaling={"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}), "rope_scaling.type"),
  (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}), "rope_parameters.partial_rotary_factor"),
  (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
  (dict(rope_parameters={"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}), "rope_parameters"),
  (dict(hidden_act="gelu"), "hidden_act"),
  (dict(mlp_bias=True), "mlp_bias"),
  (dict(model_type="jamba"), "model_type"),
])
def test_a_field_that_changes_the_math_is_refused_by_name(fields, field):
  with pytest.raises(UnsupportedModel) as refused:
    model_config(config_json(**fields))
  assert refused.value.field == field and str(refused.value).startswith(field + ":")


@pytest.mark.parametrize("name, fields, field", [
  ("gpt_oss", dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config.quant_method"),  # its own mxfp4 loads
  ("deepseek_v3", dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}), "quantization_config.quant_method"),
  ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func"),
  ("deepseek_v3", dict(topk_method="greedy"), "topk_method"),
  ("deepseek_v3", dict(attention_bias=True), "attention_bias"),
  ("deepseek_v3_v4", dict(rope_scaling={"type": "longrope", "factor": 4.0}), "rope_scaling.type"),
])
def test_a_mixture_of_experts_field_that_changes_the_math_is_refused_by_name(name, fields, field):
  with pytest.raises(UnsupportedModel) as refused:
    model_config({**json.loads((FIXTURES / name / "config.json").read_text()), **fields})
  assert refused.value.field == field


def test_yarn_reads_alike_in_both_forms_and_scales_the_scores():
  """DeepSeek's yarn (mscale = mscale_all_dim) leaves cos and sin alone and scales the scores by mscale_all_dim's
  temperature squared; gpt-oss's (neither given) multiplies cos and sin by the temperature: its scores by its square."""
  v5, v4 = (model_config(json.loads((FIXTURES / name / "config.json").read_text())) for name in ("deepseek_v3", "deepseek_v3_v4"))
  assert (v5.rope_theta, v5.rope_scaling) == (v4.rope_theta, v4.rope_scaling) and v5.rope_scaling["attention_factor"] == 1.0
  temperature = 0.1 * math.log(4.0) + 1.0
  assert v5.attention_scale == pytest.approx(temperature ** 2 / math.sqrt(24))
  gpt_oss = model_config(json.loads((FIXTURES / "gpt_oss" / "config.json").read_text()))
  temperature = 0.1 * math.log(8.0) + 1.0
  assert gpt_oss.rope_scaling["attention_factor"] == pytest.approx(temperature)
  assert gpt_oss.attention_scale == pytest.approx(temperature ** 2 / math.sqrt(16))


def test_latent_attention_caches_the_latent_and_the_rope_key():
  """DeepSeek-V3's cache per position and layer: its 512-wide latent and 64-wide RoPE key, not 128 heads' keys and values."""
  from exo.api.model_limits import ModelLimits
  config = model_config(json.loads((FIXTURES / "deepseek_v3" / "config.json").read_text()))
  assert config.kv_values_per_position == 32 + 8
  assert ModelLimits.of(config, 2).kv_bytes_per_position_per_layer == (32 + 8) * 2  # float16, as the numpy engine keeps it with EXO_KV_BITS=16
  full_size = {**json.loads((FIXTURES / "deepseek_v3" / "config.json").read_text()), "num_attention_heads": 128, "num_key_value_heads": 128,
               "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
  assert model_config(full_size).kv_values_per_position == 576


def test_deepseek_v3s_size_counts_every_expert_and_its_latent_attention():
  """DeepSeek-V3's own config (less its multi-token prediction layer, which exo does not run): 671B parameters."""
  from exo.api.ollama.models import parameter_count
  v3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "vocab_size": 129280, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "max_position_embeddings": 163840, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"}}
  assert 665e9 < parameter_count(model_config(v3)) < 675e9


def test_gpt_oss_sizes_count_every_expert():
  """gpt-oss-20b's and -120b's configs: 20.9B and 116.8B parameters, as OpenAI gives them."""
  from exo.api.ollama.models import parameter_count
  small = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
           "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088, "sliding_window": 128,
           "max_position_embeddings": 131072, "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                                                      "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}}
  assert round(parameter_count(model_config(small)) / 1e9, 1) == 20.9
  assert round(parameter_count(model_config({**small, "num_hidden_layers": 36, "num_local_experts": 128})) / 1e9, 1) == 116.8
  assert model_config(small).max_position_embeddings == 131072  # its sliding layers do not limit the context


def test_a_sliding_window_narrower_than_the_context_limits_the_context_unless_the_family_slides():
  v01 = model_config(config_json(model_type="mistral", max_position_embeddings=32768, sliding_window=4096))
  # Mistral 7B v0.1: every layer slides, over the whole context (the engines keep the window; transformers likewise)
  assert (v01.max_position_embeddings, v01.sliding_window, v01.sliding_layers) == (32768, 4096, tuple(range(v01.n_layers)))
  assert model_config(config_json(model_type="qwen2", max_position_embeddings=32768, sliding_window=4096, use_sliding_window=True,
                                  max_window_layers=0)).max_position_embeddings == 4096  # Qwen2's sliding layers: not implemented, so limited
  assert model_config(config_json(model_type="mistral", max_position_embeddings=32768, sliding_window=None)).max_position_embeddings == 32768
  qwen = config_json(model_type="qwen2", max_position_embeddings=32768, sliding_window=4096, use_sliding_window=False)
  assert model_config(qwen).max_position_embeddings == 32768
  all_full = config_json(model_type="qwen3", max_position_embeddings=32768, sliding_window=4096, layer_types=["full_attention"] * 2)
  assert model_config(all_full).max_position_embeddings == 32768


def test_each_family_declares_its_parts():
  assert model_config(config_json(model_type="qwen2")).qkv_bias and not model_config(config_json(model_type="qwen2")).o_bias
  assert model_config(config_json(model_type="qwen3")).qk_norm
  biased = model_config(config_json(attention_bias=True))
  assert biased.qkv_bias and biased.o_bias
  plain = model_config(config_json(model_type="mistral"))
  assert not (plain.qkv_bias or plain.o_bias or plain.qk_norm)


def test_a_mixture_of_experts_weighs_every_expert():
  from exo.api.ollama.models import parameter_count
  from exo.topology.model_size import _checkpoint_shape
  mixtral = json.loads((FIXTURES / "mixtral" / "config.json").read_text())
  config = model_config(mixtral)
  assert config.moe_layers == (0, 1) and config.n_experts == 4 and config.experts_per_token == 2
  experts = 2 * 4 * (3 * 64 * 64 + 64)  # two layers of four experts of width 64, and their routers
  assert config.mlp_parameters() == experts
  dense = model_config({**mixtral, "model_type": "mistral"})
  assert parameter_count(config) - parameter_count(dense) == experts - dense.mlp_parameters()
  assert _checkpoint_shape(str(FIXTURES / "mixtral")).intermediate == experts // (3 * 64 * 2)
  qwen = model_config(json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text()))
  assert qwen.moe_layers == (0, 2) and not qwen.normalize_expert_weights  # layer 1 is in mlp_only_layers


@pytest.mark.parametrize("name, engine, field", [("gpt_oss", "TinygradDynamicShardInferenceEngine", "num_experts_per_tok"), ("deepseek_v3", "TinygradDynamicShardInferenceEngine", "num_experts_per_tok")])
def test_the_api_refuses_a_model_its_engine_does_not_compute_with_a_400_naming_the_field(name, engine, field):
  from exo.api.errors import BadRequest
  from exo.api.model_profiles import model_config_of
  with pytest.raises(BadRequest) as refused:
    model_config_of("/models/" + name, FIXTURES / name, engine)
  assert refused.value.status == 400 and refused.value.param == "model" and f"{field}: " in refused.value.message
  for runs_it in ("NumpyDynamicShardInferenceEngine", "MLXDynamicShardInferenceEngine"):
    assert model_config_of("/models/" + name, FIXTURES / name, runs_it).model_type == name


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_tinygrad_accepts_the_softmax_routed_mixtures_of_experts(name):
  from exo.api.model_profiles import model_config_of
  assert model_config_of("/models/" + name, FIXTURES / name, "TinygradDynamicShardInferenceEngine").model_type == name


def test_gemma_ties_its_head_unless_told_otherwise():
  gemma = json.loads((FIXTURES / "gemma2" / "config.json").read_text())
  gemma.pop("tie_word_embeddings")
  assert model_config(gemma).tie_word_embeddings
  assert not model_config({**gemma, "tie_word_embeddings": False}).tie_word_embeddings


def test_a_gguf_of_another_architecture_is_refused_by_name(tmp_path):
  import gguf

  from exo.inference.weights import load_config
  writer = gguf.GGUFWriter(str(tmp_path / "qwen.gguf"), "qwen2")
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(UnsupportedModel) as refused:
    load_config(tmp_path / "qwen.gguf")
  assert refused.value.field == "general.architecture" and "'qwen2'" in str(refused.value)


def test_gemma3_4b_and_larger_read_their_text_model_with_gemma3s_defaults():
  """Gemma3ForConditionalGeneration's config.json (transformers 4 writes text_config without what Gemma3TextConfig
  defaults, as the 4B's does) reads as the text model's, in both forms; the placement size is the text model's."""
  v4, v5 = (model_config(json.loads((FIXTURES / name / "config.json").read_text())) for name in ("gemma3_v4", "gemma3"))
  assert "num_attention_heads" not in json.loads((FIXTURES / "gemma3_v4" / "config.json").read_text())["text_config"]
  assert v4 == v5
  assert (v4.n_layers, v4.n_heads, v4.n_kv_heads, v4.vocab_size, v4.rms_norm_eps) == (3, 8, 4, 512, 1e-6)
  assert (v4.rope_theta, v4.rope_scaling["factor"], v4.sliding_rope[0], v4.sliding_layers) == (1e6, 4.0, 10000.0, (0, 1))
  from exo.topology.model_size import _checkpoint_shape
  shape = _checkpoint_shape(str(FIXTURES / "gemma3_v4"))
  assert (shape.hidden, shape.q_dim, shape.vocab) == (64, 8 * 32, 512)
  # the real 4B's text_config, as its config.json gives it
  four_b = model_config({"model_type": "gemma3", "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                                                "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                                                "sliding_window": 1024}})
  assert (four_b.n_heads, four_b.n_kv_heads, four_b.head_dim, four_b.vocab_size, four_b.rope_theta) == (8, 4, 256, 262208, 1e6)
  assert four_b.attention_scale == 256 ** -0.5 and four_b.sliding_rope == (10000.0, None) and len(four_b.sliding_layers) == 34 - 5


@pytest.mark.parametrize("name", ["gemma3", "gemma3_v4"])
def test_gemma3s_vision_weights_are_neither_loaded_nor_downloaded(name):
  from exo.download.shard_files import weight_files
  from exo.inference.shard import Shard
  from exo.inference.weights import _safetensors_header, load_shard_weights
  stored = [n for n in _safetensors_header(FIXTURES / name / "model.safetensors")[0] if n != "__metadata__"]
  assert any("vision_tower" in n for n in stored) and any("multi_modal_projector" in n for n in stored)
  _, weights = load_shard_weights(FIXTURES / name, Shard(name, 0, 2, 3))
  _, text_weights = load_shard_weights(FIXTURES / "gemma3_text", Shard("gemma3_text", 0, 2, 3))
  assert set(weights) == set(text_weights)  # every name the text model's, nothing of the vision tower
  # the vision tower's file (its layer 0 too) is no shard's; the text model's layers' are as usual
  weight_map = {**{n: "vision.safetensors" for n in stored if "vision_tower" in n or "multi_modal" in n},
                **{n: f"text-{n.split('layers.')[1].split('.')[0]}.safetensors" if "layers." in n else "text.safetensors"
                   for n in stored if "vision_tower" not in n and "multi_modal" not in n}}
  assert weight_files(Shard(name, 0, 0, 3), weight_map) == ["text-0.safetensors", "text.safetensors"]
  assert weight_files(Shard(name, 1, 2, 3), weight_map) == ["text-1.safetensors", "text-2.safetensors", "text.safetensors"]
