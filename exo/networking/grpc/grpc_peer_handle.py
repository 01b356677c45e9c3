"""Client side of the ring: one gRPC channel to one peer (docs/architecture.md, "The ring protocol")."""
import asyncio
import logging
from typing import Awaitable, List, Optional

import grpc
import numpy as np

from exo.inference.shard import Shard
from exo.logs import VERBOSE
from exo.networking.grpc import node_service_pb2 as pb
from exo.networking.grpc import node_service_pb2_grpc as pb_grpc
from exo.networking.grpc.codec import decode_topology, encode_inference_state, encode_shard, encode_tensor
from exo.networking.peer_handle import PeerHandle
from exo.topology.device_capabilities import DeviceCapabilities
from exo.topology.topology import Topology

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # prefill of long prompts exceeds gRPC's 4 MiB default

# The options upstream nodes use, so both sides agree on message limits and keepalive policy.
CHANNEL_OPTIONS = [
  ("grpc.max_metadata_size", 32 * 1024 * 1024),
  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
  ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
  ("grpc.keepalive_time_ms", 10000),
  ("grpc.keepalive_timeout_ms", 5000),
  ("grpc.keepalive_permit_without_calls", 1),
  ("grpc.http2.max_pings_without_data", 0),
  ("grpc.http2.min_time_between_pings_ms", 10000),
  ("grpc.http2.min_ping_interval_without_data_ms", 5000),
  ("grpc.max_concurrent_streams", 100),
  ("grpc.tcp_nodelay", 1),
  ("grpc.optimization_target", "throughput"),
]
# Local only (not seen by peers): retry a lost peer every ≤2 s instead of gRPC's default backoff of up to
# 2 minutes, so a restarted node is reachable again as soon as discovery sees it.
RECONNECT_OPTIONS = [
  ("grpc.initial_reconnect_backoff_ms", 500),
  ("grpc.min_reconnect_backoff_ms", 500),
  ("grpc.max_reconnect_backoff_ms", 2000),
]

CONNECT_TIMEOUT_S = 10.0
HEALTH_CHECK_TIMEOUT_S = 5.0
OPAQUE_STATUS_TIMEOUT_S = 10.0
COLLECT_TOPOLOGY_TIMEOUT_S = 5.0
SEND_RESULT_TIMEOUT_S = 15.0
REFUSED_RETRY_WAITS_S = (0.01, 0.05, 0.2, None)  # pauses before resending a refused stream; None: give up
# Calls are gzip-compressed like upstream's, except those carrying tensors and token ids: float activations hardly
# compress, and compressing them costs more time than it saves (about 6 ms of the sender's event loop for a 64-token
# prompt's hidden states; a step's token rows are a few hundred bytes: gzip saves them no time and adds ~10% to the
# call's core time). Servers accept both. The channel has no default compression, because a call cannot turn a
# channel's default off (grpc.aio ignores compression=NoCompression then); the others ask for gzip.
GZIP = grpc.Compression.Gzip
TRAVELLING_STATE = ("prefix", "route", "params", "rows", "prompt_ids")  # the inference state's keys that go on the wire (JSON)


def refused_stream(error: grpc.aio.AioRpcError) -> bool:
  """Whether the peer refused the call's HTTP/2 stream (RST_STREAM REFUSED_STREAM, code 7) without processing it."""
  return error.code() == grpc.StatusCode.UNAVAILABLE and "error code 7" in (error.details() or "")


