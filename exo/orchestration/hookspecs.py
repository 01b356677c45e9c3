"""The `exo` hook specifications: where a plugin may step into a Node's work.

A Node owns a `pluggy.PluginManager("exo")` (`node.plugins`). Its own behaviour is a plugin too (the core
implementations, registered `trylast`), so a node with no other plugin behaves exactly like upstream exo.
The `exo` command registers third-party plugins installed in the `exo` entry-point group (exo.main.
load_installed_plugins; a Node built in code gets none of them) and exo's batching plugin when EXO_BATCH_SIZE /
--batch-size turn it on.

Hooks that do asynchronous work return an awaitable (pluggy calls are synchronous); the Node awaits it.
`firstresult` hooks stop at the first implementation that returns something other than None, so a plugin
takes a piece of work over by returning an awaitable, or leaves it to the next one by returning None.
Wrappers (`@hookimpl(wrapper=True)`) see and may replace the awaitable the inner implementations return."""
import asyncio
from typing import Awaitable, Optional, Tuple

import numpy as np
import pluggy

hookspec = pluggy.HookspecMarker("exo")
hookimpl = pluggy.HookimplMarker("exo")


@hookspec
def exo_node_started(node) -> None:
  """The node has started (server, discovery, first topology): start background work here."""


@hookspec
def exo_node_stopping(node) -> Optional[Awaitable[None]]:
  """The node is stopping: return an awaitable that ends the plugin's background work and settles every
  request it holds (with its result or an error). The node awaits all of them."""


@hookspec(firstresult=True)
def exo_infer_tensor(node, shard, tensor: np.ndarray, request_id: str, inference_state: Optional[dict],
                     accepted: Optional[asyncio.Future]) -> Optional[Awaitable[Optional[Tuple[np.ndarray, Optional[dict]]]]]:
  """Run this node's layers for one request: token ids (1, L) on the first shard, hidden states otherwise.
  Return an awaitable of (output, inference_state): the node then goes on with `Node.process_inference_result`,
  a batch of one (the core: `engine.infer_tensor` alone, a long prompt in chunks). A plugin that runs steps of several
  requests may instead finish the step's rows itself, all together, and return an awaitable of None: it hands the
  step's rows to `node.step_core.finish_step` (which calls `Node.process_inference_result` for each row inside the
  step's one output) and sends that output with `node.forwarding.send` (one message per next hop, one per origin).
  The batching plugin does so: a step's rows stay one batch from its scheduler to the next node. Before each step,
  drop requests that are no longer live (`node.requests.is_live`). Whoever starts the pass calls
  `acceptance.accept(accepted)` (None when no message waits for a reply): the gRPC server replies to the message
  then (else when the work ends, or after 0.1 s)."""


@hookspec(firstresult=True)
def exo_process_inference_result(node, shard, result: np.ndarray, request_id: str, inference_state: Optional[dict]) -> Optional[Awaitable[None]]:
  """What follows one request's forward pass (Node.process_inference_result): its outcome, added to the output of
  the step it ran in. Past the last layers its token is sampled (the one its step drew together with the step's other
  rows, where a batching step did; else alone, with its own parameters), recorded and checked for its end; then it
  goes to the next hop and its token to its origin. Return an awaitable doing it. The core adds the row with
  `node.step_core.add`: inside a step's `finish_step` the row joins the step's output, which the step sends once; called
  on its own (a node without batching) the row is an output of one, sent at once, so both take the same path. A
  plugin that wraps this hook sees every row of every step, in order, before the step's output is sent."""


@hookspec
def exo_request_ended(node, request_id: str) -> None:
  """A request has ended on this node (finished, failed, cancelled or ended elsewhere): drop its work still waiting
  (ending it with exo.orchestration.requests.RequestEnded), forget it, and stop waiting for it."""


@hookspec
def exo_run_summary(node) -> Optional[str]:
  """A fragment for the summary line `exo run` prints after several prompts (e.g. "mean batch size 5.3")."""
