"""The `exo` command: start a node (and its HTTP API), or `exo run MODEL --prompt P` for answers in the terminal."""
import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

from exo import logs, settings
from exo.helpers import VERSION, find_available_port, get_or_create_node_id
from exo.inference.inference_engine import inference_engine_classes
from exo.inference.prefix_cache import DEFAULT_BUDGET_BYTES
from exo.orchestration.model_pool import max_loaded_models

os.environ.setdefault("GRPC_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

ENGINES = ["numpy", "tinygrad", "mlx", "dummy"]


def default_engine() -> str:
  """MLX on Apple silicon; elsewhere numpy, the fastest of our engines on CPUs (see README, "Engines")."""
  if platform.system() == "Darwin" and platform.machine() == "arm64":
    return "mlx"
  return "numpy"


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="exo", description="Run one language model across several machines, serving many users at once.")
  p.add_argument("command", nargs="?", choices=["run", "eval", "train"], help="run: answer --prompt in the terminal (eval/train are not in this build)")
  p.add_argument("model_name", nargs="?", help="model id, e.g. smollm2-135m, or a local checkpoint: a Hugging Face or MLX directory, or a .gguf file")
  settings.add_arguments(p)
  return p


def fail(message: str) -> None:
  print(f"exo: error: {message}", file=sys.stderr)
  sys.exit(2)


def build_discovery(args, node_id: str, node_port: int, caps):
  from exo.networking.discovery import NoDiscovery
  module = args.discovery_module
  if module is None:
    # A lone `exo run` is a ring of one: no discovery traffic at all.
    module = "none" if (args.command == "run" or args.run_model) and args.wait_for_peers == 0 else "udp"
  if module == "none":
    return NoDiscovery()
  from exo.networking.grpc.grpc_peer_handle import GRPCPeerHandle

  def create_peer_handle(peer_id, address, description, device_capabilities):
    return GRPCPeerHandle(peer_id, address, description, device_capabilities)
  allowed_ids = args.node_id_filter.split(",") if args.node_id_filter else None
  if module == "udp":
    from exo.networking.udp.udp_discovery import UDPDiscovery
    allowed_types = args.interface_type_filter.split(",") if args.interface_type_filter else None
    return UDPDiscovery(node_id, node_port, args.listen_port, args.broadcast_port, create_peer_handle, discovery_timeout=args.discovery_timeout,
                        device_capabilities=caps, allowed_node_ids=allowed_ids, allowed_interface_types=allowed_types)
  if module == "manual":
    from exo.networking.manual.manual_discovery import ManualDiscovery
    if not args.discovery_config_path:
      raise ValueError("--discovery-config-path is required when using manual discovery. Please provide a path to a config json file.")
    return ManualDiscovery(args.discovery_config_path, node_id, create_peer_handle=create_peer_handle)
  from exo.networking.tailscale.tailscale_discovery import TailscaleDiscovery
  return TailscaleDiscovery(node_id, node_port, create_peer_handle, discovery_timeout=args.discovery_timeout, device_capabilities=caps,
                            tailscale_api_key=args.tailscale_api_key, tailnet=args.tailnet_name, allowed_node_ids=allowed_ids)


