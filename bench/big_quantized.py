"""A 4-bit model as big as the ones people run (random weights, Llama 3.2 1B's shape with SmolLM2's tokenizer: 1.07
billion parameters in GGUF Q4_0), loaded by the numpy engine as a node loads it: what it holds in memory a parameter,
and its one-stream decode speed.

  python bench/big_quantized.py                         # writes /tmp/exo-random-llama-1b-q4_0.gguf once, then measures
  python bench/big_quantized.py --layers 2 --hidden 256 --intermediate 512 --heads 4 --kv-heads 2 --path /tmp/tiny.gguf

Resident bytes a parameter are measured twice: the engine's own weight bytes (every array its model holds), and the
process's resident memory after loading minus that of an idle process that imported the same modules and made the
same engine (each in a fresh process, so neither inherits the other's heap). Decode: a chat prompt prefilled, a few
warm-up tokens, then --tokens greedy steps of one stream through the engine's infer_tensor, timed in wall-clock and
in the process's CPU time.

The weights are random 4-bit codes under random float16 scales written straight as Q4_0 blocks (nothing is
quantized, so writing a billion parameters takes seconds); norms are float32. The file is not part of the project:
it is rewritten whenever its shape differs from the one asked for."""
import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

Q4_0_BLOCK = 32  # weights a block
Q4_0_BYTES = 18  # a float16 scale and 16 bytes of 4-bit codes


