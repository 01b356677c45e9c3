"""exo (one node, batching on) against llama.cpp's server on the same GGUF: tokens/s at N concurrent streams, time
to first token on a long prompt, and each server's resident memory.

  python bench/versus_llama.py                          # N = 1, 16, 64; 3 repeats
  python bench/versus_llama.py --ns 1 --repeats 5 --threads 2
  python bench/versus_llama.py --gguf /tmp/exo-random-llama-1b-q4_0.gguf --ns 1   # bench/big_quantized.py's 1B model

Both servers run at once on the embedded SmolLM2 (GGUF Q4_1), or on --gguf (exo serves it from its path), and take turns (each idle while the other serves),
the first one alternating by repeat, so a shared machine's drift falls on both alike; ratios are exo ÷ llama-server
per repeat, then their median. llama-server runs as a user would start it for many users: `-np <largest N> -cb -t
<threads> -c <slots × context>`; exo with EXO_BATCH_SIZE = the largest N, its engine splitting work over the cores
itself (OPENBLAS_NUM_THREADS left unset: set, BLAS's threads would compete with the engine's).
Tokens are counted by each server's own usage figures; every request generates --tokens tokens (ignore_eos)."""
import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import aiohttp

sys.path.append(str(Path(__file__).resolve().parent.parent))

from bench import MODEL, ROOT, Cluster, make_prompts, stream_one  # noqa: E402
from llama_server import LlamaServer, available, resident_mib  # noqa: E402


async def burst(url: str, prompts: List[str], max_tokens: int, model: str) -> Dict[str, float]:
  """Every prompt at once; tokens/s over the burst (as each server's usage counts them) and the median time to first
  text."""
  records = [{} for _ in prompts]
  extra = {"model": model, "stream_options": {"include_usage": True}}
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
    results = await asyncio.gather(*[stream_one(session, url, p, max_tokens, extra, record=r) for p, r in zip(prompts, records)])
  first_text = [next(t for t, text in zip(r["times"], r["text_parts"]) if text) for r in records]
  first_send = min(r["sent"] for r in records)
  last = max(r["times"][-1] for r in records)
  return {"tok_s": sum(r["usage"]["completion_tokens"] for r in results) / (last - first_send),
          "ttft": statistics.median(t - r["sent"] for t, r in zip(first_text, records)),
          "text": [r["text"] for r in results]}


async def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--ns", default="1,16,64", help="concurrency levels")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--tokens", type=int, default=128, help="generated tokens per request")
  p.add_argument("--prompt-tokens", type=int, default=64)
  p.add_argument("--long-prompt-tokens", type=int, default=1000, help="the prompt whose time to first token is compared")
  p.add_argument("--threads", type=int, default=os.cpu_count())
  p.add_argument("--gguf", default=None, help="another GGUF than the embedded model's (a Llama: exo serves it from its path)")
  p.add_argument("--out", default=str(ROOT / "bench" / "results"))
  args = p.parse_args()
  if not available():
    sys.exit("llama-server is not on PATH (see bench/llama_server.py for how to build it)")
  ns = [int(n) for n in args.ns.split(",")]
  args.batch_size, args.batch_timeout_ms, args.prefill_chunk = max(ns), 5.0, None
  log_dir = Path(tempfile.mkdtemp(prefix="exo-versus-llama-"))
  context = args.prompt_tokens + args.tokens + 64
  llama_args = ["-np", str(max(ns)), "-cb", "-t", str(args.threads), "-c", str(max(ns) * max(context, args.long_prompt_tokens + 64))]
  print(f"exo against llama-server {' '.join(llama_args)}: N = {ns}, {args.repeats} repeat(s), {args.tokens} tokens, "
        f"{os.cpu_count()} CPUs; logs in {log_dir}", flush=True)
  rows = []
  gguf = Path(args.gguf).resolve() if args.gguf else None
  model = str(gguf) if gguf else MODEL
  async with Cluster(1, "numpy", True, args, log_dir, model=model) as exo, LlamaServer(log_dir, llama_args, gguf=gguf) as llama:
    servers = {"exo": (exo.url, exo.procs[0].pid), "llama": (llama.url, llama.proc.pid)}
    for url, _ in servers.values():  # warm up: kernels compiled, pages touched
      await burst(url, make_prompts(2, args.prompt_tokens, salt=99), 8, model)
    resident = {name: resident_mib(pid) for name, (_, pid) in servers.items()}
    print(f"resident after loading and a warm-up: exo {resident['exo']:.0f} MiB, llama-server {resident['llama']:.0f} MiB", flush=True)
    for repeat in range(args.repeats):
      order = ["exo", "llama"] if repeat % 2 == 0 else ["llama", "exo"]
      for n in ns:
        prompts = make_prompts(n, args.prompt_tokens, salt=repeat)
        row = {"n": n, "repeat": repeat}
        for name in order:
          row[name] = await burst(servers[name][0], prompts, args.tokens, model)
        rows.append(row)
        print(f"  repeat {repeat} N={n}: exo {row['exo']['tok_s']:.1f} tok/s, llama-server {row['llama']['tok_s']:.1f} tok/s, "
              f"ratio {row['exo']['tok_s'] / row['llama']['tok_s']:.2f}x", flush=True)
      long_prompt = make_prompts(1, args.long_prompt_tokens, salt=11 + repeat)  # new to both servers' prompt caches
      long = {name: (await burst(servers[name][0], long_prompt, 1, model))["ttft"] for name in order}
      rows.append({"long_ttft": long, "repeat": repeat})
      print(f"  repeat {repeat} {args.long_prompt_tokens}-token prompt TTFT: exo {long['exo']:.3f} s, llama-server {long['llama']:.3f} s", flush=True)
    resident_after = {name: resident_mib(pid) for name, (_, pid) in servers.items()}

  out_dir = Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  out_path = out_dir / f"versus-llama-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
  out_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  print("\nmedians over repeats (ratio: exo ÷ llama-server, per repeat)")
  print(f"{'N':>4} {'exo tok/s':>10} {'llama tok/s':>12} {'ratio':>7}  {'exo TTFT':>9} {'llama TTFT':>11}  same text")
  for n in ns:
    runs = [r for r in rows if r.get("n") == n]
    med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    same = sum(a == b for r in runs for a, b in zip(r["exo"]["text"], r["llama"]["text"]))
    print(f"{n:>4} {med(lambda r: r['exo']['tok_s']):>10.1f} {med(lambda r: r['llama']['tok_s']):>12.1f} "
          f"{med(lambda r: r['exo']['tok_s'] / r['llama']['tok_s']):>6.2f}x  {med(lambda r: r['exo']['ttft']):>8.3f}s "
          f"{med(lambda r: r['llama']['ttft']):>10.3f}s  {same}/{n * len(runs)}")
  longs = [r["long_ttft"] for r in rows if "long_ttft" in r]
  print(f"{args.long_prompt_tokens}-token prompt TTFT: exo ÷ llama-server = {statistics.median(r['exo'] / r['llama'] for r in longs):.2f}x "
        f"(exo {statistics.median(r['exo'] for r in longs):.3f} s, llama-server {statistics.median(r['llama'] for r in longs):.3f} s)")
  print(f"resident MiB, after loading / after the runs: exo {resident['exo']:.0f} / {resident_after['exo']:.0f}, "
        f"llama-server {resident['llama']:.0f} / {resident_after['llama']:.0f}")
  print(f"raw figures: {out_path}")


if __name__ == "__main__":
  asyncio.run(main())
