"""Helpers for tests that start real `exo` processes on loopback: free ports, manual-discovery configs, per-node
EXO_HOME, and readiness by polling (logs, gRPC health, topology and the agreed placement) with `eventually`, never by
fixed sleeps."""
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import aiohttp

from tests.support.waiting import eventually

REPO = Path(__file__).resolve().parents[2]  # the checkout, two folders up from tests/support
QUESTION = "What is the capital of France?"
TOKEN_LINE = re.compile(r"^\[(?P<rid>[^\]]+)\] token (?P<token>\d+) ", re.M)  # DEBUG=2 logs each sampled token


def free_port(kind: int = socket.SOCK_STREAM) -> int:
  with socket.socket(socket.AF_INET, kind) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def device_caps(memory: int = 8192) -> dict:
  return {"model": "test box", "chip": "test chip", "memory": memory, "flops": {"fp32": 0.0, "fp16": 0.0, "int8": 0.0}}


def write_manual_config(path: Path, grpc_ports: Dict[str, int], memory: int = 8192) -> Path:
  peers = {node_id: {"address": "127.0.0.1", "port": port, "device_capabilities": device_caps(memory)} for node_id, port in grpc_ports.items()}
  path.write_text(json.dumps({"peers": peers}, indent=2))
  return path


class ExoProcess:
  """One `exo` process: its arguments, its own EXO_HOME, and its combined output in a log file. The tests written for
  one ring over every node (layers split between processes) run it with EXO_PLACEMENT=pipeline unless they ask for
  another placement in `env` (the CLI's default, auto, makes a replica of a model on every node that holds one)."""

  def __init__(self, node_id: str, args: List[str], workdir: Path, env: Optional[Dict[str, str]] = None, prefix: Iterable[str] = ()):
    self.node_id = node_id
    self.args = args
    self.workdir = workdir
    self.home = workdir / f"exo_home_{node_id}"
    self.home.mkdir(parents=True, exist_ok=True)
    self.extra_env = env or {}
    self.prefix = list(prefix)  # e.g. ["ip", "netns", "exec", NAME]
    self.proc: Optional[subprocess.Popen] = None
    self.log_path = workdir / f"{node_id}.log"
    self.starts = 0

  def start(self) -> "ExoProcess":
    self.starts += 1
    env = {"EXO_PLACEMENT": "pipeline", **os.environ, "EXO_HOME": str(self.home), "PYTHONUNBUFFERED": "1", **self.extra_env}
    log = open(self.log_path, "a")
    log.write(f"\n===== start {self.starts} =====\n")
    log.flush()
    command = self.prefix + [sys.executable, "-m", "exo.main", *self.args, "--node-id", self.node_id]
    # Own process group, so stopping a node never touches anything else the test runs.
    self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=REPO, start_new_session=True)
    log.close()
    return self

  def log(self) -> str:
    return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

  def current_log(self) -> str:
    """Output of the latest start only."""
    return self.log().rsplit(f"===== start {self.starts} =====", 1)[-1]

  def running(self) -> bool:
    return self.proc is not None and self.proc.poll() is None

  def check_running(self, before: str) -> None:
    if not self.running():
      raise AssertionError(f"{self.node_id} exited ({self.proc.returncode}) before {before}:\n{self.current_log()[-3000:]}")

  async def wait_for_log(self, pattern: str, timeout: float) -> re.Match:
    def logged():
      match = re.search(pattern, self.current_log(), re.M)
      if match is None:
        self.check_running(f"logging {pattern!r}")
      return match
    return await eventually(logged, timeout, lambda: f"{self.node_id} logging {pattern!r}:\n{self.current_log()[-3000:]}", interval=0.1)

  def wait(self, timeout: float) -> int:
    try:
      return self.proc.wait(timeout)
    except subprocess.TimeoutExpired:
      raise AssertionError(f"{self.node_id} still running after {timeout} s:\n{self.current_log()[-3000:]}") from None

  def kill(self) -> None:
    """Abrupt death (SIGKILL), as a crash or a pulled cable looks to the rest of the ring."""
    if self.running():
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait(10)

  def stop(self, timeout: float = 10) -> None:
    if self.running():
      os.killpg(self.proc.pid, signal.SIGTERM)
      try:
        self.proc.wait(timeout)
      except subprocess.TimeoutExpired:
        self.kill()


