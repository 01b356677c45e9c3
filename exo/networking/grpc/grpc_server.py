"""Server side of the ring: NodeService handlers that hand work to the Node (docs/architecture.md, "The ring protocol")."""
import asyncio
import ipaddress
import logging
from typing import Optional, Set

import grpc

from exo.inference.shard import Shard
from exo.local_checkpoints import model_card
from exo.logs import VERBOSE, level_of
from exo.models import build_base_shard
from exo.networking.grpc import node_service_pb2 as pb
from exo.networking.grpc import node_service_pb2_grpc as pb_grpc
from exo.networking.grpc.codec import decode_inference_state, decode_shard, decode_tensor, encode_topology, is_empty_tensor
from exo.networking.grpc.grpc_peer_handle import CHANNEL_OPTIONS
from exo.networking.server import Server
from exo.orchestration.steps.loop import accept

log = logging.getLogger(__name__)
MESSAGES, STATUSES = level_of(5), level_of(8)  # each message received; each status too

# Upstream's server options: its client's, plus no HTTP/2 stream cap. keepalive_permit_without_calls=1 and a 5 s
# minimum ping interval are what let upstream clients ping every 10 s while idle without being sent GOAWAY.
SERVER_OPTIONS = CHANNEL_OPTIONS + [("grpc.http2.max_concurrent_streams", 0)]
STOP_GRACE_S = 5.0
REPLY_WAIT_S = 0.1  # a reply waits at most this long for the forward pass to start


def caller_host(peer: Optional[str]) -> Optional[str]:
  """The IP address in a gRPC `context.peer()` ("ipv4:10.0.0.2:5678", "ipv6:[::1]:5678"), or None (unix sockets)."""
  if not peer or not peer.startswith(("ipv4:", "ipv6:")):
    return None
  address = peer.split(":", 1)[1].rsplit(":", 1)[0].strip("[]")
  try:
    return str(ipaddress.ip_address(address.split("%")[0]))
  except ValueError:
    return None