def read_prompts(args) -> List[str]:
  prompts = list(args.prompt or [])
  if args.prompts_file:
    try:
      prompts += [line.strip() for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    except OSError as e:
      fail(f"cannot read --prompts-file: {e}")
  return prompts or ["Who are you?"]


async def run_prompts(node, engine_classname: str, model_id: str, prompts: List[str], timeout: float) -> None:
  """Run prompts concurrently through the node; one prompt streams to stdout, several print answers under each prompt."""
  from exo.inference.sampling import SamplingParams
  from exo.inference.tokenizers import eos_ids
  from exo.models import build_base_shard
  from exo.orchestration.generation import generate

  base_shard = build_base_shard(model_id, engine_classname)
  await node.inference_engine.ensure_shard(node.own_shard(base_shard))
  tokenizer = node.inference_engine.tokenizer
  params = SamplingParams(temperature=node.default_sample_temperature)
  ends = eos_ids(tokenizer)

  async def answer(prompt: str, stream: bool) -> List[int]:
    templated = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    tokens: List[int] = []
    printed = ""
    async for delta, _ in generate(node, base_shard, templated, params, timeout=timeout, prompt_ids=list(tokenizer.encode(templated))):
      tokens += delta
      if stream:
        text = tokenizer.decode([t for t in tokens if t not in ends])
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
          print(text[len(printed):], end="", flush=True)
          printed = text
    return tokens

  start = time.perf_counter()
  if len(prompts) == 1:
    tokens = [await answer(prompts[0], stream=True)]
    print()
  else:
    tokens = await asyncio.gather(*[answer(p, stream=False) for p in prompts])
    for prompt, answer_tokens in zip(prompts, tokens):
      text = tokenizer.decode([t for t in answer_tokens if t not in ends])
      print(f"\n>>> {prompt}\n{text}")
  elapsed = time.perf_counter() - start
  total = sum(len(t) for t in tokens)
  summary = f"{len(prompts)} prompt(s), {total} tokens, {elapsed:.2f} s, {total / elapsed:.1f} tokens/s"
  for extra in node.plugins.hook.exo_run_summary(node=node):
    summary += f", {extra}"
  print(summary, file=sys.stderr if len(prompts) == 1 else sys.stdout)


def load_installed_plugins(node) -> List[str]:
  """Register the plugins installed in the `exo` entry-point group with the node; their names. Only the command
  does this: a Node built in code (a test, an embedding program) runs exactly the plugins it is given."""
  before = {name for name, _ in node.plugins.list_name_plugin()}
  node.plugins.load_setuptools_entrypoints("exo")
  return sorted(name for name, _ in node.plugins.list_name_plugin() if name not in before)


def prefix_cache_budget(args, environ) -> int:
  """Bytes of KV the prefix cache may keep for ended requests (0: off), from the flags, else the environment."""
  switch = str(settings.env("EXO_PREFIX_CACHE", "", environ)).strip().lower()
  if switch not in ("", "0", "1", "off", "on", "false", "true"):
    raise ValueError(f"EXO_PREFIX_CACHE must be 0 or 1 (off or on), got {environ['EXO_PREFIX_CACHE']!r}")
  if args.no_prefix_cache or switch in ("0", "off", "false"):
    return 0
  mb, _ = settings.number(args, environ, "prefix_cache_mb", 0, 1 << 24, f"a number of MiB from 0 to {1 << 24}", integer=False)
  return DEFAULT_BUDGET_BYTES if mb is None else int(mb * 2**20)


def quantize_setting(args, environ) -> Optional[int]:
  """Bits float checkpoints are quantized to as they load (None: kept as they are), from the flag, else the environment."""
  from exo.inference.quantize import parse_bits
  raw, name = settings.given(args, environ, "quantize")
  return parse_bits(raw, name)


def ollama_stores(args, environ) -> List[Path]:
  """The Ollama model store to serve: --ollama-models, else $OLLAMA_MODELS, else ~/.ollama/models where it is one. A
  flag that names no store stops the node; Ollama's variable naming none (Ollama not run yet) is only reported."""
  from exo.ollama_store import chosen_store
  raw, name = settings.given(args, environ, "ollama_models")
  try:
    store = chosen_store(raw, name)
  except ValueError as e:
    if name.startswith("--"):
      raise
    print(f"exo: {e}; no Ollama models served", file=sys.stderr, flush=True)
    return []
  return [store] if store is not None else []


def placement_settings(args, environ) -> Tuple[str, Optional[int]]:
  """(placement mode, memory offered in MiB or None for the machine's), from the flags, else the environment."""
  raw_mode, _ = settings.given(args, environ, "placement")
  mode = str(raw_mode).strip().lower() if raw_mode is not None else "auto"
  if mode not in ("auto", "pipeline", "replicas"):
    raise ValueError(f"EXO_PLACEMENT must be auto, pipeline or replicas, got {environ['EXO_PLACEMENT']!r}")
  memory, _ = settings.number(args, environ, "memory_mb", 1, 1 << 40, f"a whole number of MiB from 1 to {1 << 40}")
  return mode, memory


async def main(args) -> int:
  from exo.download.errors import DownloadError
  from exo.download.cluster_files import ClusterFiles
  from exo.download.peer_files import upload_rate
  from exo.download.shard_download import HFShardDownloader, NoopShardDownloader
  from exo.inference.engines import get_inference_engine
  from exo.inference.models import UnsupportedModel
  from exo.local_checkpoints import serve as serve_local_checkpoints
  from exo.models import DEFAULT_MODEL, build_base_shard, get_supported_models, model_cards
  from exo.orchestration.node import Node
  from exo.topology.ring_memory_weighted_partitioning_strategy import RingMemoryWeightedPartitioningStrategy

  engine_name = args.inference_engine or default_engine()
  if engine_name not in ENGINES:
    fail(f"unknown inference engine {engine_name!r}; choose one of: {', '.join(ENGINES)}")
  engine_classname = inference_engine_classes[engine_name]
  model_id = args.model_name or args.run_model
  try:
    model_id, args.default_model = serve_local_checkpoints([model_id, args.default_model], args.models_dir, ollama_stores(args, os.environ))
  except ValueError as e:
    fail(str(e))
  if args.command == "run" or args.run_model:
    if not model_id:
      fail("`exo run` needs a model, e.g. `exo run smollm2-135m --prompt \"Hello\"`")
    if model_id not in model_cards:
      fail(f"unknown model {model_id!r}; known models: {', '.join(model_cards)} (or a local checkpoint's path)")
    if build_base_shard(model_id, engine_classname) is None:
      fail(f"model {model_id!r} cannot run on the {engine_name} engine; models for it: {', '.join(get_supported_models([[engine_name]]))}")
  elif args.command in ("eval", "train"):
    fail(f"`exo {args.command}` needs an MLX training engine, which this build does not include")

  from exo.api.settings import api_settings_from
  try:
    api_settings = api_settings_from(args, os.environ)
  except ValueError as e:
    fail(str(e))

  batching = None
  try:
    from exo.orchestration.batching.config import batching_config_from
    batching = batching_config_from(args, os.environ)
  except ImportError:
    pass
  except ValueError as e:
    fail(str(e))

  try:
    prefix_budget = prefix_cache_budget(args, os.environ)
    placement, memory_mb = placement_settings(args, os.environ)
    max_models = max_loaded_models(args, os.environ)
    quantize_bits = quantize_setting(args, os.environ)
    peer_upload_rate = upload_rate(os.environ)
  except ValueError as e:
    fail(str(e))

  node_id = args.node_id or get_or_create_node_id()
  cluster_files = ClusterFiles(node_id)  # the models the cluster's nodes hold: each fetches from the others before the hub
  shard_downloader = NoopShardDownloader() if engine_name == "dummy" else HFShardDownloader(args.max_parallel_downloads, node_id, cluster_files)
  try:
    engine = get_inference_engine(engine_name, shard_downloader)
  except ImportError as e:
    fail(f"the {engine_name} engine is not installed ({e.name} missing); install it with: pip install 'exo[{engine_name}]'")
  if quantize_bits is not None:
    if not getattr(engine, "keeps_quantized", False):
      fail(f"--quantize / EXO_QUANTIZE needs an engine that keeps weights quantized (numpy or mlx), not {engine_name}")
    engine.quantize_bits = quantize_bits
    print(f"exo: float checkpoints are quantized to {quantize_bits} bits as they load", file=sys.stderr, flush=True)
  engine.set_prefix_budget(prefix_budget)
  if engine.copies_prefixes:
    state = f"on, keeping up to {prefix_budget / 2**20:,.0f} MiB of ended requests' prompts" if prefix_budget else "off"
    print(f"exo: prefix cache {state}", file=sys.stderr, flush=True)
  node_port = args.node_port or find_available_port(args.node_host)
  from exo.topology.device_capabilities import device_capabilities, measure_gflops
  caps = await device_capabilities(engine.device_name)
  if memory_mb is not None:
    caps = caps.model_copy(update={"memory": memory_mb})
  try:
    discovery = build_discovery(args, node_id, node_port, caps)
  except (ValueError, FileNotFoundError) as e:
    fail(str(e))
  is_run = args.command == "run" or bool(args.run_model)
  topology_viz = None
  if not is_run and not args.disable_tui:
    from exo.viz.topology_viz import TopologyViz
    topology_viz = TopologyViz(chatgpt_api_endpoints=[f"http://localhost:{args.chatgpt_api_port}/v1/chat/completions"],
                               web_chat_urls=[f"http://localhost:{args.chatgpt_api_port}"])
  node = Node(node_id, None, engine, discovery, shard_downloader, partitioning_strategy=RingMemoryWeightedPartitioningStrategy(),
              max_generate_tokens=args.max_generate_tokens, default_sample_temperature=args.default_temp, topology_viz=topology_viz)
  plugins = load_installed_plugins(node)  # before batching, as when Node() loaded them: batching's hooks still run first
  if plugins:
    print(f"exo: plugins {', '.join(plugins)}", file=sys.stderr, flush=True)
  if batching is not None:
    from exo.orchestration.batching.plugin import register_batching
    register_batching(node, batching)
  from exo.topology.model_size import engine_float_bytes
  node.memory_offered_mb = memory_mb
  node.model_pool.max_models = max_models
  node.placements.enable(placement, engine_float_bytes(engine_name), await asyncio.to_thread(measure_gflops))
  print(f"exo: placement {placement}, offering {caps.memory:,} MiB, measured {node.placements.speed:g} GFLOP/s", file=sys.stderr, flush=True)

  def broadcast_download_progress(shard, event) -> None:
    # The ring (and /v1/download/progress, tinychat's download view) learns how this node's downloads go. The
    # downloader sends "not_started" only for a download that failed: peers then stop listing it as under way.
    # `sources` (this fork's; upstream nodes read `progress` only): where each file arriving now comes from.
    status = {"type": "download_progress", "node_id": node.id, "progress": event.to_dict(), "sources": shard_downloader.arriving_from(shard.model_id)}
    node.spawn(node.broadcast_opaque_status("", json.dumps(status)))
  shard_downloader.on_progress.register("broadcast").on_next(broadcast_download_progress)
  from exo.networking.discovery import NoDiscovery
  if not isinstance(discovery, NoDiscovery):
    from exo.networking.grpc.grpc_server import GRPCServer
    node.server = GRPCServer(node, args.node_host, node_port)

  loop = asyncio.get_running_loop()
  stop_event = asyncio.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):
    loop.add_signal_handler(sig, stop_event.set)

  await node.start(wait_for_peers=args.wait_for_peers)
  try:
    if is_run:
      if args.wait_for_peers > 0:
        from exo.topology.ring import wait_for_agreement
        if not await wait_for_agreement(node, timeout=30.0):  # peers that do not know us yet would drop our tokens
          print("exo: warning: peers do not agree on the ring yet; running anyway", file=sys.stderr)
      runner = asyncio.create_task(run_prompts(node, engine_classname, model_id, read_prompts(args), 300.0))
      stopper = asyncio.create_task(stop_event.wait())
      await asyncio.wait([runner, stopper], return_when=asyncio.FIRST_COMPLETED)
      stopper.cancel()
      if not runner.done():
        runner.cancel()
        return 130
      try:
        runner.result()
      except (DownloadError, UnsupportedModel) as e:
        print(f"exo: error: {e}", file=sys.stderr)  # one line that says what failed and why; no traceback
        return 1
      if args.wait_for_peers > 0:
        await asyncio.sleep(5)  # let peers see the final result before this node leaves the ring
      return 0
    from exo.api import ChatGPTAPI
    node.placements.expected = build_base_shard(args.default_model or DEFAULT_MODEL, engine_classname)  # loaded once placed
    api = ChatGPTAPI(node, engine_classname, response_timeout=args.chatgpt_api_response_timeout, default_model=args.default_model or DEFAULT_MODEL,
                     system_prompt=args.system_prompt, on_quit=stop_event.set, settings=api_settings)
    if isinstance(shard_downloader, HFShardDownloader) and not isinstance(discovery, NoDiscovery):
      cluster_files.attach(node, api.app, args.chatgpt_api_port, peer_upload_rate)  # peers fetch this node's verified model files from its API
    if topology_viz is not None:
      topology_viz.start()
    print(f"exo {VERSION}: node {node_id}, engine {engine_name}, chat at http://localhost:{args.chatgpt_api_port}", flush=True)
    print(f"exo: {api_settings.describe()}; listening on {args.chatgpt_api_host}:{args.chatgpt_api_port}", file=sys.stderr, flush=True)
    await api.run(host=args.chatgpt_api_host, port=args.chatgpt_api_port)
    await stop_event.wait()
    return 0
  finally:
    if topology_viz is not None:
      topology_viz.stop()
    await cluster_files.stop()
    await node.stop()


def run_event_loop(coro):
  """Run on uvloop where it is installed: it carries a node's gRPC and HTTP traffic with about a tenth less CPU
  than asyncio's own loop, CPU that would otherwise come out of the engine's steps."""
  try:
    import uvloop
  except ImportError:
    return asyncio.run(coro)
  return uvloop.run(coro)


def run() -> None:
  args = build_parser().parse_args()
  logs.configure()
  try:
    sys.exit(run_event_loop(main(args)))
  except KeyboardInterrupt:
    sys.exit(130)


if __name__ == "__main__":
  run()