async def grpc_health(port: int) -> bool:
  from exo.networking.grpc.grpc_peer_handle import GRPCPeerHandle
  from exo.topology.device_capabilities import UNKNOWN_DEVICE_CAPABILITIES
  peer = GRPCPeerHandle("probe", f"127.0.0.1:{port}", "test", UNKNOWN_DEVICE_CAPABILITIES)
  try:
    return await peer.health_check()
  finally:
    await peer.disconnect()


async def collect_topologies(ports: Dict[str, int]) -> Dict[str, object]:
  """Each node's own topology view, fetched over gRPC CollectTopology."""
  from exo.networking.grpc.grpc_peer_handle import GRPCPeerHandle
  from exo.topology.device_capabilities import UNKNOWN_DEVICE_CAPABILITIES
  views = {}
  for node_id, port in ports.items():
    peer = GRPCPeerHandle(node_id, f"127.0.0.1:{port}", "test", UNKNOWN_DEVICE_CAPABILITIES)
    try:
      views[node_id] = await peer.collect_topology(set(), 1)
    except Exception:
      views[node_id] = None
    finally:
      await peer.disconnect()
  return views


def ring_formed(views: Dict[str, object]) -> bool:
  """Every node sees every other as a peer, with everyone's capabilities: they all compute the same ring."""
  members = set(views)
  for node_id, topology in views.items():
    if topology is None or set(topology.nodes) != members:
      return False
    if {c.to_id for c in topology.peer_graph.get(node_id, ())} != members - {node_id}:
      return False
  return len({json.dumps({k: v.to_dict() for k, v in sorted(t.nodes.items())}) for t in views.values()}) == 1


async def wait_until_views(collect, holds, timeout: float, processes: Iterable[ExoProcess], what: str, brief) -> Dict[str, object]:
  """Collect every node's view (`collect()`: node id -> view) until `holds(views)`; a process that exits meanwhile
  fails the wait at once. `brief(view)` is what a failure shows of each view."""
  views: Dict[str, object] = {}

  async def held():
    for p in processes:
      p.check_running(what)
    views.update(await collect())
    return views if holds(views) else None
  return await eventually(held, timeout, lambda: f"{what}; seen {[(k, v and brief(v)) for k, v in views.items()]}", interval=0.25)


async def wait_for_ring(ports: Dict[str, int], timeout: float, processes: Iterable[ExoProcess] = ()) -> Dict[str, object]:
  return await wait_until_views(lambda: collect_topologies(ports), ring_formed, timeout, processes, f"ring {sorted(ports)} formed",
                                lambda topology: sorted(topology.nodes))


async def placement_views(urls: Dict[str, str]) -> Dict[str, Optional[dict]]:
  """Each node's placement as its /v1/topology shows it (None where the API did not answer)."""
  async with aiohttp.ClientSession() as session:
    async def view(url: str) -> Optional[dict]:
      try:
        async with session.get(f"{url}/v1/topology", timeout=aiohttp.ClientTimeout(total=5)) as response:
          return (await response.json())["placement"]
      except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    return dict(zip(urls, await asyncio.gather(*[view(url) for url in urls.values()])))


def placement_agreed(views: Dict[str, Optional[dict]]) -> bool:
  """Every node routes (it heard every peer's facts), counts exactly these nodes as members, and derives its placement
  from the same facts as the others (one version): a request sent now is placed over all of them."""
  members = set(views)
  return (all(v is not None and v["active"] and set(v["members"]) == members for v in views.values())
          and len({v["version"] for v in views.values()}) == 1)


