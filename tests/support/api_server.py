"""A real exo node (a ring of one, no networking) with its HTTP API on a free loopback port, running on its own
event loop in a background thread, so tests can use any client: the sync `openai` package, aiohttp, a browser."""
import asyncio
import atexit
import socket
import threading
from typing import Dict, Optional, Union

import aiohttp
import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

from exo.api import ChatGPTAPI
from exo.download.shard_download import HFShardDownloader, NoopShardDownloader
from exo.inference.dummy_inference_engine import DummyInferenceEngine
from exo.inference.engines import get_inference_engine
from exo.inference.inference_engine import InferenceEngine, inference_engine_classes
from exo.networking.discovery import NoDiscovery
from exo.orchestration.batching.config import BatchingConfig
from exo.orchestration.batching.plugin import register_batching
from exo.orchestration.node import Node
from exo.topology.ring_memory_weighted_partitioning_strategy import RingMemoryWeightedPartitioningStrategy


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class ApiServer:
  def __init__(self, engine: Union[str, InferenceEngine] = "dummy", max_generate_tokens: int = 10000, batching: Optional[BatchingConfig] = None,
               placement: Optional[str] = None, **api_kwargs):
    self.engine_spec = engine
    self.placement = placement  # EXO_PLACEMENT of its node, as `exo` enables it (None: off, as a plain Node)
    self.max_generate_tokens = max_generate_tokens
    self.batching = batching
    self.api_kwargs = api_kwargs
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.loop = asyncio.new_event_loop()
    self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=f"exo-api-{self.port}")
    self.quit_requested = threading.Event()
    self.node: Optional[Node] = None
    self.api: Optional[ChatGPTAPI] = None

  def call(self, coro, timeout: float = 120):
    """Run a coroutine on the server's loop and wait for its result."""
    return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

  def start(self) -> "ApiServer":
    self.thread.start()
    self.call(self._start())
    return self

  async def _start(self) -> None:
    if isinstance(self.engine_spec, str):
      downloader = NoopShardDownloader() if self.engine_spec == "dummy" else HFShardDownloader()
      engine = get_inference_engine(self.engine_spec, downloader)
      classname = inference_engine_classes[self.engine_spec]
    else:
      # A test engine built on the dummy one runs the dummy model.
      engine, downloader = self.engine_spec, NoopShardDownloader()
      classname = "DummyInferenceEngine" if isinstance(engine, DummyInferenceEngine) else engine.__class__.__name__
    self.node = Node("api-test-node", None, engine, NoDiscovery(), downloader, partitioning_strategy=RingMemoryWeightedPartitioningStrategy(),
                     max_generate_tokens=self.max_generate_tokens)
    if self.batching is not None:
      register_batching(self.node, self.batching)
    if self.placement is not None:
      self.node.placements.enable(self.placement, 4, 1.0)
    await self.node.start()
    kwargs = {"default_model": "dummy" if classname == "DummyInferenceEngine" else "smollm2-135m", **self.api_kwargs}
    self.api = ChatGPTAPI(self.node, classname, on_quit=self.quit_requested.set, **kwargs)
    await self.api.run(host="127.0.0.1", port=self.port)

  def stop(self) -> None:
    if not self.thread.is_alive():
      return
    try:
      self.call(self._stop(), timeout=30)
    finally:
      self.loop.call_soon_threadsafe(self.loop.stop)
      self.thread.join(10)

  async def _stop(self) -> None:
    await self.api.stop()
    if isinstance(self.engine_spec, SlowEngine):
      self.engine_spec.hurry()  # a node's stop waits for the step under way: a slow one ends now
    await self.node.stop()


class SlowEngine(DummyInferenceEngine):
  """Dummy tokens, but every ring pass after the first `fast` ones takes `delay` seconds (until `hurry`: the server
  stopping, which waits for the step under way)."""

  def __init__(self, delay: float, fast: int = 0):
    super().__init__()
    self.delay, self.fast, self.passes = delay, fast, 0
    self.hurried = threading.Event()

  def hurry(self) -> None:
    self.hurried.set()

  async def infer_tensor(self, request_id, shard, input_data, inference_state=None):
    self.passes += 1
    if self.passes > self.fast and not self.hurried.is_set():
      await asyncio.get_running_loop().run_in_executor(None, self.hurried.wait, self.delay)
    return await super().infer_tensor(request_id, shard, input_data, inference_state)


class FailingEngine(DummyInferenceEngine):
  async def infer_tensor(self, request_id, shard, input_data, inference_state=None):
    if int(np.asarray(input_data).reshape(-1)[0]) >= 4:  # the third token's pass fails
      raise RuntimeError("engine exploded")
    return await super().infer_tensor(request_id, shard, input_data, inference_state)


_shared: Dict[str, ApiServer] = {}


def openai_client(server: "ApiServer", timeout: float = 180) -> openai.OpenAI:
  """The official client against the server's API, failing fast (no retries)."""
  return openai.OpenAI(base_url=f"{server.url}/v1", api_key="exo", timeout=timeout, max_retries=0)


async def post_json(url: str, path: str, body: dict, timeout: float = 120):
  """POST a JSON body to the server at `url`: (status, the reply's JSON)."""
  async with aiohttp.ClientSession() as session:
    async with session.post(f"{url}{path}", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
      return response.status, await response.json()


async def scrape(url: str) -> dict:
  """The node's /metrics, parsed by prometheus_client: {(sample name, labels as a sorted tuple): value}."""
  async with aiohttp.ClientSession() as session:
    async with session.get(f"{url}/metrics") as r:
      assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
      text = await r.text()
  return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text) for s in family.samples}


def shared_server(engine: str) -> ApiServer:
  """One server per engine for the whole pytest run: loading SmolLM2 takes ~15 s on two cores, so do it once."""
  if engine not in _shared:
    _shared[engine] = ApiServer(engine).start()
    atexit.register(_shared[engine].stop)
  return _shared[engine]
