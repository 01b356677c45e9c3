"""Structured output, measured through the real HTTP API of a real `exo` process (SmolLM2-135M, batching on).

Two parts, each printing its counts or figures (docs/structured-output.md says what they mean):

1. The schema suite (tests/support/schema_suite.py: 52 schemas x 2 prompts), CONCURRENCY requests at once, greedy
   and sampled with max_tokens 256, and greedy with max_tokens 48: how many finished (not cut off) and how many of
   those validate with `jsonschema` (the target is all of them, within each budget); then forced tool calls (one
   named tool per schema): how many name that tool with arguments that validate; then the forced tool call with a
   number and no max_tokens (pydantic-ai's output_type): its tokens (target < 64) and whether it validates.
2. Throughput: N requests at once, every row constrained (a schema whose answer is longer than --tokens, so every row
   runs exactly --tokens tokens) against the same prompts unconstrained (ignore_eos), alternating, --repeats times in
   one run: tokens/s of each, their ratio (target >= 0.95x), and the mask time per step read from /metrics.
3. Penalties (--penalties): the same N unconstrained rows with frequency, presence and repetition penalties and a
   logit_bias against the same rows without them, alternating: the ratio of tokens/s (target >= 0.95x).

  python bench/structured.py                   # both parts
  python bench/structured.py --no-throughput   # the suite only
  python bench/structured.py --no-suite --n 64 --tokens 96 --repeats 3
  python bench/structured.py --no-suite --no-throughput --penalties --n 64
"""
import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import jsonschema

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench import MODEL, Cluster, make_prompts, stream_one, summarise  # noqa: E402
from tests.support.schema_suite import SCHEMAS, TOOLS, prompt  # noqa: E402

