"""Where a node's resident memory goes: one `exo` node started as bench/versus_llama.py starts it (manual discovery
on loopback, the numpy engine, batching on, the embedded SmolLM2 or --model), warmed up with a burst of requests,
then its VmRSS and the mappings that hold it (/proc/PID/smaps: anonymous memory, the heap, each shared library).

  python bench/resident.py                    # after loading, and after a warm-up burst of 2 requests
  python bench/resident.py --top 30 --warm-up 8

Anonymous memory is the weights (kept quantized: ~94 MiB for SmolLM2), the tokenizer, Python's objects, the KV
cache's touched pages and the engine's scratch; a library's figure is its pages the process has touched (the engine's
compiled kernels, exo-kernels-*.so, and OpenMP's libgomp are a few hundred KiB)."""
import argparse
import asyncio
import collections
import os
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))

from bench import MODEL, Cluster, make_prompts  # noqa: E402
from llama_server import resident_mib  # noqa: E402
from versus_llama import burst  # noqa: E402


def resident_by_mapping(pid: int) -> collections.Counter:
  """KiB resident per mapping: a file's name, or [anon], [heap], [stack]."""
  held, name = collections.Counter(), None
  for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
    fields = line.split()
    if not fields[0].endswith(":"):  # a mapping's header: range, permissions, offset, device, inode[, path]
      name = fields[5] if len(fields) >= 6 else "[anon]"
    elif fields[0] == "Rss:":
      held[name] += int(fields[1])
  return held


async def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=MODEL, help="the node's default model: a card's id or a checkpoint's path")
  p.add_argument("--batch-size", type=int, default=64, help="EXO_BATCH_SIZE (bench/versus_llama.py: its largest N)")
  p.add_argument("--warm-up", type=int, default=2, help="concurrent requests of the warm-up burst (8 tokens each)")
  p.add_argument("--top", type=int, default=20, help="mappings listed")
  args = p.parse_args()
  args.batch_timeout_ms, args.prefill_chunk = 5.0, None
  log_dir = Path(tempfile.mkdtemp(prefix="exo-resident-"))
  async with Cluster(1, "numpy", True, args, log_dir, model=args.model) as exo:
    pid = exo.procs[0].pid
    loaded = resident_mib(pid)
    await burst(exo.url, make_prompts(args.warm_up, 64, salt=99), 8, args.model)
    print(f"exo resident: {loaded:.0f} MiB after loading, {resident_mib(pid):.0f} MiB after a warm-up of {args.warm_up} request(s)")
    for name, kib in resident_by_mapping(pid).most_common(args.top):
      print(f"{kib / 1024:8.1f} MiB  {os.path.basename(name) if name.startswith('/') else name}")
  print(f"logs in {log_dir}")


if __name__ == "__main__":
  asyncio.run(main())
