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
from typing import TYPE_CHECKING, Awaitable, Optional

import numpy as np
import pluggy

if TYPE_CHECKING:
  from exo.orchestration.batching.scheduler import Scheduler

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
  """The policy of this node's steps on one of its shards (exo/orchestration/batching/scheduler.py), asked once per
  shard. Every forward pass on the node goes through its one step loop (Node.steps): a message's rows enter it
  together, as one batch (a packed message is a step of the stage before, an upstream node's single message a batch
  of one), the step runs them on the engine together, and the step core finishes them together (sampling on the last
  layers, then one output: one message per next hop, one per origin). The core's policy is one row a step, a long
  prompt in chunks (a node without batching runs like upstream, one request at a time); the batching plugin's takes
  up to EXO_BATCH_SIZE rows a step. Batch size 1 is the same path."""


@hookspec
def exo_step_done(node, scheduler, step) -> None:
  """A step has run and its output has been made (before it is sent): keep the scheduler's view of the ring current."""


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