async def wait_for_placement(urls: Dict[str, str], timeout: float, processes: Iterable[ExoProcess] = ()) -> Dict[str, dict]:
  """Until every node's placement counts every node in `urls`. A node answers its API (and forms the ring) before it
  has heard the others' placement facts; until then it places a request over itself alone."""
  return await wait_until_views(lambda: placement_views(urls), placement_agreed, timeout, processes, f"placement over {sorted(urls)} agreed",
                                lambda view: (view["version"], sorted(view["members"])))


def node_args(port: int, api_port: int, config, engine: str) -> list:
  return ["--inference-engine", engine, "--node-host", "127.0.0.1", "--node-port", str(port), "--chatgpt-api-port", str(api_port),
          "--discovery-module", "manual", "--discovery-config-path", str(config), "--disable-tui"]


class Cluster:
  """exo server nodes (no command: gRPC + HTTP API) listed in one manual-discovery config."""

  def __init__(self, tmp_path, ids, engine: str, env: dict):
    self.ports = {node_id: free_port() for node_id in ids}
    self.api_ports = {node_id: free_port() for node_id in ids}
    self.config = write_manual_config(tmp_path / "peers.json", self.ports)
    self.nodes = {node_id: ExoProcess(node_id, node_args(self.ports[node_id], self.api_ports[node_id], self.config, engine), tmp_path, env)
                  for node_id in ids}

  def url(self, node_id: str) -> str:
    return f"http://127.0.0.1:{self.api_ports[node_id]}"

  async def wait_api(self, node_id: str, timeout: float = 60) -> None:
    async with aiohttp.ClientSession() as session:
      async def healthy() -> bool:
        try:
          async with session.get(f"{self.url(node_id)}/healthcheck", timeout=aiohttp.ClientTimeout(total=2)) as response:
            return response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
          self.nodes[node_id].check_running("its API answered")
          return False
      await eventually(healthy, timeout, f"{node_id}'s API up", interval=0.2)

  async def start(self, ids=None, ring_timeout: float = 60) -> None:
    """Start these nodes (default: all) and return once every running node sees the same ring and places requests
    over all of them."""
    ids = list(ids or self.nodes)
    for node_id in ids:
      self.nodes[node_id].start()
    for node_id in ids:
      await self.wait_api(node_id)
    running = [i for i, node in self.nodes.items() if node.running()]
    processes = [self.nodes[i] for i in running]
    await wait_for_ring({i: self.ports[i] for i in running}, ring_timeout, processes)
    await wait_for_placement({i: self.url(i) for i in running}, ring_timeout, processes)

  def stop(self) -> None:
    for node in self.nodes.values():
      node.stop()


async def chat(url: str, model: str, content: str, timeout: float = 240, **extra) -> dict:
  body = {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}
  async with aiohttp.ClientSession() as session:
    async with session.post(f"{url}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
      reply = await response.json()
      assert response.status == 200, reply
      return reply


def tokens_of(log: str, request_id: str) -> list:
  return [int(m["token"]) for m in TOKEN_LINE.finditer(log) if m["rid"] == request_id]


def record_inference_states(node) -> list:
  """Every inference state the node's process_tensor is given from now on (a copy of each), in arrival order."""
  states = []
  process_tensor = node.process_tensor

  async def recording(base_shard, tensor, request_id=None, inference_state=None, accepted=None):
    states.append(dict(inference_state or {}))
    return await process_tensor(base_shard, tensor, request_id, inference_state, accepted=accepted)
  node.process_tensor = recording
  return states


def run_answers(output: str, prompts: List[str]) -> List[str]:
  """The answers in `exo run`'s output for several prompts: '>>> PROMPT' then the answer, for each, then a summary line."""
  found = []
  for i, prompt in enumerate(prompts):
    after = output.split(f"\n>>> {prompt}\n", 1)[1]
    end = f"\n\n>>> {prompts[i + 1]}\n" if i + 1 < len(prompts) else f"\n{len(prompts)} prompt(s), "
    found.append(after.split(end, 1)[0])
  return found