class GRPCServer(Server, pb_grpc.NodeServiceServicer):
  def __init__(self, node, host: str, port: int):
    self.node = node
    self.host = host
    self.port = port
    self.server = None
    self._work: Set[asyncio.Task] = set()  # accepted prompts/tensors still running

  async def start(self) -> None:
    self.server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_NodeServiceServicer_to_server(self, self.server)
    address = f"{self.host}:{self.port}"
    try:
      bound = self.server.add_insecure_port(address)
    except RuntimeError as e:
      raise OSError(f"cannot listen for gRPC on {address}: {e}") from e
    if bound == 0:
      raise OSError(f"cannot listen for gRPC on {address}")
    await self.server.start()
    log.log(VERBOSE, "Server started, listening on %s", address)

  async def stop(self) -> None:
    for task in list(self._work):
      task.cancel()
    await asyncio.gather(*self._work, return_exceptions=True)
    if self.server is not None:
      await self.server.stop(grace=STOP_GRACE_S)
      self.server = None
      log.log(VERBOSE, "Server stopped and all connections are closed")

  # --- helpers ---

  def _shard(self, message: pb.Shard, state: Optional[dict] = None) -> Shard:
    """The request's shard, checked against the model registry (or the local checkpoints this node serves), this
    node's engine and this node's ring (a request that carries its route is checked against the route by the node)."""
    shard = decode_shard(message)
    card = model_card(shard.model_id)
    if card is None:
      raise ValueError(f"unknown model {shard.model_id!r}")
    if shard.n_layers != card["layers"]:
      raise ValueError(f"model {shard.model_id!r} has {card['layers']} layers, the request says {shard.n_layers}")
    engine_classes = [cls.__name__ for cls in type(self.node.inference_engine).__mro__]  # subclasses run what their base runs
    if all(build_base_shard(shard.model_id, name) is None for name in engine_classes):
      raise ValueError(f"model {shard.model_id!r} cannot run on this node's {engine_classes[0]}")
    if state is not None and "route" in state:
      return shard
    # The sender computed our layer range from its view of the ring; if ours differs (views still converging after
    # a membership change), running would produce garbage: refuse, so the sender ends the request with an error.
    own = self.node.get_current_shard(shard)
    if (own.start_layer, own.end_layer) != (shard.start_layer, shard.end_layer):
      raise ValueError(f"the sender's ring differs from this node's: it asked for layers {shard.start_layer}-{shard.end_layer}, "
                       f"this node holds {own.start_layer}-{own.end_layer}")
    return shard

  async def _from_member(self, context) -> Optional[str]:
    """The caller's address, if it is a ring member's; otherwise the call ends with PERMISSION_DENIED. Messages
    about requests come only from the ring: a stranger must not start, feed or end anyone's generation. (A malformed
    message gets INVALID_ARGUMENT first, from anyone: that tells nothing and runs nothing.)"""
    host = caller_host(context.peer())
    if not self.node.is_member_host(host):
      await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{host or context.peer()} is not a member of this node's ring")
    return host

  async def _accept(self, work, what: str) -> None:
    """Work on in the background (as upstream's servers do), so each hop is free for the next message and the ring
    pipelines; reply once the node accepts the message (its forward pass has started, see exo/orchestration/steps/loop.py), the work
    has ended, or REPLY_WAIT_S has passed. `work(accepted)` makes the node's coroutine. Failures end the request
    through the Node (Lifecycle.fail_request), not through this reply."""
    loop = asyncio.get_running_loop()
    accepted = loop.create_future()
    coro = work(accepted)

    async def run():
      try:
        await coro
      except asyncio.CancelledError:
        raise
      except Exception as e:
        log.log(VERBOSE, "%s failed: %r", what, e)
    task = asyncio.create_task(run())
    self._work.add(task)
    task.add_done_callback(self._work.discard)
    task.add_done_callback(lambda _: accept(accepted))
    timer = loop.call_later(REPLY_WAIT_S, accept, accepted)
    try:
      await accepted
    finally:
      timer.cancel()

  # --- RPCs ---

  async def SendPrompt(self, request, context):
    try:
      state = decode_inference_state(request.inference_state if request.HasField("inference_state") else None)
      shard = self._shard(request.shard, state)
    except ValueError as e:
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    await self._from_member(context)
    try:
      self.node.accepts_prompt(request.request_id)
    except ValueError as e:
      await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
    log.log(MESSAGES, "Received SendPrompt %s %r: %r", shard, request.request_id, request.prompt)
    await self._accept(lambda accepted: self.node.process_prompt(shard, request.prompt, request.request_id, state, accepted=accepted), f"prompt {request.request_id}")
    return pb.Tensor()

  async def SendTensor(self, request, context):
    try:
      state = decode_inference_state(request.inference_state if request.HasField("inference_state") else None)
      shard = self._shard(request.shard, state)
      if is_empty_tensor(request.tensor):
        raise ValueError("SendTensor without a tensor")
      tensor = decode_tensor(request.tensor)
    except ValueError as e:
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    await self._from_member(context)
    log.log(MESSAGES, "Received SendTensor %s %r: %s %s", shard, request.request_id, tensor.dtype, tensor.shape)
    await self._accept(lambda accepted: self.node.process_tensor(shard, tensor, request.request_id, state, accepted=accepted), f"tensor {request.request_id}")
    return pb.Tensor()

  async def SendExample(self, request, context):
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node does not train or evaluate")

  async def CollectTopology(self, request, context):
    # Like upstream: the cached view (self, direct peers, their edges); `visited` and `max_depth` do not matter.
    return encode_topology(self.node.current_topology)

  async def SendResult(self, request, context):
    host = await self._from_member(context)
    result = list(request.result)
    if request.HasField("tensor") and request.tensor.tensor_data:
      try:
        result = decode_tensor(request.tensor)
      except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    log.log(MESSAGES, "Received SendResult %r: %s finished=%s", request.request_id, result, request.is_finished)
    self.node.on_result(request.request_id, result, request.is_finished, host)
    return pb.Empty()

  async def SendOpaqueStatus(self, request, context):
    host = await self._from_member(context)
    log.log(STATUSES, "Received SendOpaqueStatus %r: %s", request.request_id, request.status)
    self.node.receive_status(request.request_id, request.status, host)
    return pb.Empty()

  async def HealthCheck(self, request, context):
    return pb.HealthCheckResponse(is_healthy=True)