class GRPCPeerHandle(PeerHandle):
  def __init__(self, _id: str, address: str, desc: str, device_capabilities: DeviceCapabilities):
    self._id = _id
    self.address = address
    self.desc = desc
    self._device_capabilities = device_capabilities
    self.channel: Optional[grpc.aio.Channel] = None
    self.stub: Optional[pb_grpc.NodeServiceStub] = None
    self.health_failure: Optional[str] = None  # why the last health check failed

  def id(self) -> str:
    return self._id

  def addr(self) -> str:
    return self.address

  def description(self) -> str:
    return self.desc

  def device_capabilities(self) -> DeviceCapabilities:
    return self._device_capabilities

  def __repr__(self) -> str:
    return f"GRPCPeerHandle({self._id}@{self.address}, {self.desc})"

  # --- connection ---

  def _open_channel(self) -> None:
    if self.channel is None:
      self.channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS + RECONNECT_OPTIONS)
      self.stub = pb_grpc.NodeServiceStub(self.channel)

  async def connect(self) -> None:
    self._open_channel()
    await asyncio.wait_for(self.channel.channel_ready(), CONNECT_TIMEOUT_S)

  async def is_connected(self) -> bool:
    return self.channel is not None and self.channel.get_state() == grpc.ChannelConnectivity.READY

  async def disconnect(self) -> None:
    channel, self.channel, self.stub = self.channel, None, None
    if channel is not None:
      await channel.close()

  async def _ensure_connected(self) -> None:
    """Wait (≤ CONNECT_TIMEOUT_S) for the channel to be READY, but give up at once when the last connection attempt
    failed: a dead peer should fail the request now, not after ten seconds."""
    self._open_channel()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CONNECT_TIMEOUT_S
    state = self.channel.get_state(try_to_connect=True)
    while state != grpc.ChannelConnectivity.READY:
      if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
        raise ConnectionError(f"peer {self._id} at {self.address} unreachable")
      try:
        await asyncio.wait_for(self.channel.wait_for_state_change(state), deadline - loop.time())
      except asyncio.TimeoutError:
        raise ConnectionError(f"peer {self._id} at {self.address} unreachable for {CONNECT_TIMEOUT_S:.0f} s") from None
      state = self.channel.get_state()

  async def health_check(self) -> bool:
    """One fail-fast call (no wait for READY): a dead peer answers "unhealthy" at once, not after a connect timeout.
    A peer that refuses the check's stream (over its connection's stream limit, under load) answered: its server is
    up, so once the resends are refused too it still counts as healthy. `health_failure` says why the last check
    failed (None after one that passed)."""
    self._open_channel()
    try:
      response = await self.unless_refused(self.stub.HealthCheck, pb.HealthCheckRequest(), timeout=HEALTH_CHECK_TIMEOUT_S, compression=GZIP)
      self.health_failure = None if response.is_healthy else "it said it is unhealthy"
    except grpc.aio.AioRpcError as e:
      self.health_failure = None if refused_stream(e) else f"{e.code().name}: {e.details()}"
    except asyncio.CancelledError:
      raise
    except Exception as e:
      self.health_failure = repr(e)
    if self.health_failure:
      log.log(VERBOSE, "Health check of %s@%s failed: %s", self._id, self.address, self.health_failure)
    return self.health_failure is None

  # --- ring traffic ---

  @staticmethod
  def wire_state(inference_state: Optional[dict]) -> pb.InferenceState:
    # Upstream peers cannot take non-empty state, so only what this project's nodes exchange travels (in
    # other_data_json): the prompt prefix a request reuses, its route, its sampling parameters, its prompt's token ids
    # (on a route, to the first layers' node) and the rows of a packed message (exo/orchestration/routing/packing.py), which a node puts in the state only for peers that announced they
    # take them. Anything else stays here: the empty (present) state upstream senders send.
    travelling = {key: inference_state[key] for key in TRAVELLING_STATE if key in (inference_state or {})}
    return encode_inference_state(travelling) if travelling else pb.InferenceState()

  @staticmethod
  async def unless_refused(call, request, **options):
    """The call, sent again if the peer refused its HTTP/2 stream (RST_STREAM REFUSED_STREAM, code 7): a refused
    stream was never processed, so resending cannot run a request twice. A node serving many requests at once can
    exceed a connection's stream limit (upstream's 100) for a moment."""
    for wait in REFUSED_RETRY_WAITS_S:
      try:
        return await call(request, **options)
      except grpc.aio.AioRpcError as e:
        if not refused_stream(e) or wait is None:
          raise
      await asyncio.sleep(wait)

  async def send_prompt(self, shard: Shard, prompt: str, request_id: Optional[str] = None, inference_state: Optional[dict] = None) -> Optional[np.ndarray]:
    await self._ensure_connected()
    request = pb.PromptRequest(shard=encode_shard(shard), prompt=prompt, request_id=request_id, inference_state=self.wire_state(inference_state))
    await self.unless_refused(self.stub.SendPrompt, request, compression=GZIP)  # no deadline: the peer's first prefill may include a model download
    return None

  async def send_tensor(self, shard: Shard, tensor: np.ndarray, request_id: Optional[str] = None, inference_state: Optional[dict] = None) -> Optional[np.ndarray]:
    await self.start_tensor(shard, tensor, request_id, inference_state)
    return None

  def start_tensor(self, shard: Shard, tensor: np.ndarray, request_id: Optional[str] = None, inference_state: Optional[dict] = None) -> Awaitable[None]:
    """send_tensor, except that on a ready channel the call starts here, not when the caller next yields: a step's
    hop then leaves ahead of whatever the event loop has queued meanwhile (a pipeline pays two hops a token)."""
    request = pb.TensorRequest(shard=encode_shard(shard), tensor=encode_tensor(tensor), request_id=request_id, inference_state=self.wire_state(inference_state))
    started = self.stub.SendTensor(request) if self.channel is not None and self.channel.get_state() == grpc.ChannelConnectivity.READY else None
    return self._send_tensor(request, started)

  async def _send_tensor(self, request: pb.TensorRequest, started: Optional[grpc.aio.UnaryUnaryCall]) -> None:
    if started is not None:
      try:
        await started
        return
      except grpc.aio.AioRpcError as e:
        if not refused_stream(e):
          raise
    await self._ensure_connected()
    await self.unless_refused(self.stub.SendTensor, request)

  async def send_result(self, request_id: str, result: List[int], is_finished: bool) -> None:
    await self._ensure_connected()
    request = pb.SendResultRequest(request_id=request_id, is_finished=is_finished)
    if isinstance(result, np.ndarray) and result.ndim > 1:  # an image (H, W, 3) travels as a tensor
      request.tensor.CopyFrom(encode_tensor(result))
    else:
      request.result.extend(int(t) for t in result)
    await self.unless_refused(self.stub.SendResult, request, timeout=SEND_RESULT_TIMEOUT_S)

  async def send_opaque_status(self, request_id: str, status: str) -> None:
    await self._ensure_connected()
    request = pb.SendOpaqueStatusRequest(request_id=request_id, status=status)
    await self.unless_refused(self.stub.SendOpaqueStatus, request, timeout=OPAQUE_STATUS_TIMEOUT_S, compression=GZIP)

  async def send_token_rows(self, status: str) -> None:
    """A `tokens` status (one a step for each origin, exo/orchestration/routing/forwarding.py): a SendOpaqueStatus
    uncompressed, as the other calls that carry token ids, and bounded by the call's own deadline."""
    await self._ensure_connected()
    request = pb.SendOpaqueStatusRequest(request_id="", status=status)
    await self.unless_refused(self.stub.SendOpaqueStatus, request, timeout=OPAQUE_STATUS_TIMEOUT_S)

  async def collect_topology(self, visited: set, max_depth: int) -> Topology:
    await self._ensure_connected()
    request = pb.CollectTopologyRequest(visited=sorted(visited), max_depth=max_depth)
    response = await self.stub.CollectTopology(request, timeout=COLLECT_TOPOLOGY_TIMEOUT_S, compression=GZIP)
    return decode_topology(response)