CONCURRENCY = 32
MAX_TOKENS = 256
SMALL_BUDGET = 48
PENALTIES = {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1, "logit_bias": {"28": -100, "30": 2.0}}
# The forced tool call pydantic-ai makes for an output_type with a number, sent without max_tokens.
CITY_TOOL = {"type": "function", "function": {"name": "final_result", "parameters": {"type": "object", "properties": {
  "name": {"type": "string"}, "country": {"type": "string"}, "population_millions": {"type": "number"}},
  "required": ["name", "country", "population_millions"]}}}
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
# Every row of the throughput run follows this and never completes it within --tokens: one long list of records.
LONG_SCHEMA = {"type": "array", "minItems": 400, "items": {"type": "object", "properties": {
  "name": {"type": "string", "maxLength": 16}, "score": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": ["name", "score"]}}


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
  async with session.post(url, json={"model": MODEL, **body}) as response:
    reply = await response.json()
    if response.status != 200:
      raise RuntimeError(f"HTTP {response.status}: {reply}")
    return reply


async def gather_limited(coros, limit: int):
  gate = asyncio.Semaphore(limit)

  async def one(coro):
    async with gate:
      return await coro
  return await asyncio.gather(*[one(c) for c in coros])


async def schema_suite(url: str) -> None:
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
    for label, sampling, budget in (("greedy", {"temperature": 0}, MAX_TOKENS), ("sampled", SAMPLED, MAX_TOKENS),
                                    (f"greedy, max_tokens {SMALL_BUDGET}", {"temperature": 0}, SMALL_BUDGET)):
      jobs = [(name, which) for name in SCHEMAS for which in (0, 1)]
      start = time.perf_counter()
      replies = await gather_limited([post(session, url, {
        "messages": [{"role": "user", "content": prompt(name, which)}], "max_tokens": budget, "seed": i, **sampling,
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}})
        for i, (name, which) in enumerate(jobs)], CONCURRENCY)
      finished = valid = 0
      failures = []
      for (name, which), reply in zip(jobs, replies):
        choice = reply["choices"][0]
        if choice["finish_reason"] != "stop":
          failures.append(f"{name}/{which}: not finished within {budget} tokens: {choice['message']['content'][:100]}...")
          continue
        finished += 1
        try:
          jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[name])
          valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
          failures.append(f"{name}/{which}: INVALID {str(e)[:120]}")
      print(f"schema suite, {label}: {len(jobs)} requests ({len(SCHEMAS)} schemas x 2 prompts, {CONCURRENCY} at once) in "
            f"{time.perf_counter() - start:.0f} s; finished within {budget} tokens: {finished}/{len(jobs)} ({100 * finished / len(jobs):.1f}%); "
            f"finished outputs that validate: {valid}/{finished}", flush=True)
      for failure in failures:
        print(f"  {failure}")
    named = [(tool["function"]["name"], tool) for tool in TOOLS]
    replies = await gather_limited([post(session, url, {
      "messages": [{"role": "user", "content": prompt(name, 0)}], "max_tokens": MAX_TOKENS, "temperature": 0,
      "tools": [tool, TOOLS[(i + 1) % len(TOOLS)]], "tool_choice": {"type": "function", "function": {"name": name}}})
      for i, (name, tool) in enumerate(named)], CONCURRENCY)
    good = 0
    for (name, tool), reply in zip(named, replies):
      calls = reply["choices"][0]["message"].get("tool_calls") or []
      try:
        assert len(calls) == 1 and calls[0]["function"]["name"] == name
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), tool["function"]["parameters"])
        good += 1
      except (AssertionError, ValueError, jsonschema.ValidationError) as e:
        print(f"  BAD CALL {name}: {str(e)[:120] or reply['choices'][0]}")
    print(f"forced tool calls: {good}/{len(named)} name the given tool with arguments that validate", flush=True)
    start = time.perf_counter()
    reply = await post(session, url, {"messages": [{"role": "user", "content": "Tell me about Paris."}], "temperature": 0, "tools": [CITY_TOOL],
                                      "tool_choice": "required", "parallel_tool_calls": False})
    arguments = reply["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    jsonschema.validate(json.loads(arguments), CITY_TOOL["function"]["parameters"])
    print(f"forced tool call with a number, no max_tokens: {reply['usage']['completion_tokens']} tokens in {time.perf_counter() - start:.1f} s, "
          f"finish_reason {reply['choices'][0]['finish_reason']}, arguments validate: {arguments}", flush=True)


async def metric(session: aiohttp.ClientSession, base: str, name: str) -> float:
  async with session.get(f"{base}/metrics") as response:
    for line in (await response.text()).splitlines():
      if line.startswith(name + " "):
        return float(line.split()[1])
  return 0.0


async def throughput(cluster: Cluster, n: int, tokens: int, repeats: int) -> None:
  url, base = cluster.url, f"http://127.0.0.1:{cluster.api_ports[0]}"
  prompts = make_prompts(n, 48, salt=5)
  constrained = {"response_format": {"type": "json_schema", "json_schema": {"name": "records", "schema": LONG_SCHEMA}}}
  ratios = []
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
    await asyncio.gather(*[stream_one(session, url, p, 8, constrained) for p in prompts[:2]])  # warm-up: load, compile
    for repeat in range(repeats):
      figures = {}
      for kind in (("constrained", "free") if repeat % 2 else ("free", "constrained")):
        seconds, steps = await metric(session, base, "exo_grammar_mask_seconds_total"), await metric(session, base, "exo_grammar_mask_steps_total")
        results = await asyncio.gather(*[stream_one(session, url, p, tokens, constrained if kind == "constrained" else None) for p in prompts])
        figures[kind] = summarise(results)
        if kind == "constrained":
          seconds = await metric(session, base, "exo_grammar_mask_seconds_total") - seconds
          steps = await metric(session, base, "exo_grammar_mask_steps_total") - steps
          figures[kind]["mask_ms_per_step"] = 1000 * seconds / max(1, steps)
          figures[kind]["steps"] = steps
          for r in results:
            assert r["text"].startswith("[{"), r["text"][:80]
      ratio = figures["constrained"]["tok_s"] / figures["free"]["tok_s"]
      ratios.append(ratio)
      print(f"throughput N={n}, {tokens} tokens each, repeat {repeat + 1}: unconstrained {figures['free']['tok_s']:.1f} tok/s "
            f"({figures['free']['tokens']} tokens), every row constrained {figures['constrained']['tok_s']:.1f} tok/s "
            f"({figures['constrained']['tokens']} tokens): {ratio:.3f}x; masks {figures['constrained']['mask_ms_per_step']:.2f} ms per step "
            f"(computed beside the forward pass, {figures['constrained']['steps']:.0f} steps)", flush=True)
  print(f"throughput, constrained / unconstrained, median of {repeats}: {statistics.median(ratios):.3f}x", flush=True)


async def penalties(cluster: Cluster, n: int, tokens: int, repeats: int) -> None:
  """N free rows with every logit processor against the same rows without, alternating, in one run."""
  url = cluster.url
  prompts = make_prompts(n, 48, salt=7)
  ratios = []
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
    await asyncio.gather(*[stream_one(session, url, p, 8, PENALTIES) for p in prompts[:2]])  # warm-up
    for repeat in range(repeats):
      figures = {}
      for kind in (("penalised", "plain") if repeat % 2 else ("plain", "penalised")):
        results = await asyncio.gather(*[stream_one(session, url, p, tokens, PENALTIES if kind == "penalised" else None) for p in prompts])
        figures[kind] = summarise(results)
      ratio = figures["penalised"]["tok_s"] / figures["plain"]["tok_s"]
      ratios.append(ratio)
      print(f"penalties N={n}, {tokens} tokens each, repeat {repeat + 1}: without {figures['plain']['tok_s']:.1f} tok/s, every row with "
            f"penalties and a logit_bias {figures['penalised']['tok_s']:.1f} tok/s: {ratio:.3f}x", flush=True)
  print(f"penalties, with / without, median of {repeats}: {statistics.median(ratios):.3f}x", flush=True)


async def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--engine", default="numpy")
  p.add_argument("--n", type=int, default=64, help="requests at once in the throughput part")
  p.add_argument("--tokens", type=int, default=96, help="tokens per request in the throughput part")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--no-suite", dest="suite", action="store_false")
  p.add_argument("--no-throughput", dest="throughput", action="store_false")
  p.add_argument("--penalties", action="store_true", help="also part 3: the logit processors' cost")
  args = p.parse_args()
  log_dir = Path(tempfile.mkdtemp(prefix="exo-bench-structured-"))
  cluster_args = argparse.Namespace(batch_size=max(args.n, CONCURRENCY), batch_timeout_ms=5.0, prefill_chunk=None)
  print(f"exo structured-output bench: engine {args.engine}, batch size {cluster_args.batch_size}; logs in {log_dir}", flush=True)
  async with Cluster(1, args.engine, True, cluster_args, log_dir) as cluster:
    if args.suite:
      await schema_suite(cluster.url)
    if args.throughput:
      await throughput(cluster, args.n, args.tokens, args.repeats)
    if args.penalties:
      await penalties(cluster, args.n, args.tokens, args.repeats)


if __name__ == "__main__":
  asyncio.run(main())
