"""The `exo` hook specifications: where a plugin may step into a Node's work.

A Node owns a `pluggy.PluginManager("exo")` (`node.plugins`). Its own behaviour is a plugin too (CorePlugin, registered
`trylast`), so a node with no other plugin behaves exactly like upstream exo. The `exo` command registers the plugins
installed in the `exo` entry-point group (exo.main.load_installed_plugins) and exo's batching plugin when
EXO_BATCH_SIZE / --batch-size turn it on.

How the batch stays a batch. Every forward pass goes through the node's one step loop, whose policy per shard
`exo_scheduler` supplies. A message's rows enter it in one call and a step runs them on the engine together; the step
core (exo/orchestration/steps/core.py) then calls `Node.process_inference_result`, through
`exo_process_inference_result`, for each row the step ran, in order, inside the step's one output, which then goes out
as one message per next hop and one token message per origin. A wrapper of that hook thus still sees every row, one at
a time, while the rows never leave their batch. Batch size 1 (no batching plugin) is the same path.

Hooks that do asynchronous work return an awaitable (pluggy calls are synchronous); the Node awaits it. `firstresult`
hooks stop at the first implementation that returns something other than None; wrappers (`@hookimpl(wrapper=True)`)
see and may replace the awaitable the inner implementations return."""
from typing import TYPE_CHECKING, Awaitable, Optional

import numpy as np
import pluggy

if TYPE_CHECKING:
  from exo.orchestration.steps.scheduler import Scheduler

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
def exo_scheduler(node, shard) -> Optional["Scheduler"]:
  """The policy of this node's steps on one of its shards (exo/orchestration/steps/scheduler.py), asked once per
  shard. The core's takes one row a step and a long prompt in chunks (one request at a time, as upstream); the batching
  plugin's takes up to EXO_BATCH_SIZE rows a step, letting single messages (upstream nodes send one per request) wait
  up to EXO_BATCH_TIMEOUT_MS for others, while a packed message, a whole step of the stage before, is due at once."""


@hookspec
def exo_step_done(node, scheduler, step) -> None:
  """A step has run and its output has been sent: called once the next step has the engine (or before the step loop
  waits for work), so that it is not on the way from one step to the next (the batching plugin keeps its view of the
  ring current here)."""


@hookspec(firstresult=True)
def exo_process_inference_result(node, shard, result: np.ndarray, request_id: str, inference_state: Optional[dict]) -> Optional[Awaitable[None]]:
  """What follows one request's forward pass (Node.process_inference_result): its outcome, added to the output of
  the step it ran in (past the last layers: its token, drawn together with the step's other rows, recorded and checked
  for its end). Return an awaitable doing it. The core's calls `node.step_core.add`: inside a step the row joins the
  step's output; called outside any step (a caller of the public method), the row is sampled alone and sent at once."""


@hookspec
def exo_request_ended(node, request_id: str) -> None:
  """A request has ended on this node (finished, failed, cancelled or ended elsewhere): drop its work still waiting
  (ending it with exo.orchestration.requests.RequestEnded), forget it, and stop waiting for it."""


@hookspec
def exo_run_summary(node) -> Optional[str]:
  """A fragment for the summary line `exo run` prints after several prompts (e.g. "mean batch size 5.3")."""
