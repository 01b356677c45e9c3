"""The embedded SmolLM2 (GGUF: Q4_1 layers, Q8_0 embedding) kept quantized in the numpy engine answers as the same
checkpoint dequantised to float32 does: the same greedy tokens on the suite's prompts, alone (the direct kernels) and
batched (the tiled BLAS path), with logits close; and its weights take no more memory than the file."""
import asyncio
import os

import numpy as np
import pytest

from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
from exo.inference.numpy.packed import PackedMatrix
from tests.support import engines as common
from tests.test_engine_agreement import PROMPTS

pytestmark = pytest.mark.model

TOKENS = 24


def float_engine(downloader):
  """The same engine given the checkpoint dequantised to float32: the reference."""
  engine = NumpyDynamicShardInferenceEngine(downloader)
  engine.keeps_quantized = False
  return engine


@pytest.fixture(scope="module")
def engines(downloader):
  return {"quantized": common.load_engine(NumpyDynamicShardInferenceEngine, downloader),
          "float": common.load_engine(float_engine, downloader)}


def weights_of(model):
  """Every array the model holds (a layer's parts this architecture lacks, such as biases, are None)."""
  for layer in model.layers:
    yield from (w for w in layer.values() if w is not None)
  yield from (w for w in (model.head, model.embed, model.norm) if w is not None)


def test_the_weights_stay_quantized_at_the_files_size(engines, smollm2_path):
  model = engines["quantized"].model
  matrices = [w for layer in model.layers for w in (layer["qkv"], layer["o"], layer["gate_up"], layer["down"])] + [model.head]
  assert all(isinstance(w, PackedMatrix) for w in matrices)
  held = sum(w.nbytes for w in weights_of(model))
  assert held <= 1.02 * os.path.getsize(smollm2_path), f"{held / 2**20:.1f} MiB of weights from a {os.path.getsize(smollm2_path) / 2**20:.1f} MiB file"
  floats = sum(w.nbytes for w in weights_of(engines["float"].model))
  assert held < floats / 5


def first_difference(a, b):
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)




@pytest.mark.parametrize("join_every", [0, 2])
def test_batched_greedy_tokens_equal_the_float_checkpoints(engines, join_every):
  """All openings at once (every step has more rows than the direct kernel takes: the tiled path), or joining two
  steps apart (prefill rows beside single decode rows)."""
  out, first = {}, {}
  for name, engine in engines.items():
    prompts = common.prompt_ids(engine, common.OPENINGS + PROMPTS)
    first[name] = {}
    out[name] = asyncio.run(common.batched(engine, prompts, TOKENS, f"q-{name}-{join_every}", join_every=join_every,
                                           stop_at_eos=False, first_logits=first[name]))
  for i in first["float"]:
    np.testing.assert_allclose(first["quantized"][i], first["float"][i], rtol=0, atol=common.FLOAT16_KV_LOGIT_ATOL)
  for i, (got, want) in enumerate(zip(out["quantized"], out["float"])):
    step = first_difference(got, want)
    assert step is None and len(got) == len(want) == TOKENS, f"prompt {i}: quantized and float part at token {step}"


def test_greedy_alone_equals_the_float_checkpoint_with_close_logits(engines):
  """One request at a time: each decode step is one row, the direct kernels' path."""
  for text in PROMPTS + ["What is the capital of France?"]:
    tokens, logits = {}, {}
    for name, engine in engines.items():
      ids = common.prompt_ids(engine, [text], template=True)[0]
      steps = []

      async def run():
        shard = common.smollm2_shard()
        out, _ = await engine.infer_tensor(f"alone-{name}", shard, ids.reshape(1, -1))
        for _ in range(TOKENS):
          steps.append(out[0, -1].copy())
          out, _ = await engine.infer_tensor(f"alone-{name}", shard, np.array([[int(np.argmax(out[0, -1]))]]))
        await engine.finish_request(f"alone-{name}")
      asyncio.run(run())
      logits[name] = np.stack(steps)
      tokens[name] = logits[name].argmax(-1).tolist()
    step = first_difference(tokens["quantized"], tokens["float"])
    if step is not None:
      top2 = np.sort(logits["float"][step])[-2:]
      pytest.fail(f"{text!r}: part at token {step}; the float model's top two logits there were {top2[1] - top2[0]:.2e} apart")
    # Until they part (they do not), every step's logits agree as two float32 summation orders do.
    np.testing.assert_allclose(logits["quantized"], logits["float"], rtol=0, atol=common.FLOAT16_KV_LOGIT_ATOL)


@pytest.mark.parametrize("streams", [16, 37])
def test_batched_decode_through_the_panels_gives_each_requests_tokens_alone(engines, streams, monkeypatch):
  """16 streams (two vectors of rows a panel) and 37 (a chunk of 32 rows and one of 5): every decode step's products
  run through the panel kernel, and each request's greedy tokens equal its own alone (one row a step: the direct
  kernels)."""
  engine = engines["quantized"]
  texts = [f"{common.OPENINGS[i % len(common.OPENINGS)]} ({i})" for i in range(streams)]
  prompts = common.prompt_ids(engine, texts)
  panel_rows = []
  panels = PackedMatrix.panels
  # steps never shared among OpenMP's threads: llama.py's layers, not the fused pass (test_fused_decode, test_numpy_engine)
  monkeypatch.setattr(engine.model, "shared_decode", None)
  monkeypatch.setattr(PackedMatrix, "panels", lambda self, x, *args, **kw: panel_rows.append(len(x)) or panels(self, x, *args, **kw))
  together = asyncio.run(common.batched(engine, prompts, 12, f"panels-{streams}", join_every=0, stop_at_eos=False))
  assert panel_rows.count(streams) >= 11 * 30 * 4, "the decode steps' layer products did not run through the panels"
  monkeypatch.setattr(PackedMatrix, "panels", panels)
  alone = [asyncio.run(common.greedy(engine, f"alone-{streams}-{i}", ids, 12, stop_at_eos=False)) for i, ids in enumerate(prompts)]
  for i, (got, want) in enumerate(zip(together, alone)):
    assert got == want, f"request {i} of {streams}: batched and alone part at token {first_difference(got, want)}"