def q4_0_blocks(rng: np.random.Generator, rows: int, cols: int, scale: float) -> np.ndarray:
  """(rows, cols / 32 * 18) bytes of Q4_0 blocks: random codes, scales around `scale`."""
  blocks = np.empty((rows * cols // Q4_0_BLOCK, Q4_0_BYTES), dtype=np.uint8)
  blocks[:, 2:] = rng.integers(0, 256, (blocks.shape[0], Q4_0_BYTES - 2), dtype=np.uint8)
  d = (scale * (0.5 + rng.random(blocks.shape[0], dtype=np.float32))).astype(np.float16)
  blocks[:, :2] = d.view(np.uint8).reshape(-1, 2)
  return blocks.reshape(rows, -1)


def tensors(shape: dict):
  """(GGUF name, numpy shape) of a Llama's tensors, embeddings tied to the head."""
  h, f, layers = shape["hidden"], shape["intermediate"], shape["layers"]
  q, kv = shape["heads"] * (h // shape["heads"]), shape["kv_heads"] * (h // shape["heads"])
  yield "token_embd.weight", (shape["vocab"], h)
  for i in range(layers):
    yield from ((f"blk.{i}.{name}", dims) for name, dims in (
      ("attn_norm.weight", (h,)), ("attn_q.weight", (q, h)), ("attn_k.weight", (kv, h)), ("attn_v.weight", (kv, h)),
      ("attn_output.weight", (h, q)), ("ffn_norm.weight", (h,)), ("ffn_gate.weight", (f, h)), ("ffn_up.weight", (f, h)),
      ("ffn_down.weight", (h, f))))
  yield "output_norm.weight", (h,)


def parameters(shape: dict) -> int:
  return sum(int(np.prod(dims)) for _, dims in tensors(shape))


def write_checkpoint(path: Path, shape: dict) -> None:
  """The GGUF: Llama metadata, SmolLM2's tokenizer and chat template (copied from the embedded model), Q4_0 matrices."""
  import gguf
  from exo.download.shard_files import embedded_model_path
  from exo.inference.weights import gguf_reader
  tokenizer_source = gguf_reader(str(embedded_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")))
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_name("random-llama-q4_0")
  writer.add_block_count(shape["layers"])
  writer.add_context_length(4096)
  writer.add_embedding_length(shape["hidden"])
  writer.add_feed_forward_length(shape["intermediate"])
  writer.add_head_count(shape["heads"])
  writer.add_head_count_kv(shape["kv_heads"])
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_rope_freq_base(10000.0)
  writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
  for key, field in tokenizer_source.fields.items():
    if key.startswith("tokenizer."):
      kind = gguf.GGUFValueType(field.types[0])
      writer.add_key_value(key, field.contents(), kind, gguf.GGUFValueType(field.types[-1]) if kind == gguf.GGUFValueType.ARRAY else None)
  for name, dims in tensors(shape):
    if len(dims) == 1:
      writer.add_tensor_info(name, dims, np.dtype(np.float32), dims[0] * 4)
    else:
      writer.add_tensor_info(name, (dims[0], dims[1] // Q4_0_BLOCK * Q4_0_BYTES), np.dtype(np.uint8),
                             dims[0] * dims[1] // Q4_0_BLOCK * Q4_0_BYTES, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_ti_data_to_file()
  rng = np.random.default_rng(0)
  for name, dims in tensors(shape):
    # the scale keeps each product's output about as large as its input (codes - 8 have a spread of about 4.6)
    data = np.ones(dims, np.float32) if len(dims) == 1 else q4_0_blocks(rng, dims[0], dims[1], 1.0 / (4.6 * np.sqrt(dims[1])))
    writer.write_tensor_data(data)
  writer.close()


def checkpoint_shape(path: Path):
  from exo.inference.weights import load_config
  try:
    c = load_config(path)
  except (OSError, ValueError):
    return None
  return {"layers": c.n_layers, "hidden": c.hidden_size, "intermediate": c.intermediate_size, "heads": c.n_heads, "kv_heads": c.n_kv_heads,
          "vocab": c.vocab_size}


def held_bytes(value) -> int:
  """Bytes of every array a model holds (numpy arrays, packed weights, and the lists and dicts holding them)."""
  if isinstance(value, dict):
    return sum(held_bytes(v) for v in value.values())
  if isinstance(value, (list, tuple)):
    return sum(held_bytes(v) for v in value)
  return int(getattr(value, "nbytes", 0)) if not isinstance(value, (int, float, str)) else 0


def resident_bytes() -> int:
  import psutil
  return psutil.Process().memory_info().rss


async def measure(path: str, load: bool, tokens: int) -> dict:
  """In this process: the engine a node makes (and, with `load`, the model loaded as a node loads a local checkpoint)."""
  import gguf  # noqa: F401  (what loading imports, imported by the idle process as well)
  import exo.inference.numpy.llama  # noqa: F401
  import exo.inference.tokenizers  # noqa: F401
  import exo.inference.weights  # noqa: F401
  from exo.download.shard_download import HFShardDownloader
  from exo.inference.engines import get_inference_engine
  from exo.local_checkpoints import serve
  from exo.models import build_full_shard
  engine = get_inference_engine("numpy", HFShardDownloader())
  model_id = serve([path])[0]
  shard = build_full_shard(model_id, "NumpyDynamicShardInferenceEngine")
  if not load:
    return {"resident": resident_bytes()}
  started = time.perf_counter()
  await engine.ensure_shard(shard)
  result = {"resident": resident_bytes(), "load_s": time.perf_counter() - started}
  model = engine.model
  result["weights"] = held_bytes([model.layers, model.head, model.embed, model.norm])
  prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
                                                add_generation_prompt=True)
  x = (await engine.encode(shard, prompt)).reshape(1, -1)
  steps, cpu = [], []
  for i in range(tokens + 4):  # four warm-up steps
    started, started_cpu = time.perf_counter(), time.process_time()
    logits, _ = await engine.infer_tensor("bench", shard, x)
    x = (await engine.sample(logits)).reshape(1, -1)
    if i >= 4:
      steps.append(time.perf_counter() - started)
      cpu.append(time.process_time() - started_cpu)
  result["tokens_per_s"], result["cpu_s_per_token"] = 1 / statistics.median(steps), statistics.median(cpu)
  result["resident_after_decode"] = resident_bytes()
  return result


def in_fresh_process(path: Path, load: bool, tokens: int) -> dict:
  out = subprocess.run([sys.executable, __file__, "--path", str(path), "--tokens", str(tokens), "--measure", "load" if load else "idle"],
                       check=True, capture_output=True, text=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(args) -> None:
  path = Path(args.path)
  shape = {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate, "heads": args.heads, "kv_heads": args.kv_heads}
  from exo.download.shard_files import embedded_model_path
  from exo.inference.weights import gguf_config, gguf_reader
  shape["vocab"] = gguf_config(gguf_reader(str(embedded_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")))).vocab_size
  if checkpoint_shape(path) != shape:
    started = time.perf_counter()
    write_checkpoint(path, shape)
    print(f"wrote {path} ({path.stat().st_size / 2**20:,.0f} MiB) in {time.perf_counter() - started:.0f} s")
  count = parameters(shape)
  idle, loaded = in_fresh_process(path, False, args.tokens), in_fresh_process(path, True, args.tokens)
  resident = loaded["resident"] - idle["resident"]
  print(f"parameters: {count / 1e9:.3f} B; file {path.stat().st_size / count:.3f} bytes a parameter ({path.stat().st_size / 2**20:,.0f} MiB)")
  print(f"engine weights: {loaded['weights'] / 2**20:,.0f} MiB = {loaded['weights'] / count:.3f} bytes a parameter")
  print(f"resident after loading: {loaded['resident'] / 2**20:,.0f} MiB, idle process with the same modules: {idle['resident'] / 2**20:,.0f} MiB; "
        f"difference {resident / 2**20:,.0f} MiB = {resident / count:.3f} bytes a parameter (load {loaded['load_s']:.1f} s)")
  print(f"one stream decode: {loaded['tokens_per_s']:.2f} tokens/s (median of {args.tokens} steps), {loaded['cpu_s_per_token']:.3f} CPU s a token "
        f"(all threads; on a loaded machine the wall-clock rate falls, this does not); resident after decoding "
        f"{loaded['resident_after_decode'] / 2**20:,.0f} MiB")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--path", default="/tmp/exo-random-llama-1b-q4_0.gguf", help="where the checkpoint is (written if absent or of another shape)")
  parser.add_argument("--layers", type=int, default=16)
  parser.add_argument("--hidden", type=int, default=2048)
  parser.add_argument("--intermediate", type=int, default=8192)
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--kv-heads", type=int, default=8)
  parser.add_argument("--tokens", type=int, default=16, help="timed decode steps")
  parser.add_argument("--measure", choices=["idle", "load"], help=argparse.SUPPRESS)  # the fresh processes' part
  args = parser.parse_args()
  if args.measure:
    print(json.dumps(asyncio.run(measure(args.path, args.measure == "load", args.tokens))))
  else:
    main(args)
