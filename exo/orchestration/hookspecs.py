"""The `exo` hook specifications: where a plugin may step into a Node's work.

A Node owns a `pluggy.PluginManager("exo")` (`node.plugins`). Its own behaviour is a plugin too (the core
implementations, registered `trylast`), so a node with no other plugin behaves exactly like upstream exo.
The `exo` command registers third-party plugins installed in the `exo` entry-point group (exo.main.
load_installed_plugins; a Node built in code gets none of them) and exo's batching plugin when EXO_BATCH_SIZE /
--batch-size turn it on.

How the batch stays a batch. A node's forward passes all go through its one step loop (Node.steps, driven by each
shard's Scheduler, which `exo_scheduler` supplies): a message's rows enter it in one call, a step runs them on the
engine together, and the step core finishes every row the step ran inside one output (exo/orchestration/
steps/core.py), calling `Node.process_inference_result` for each, in order, through `exo_process_inference_result`;
the output then goes out as one message per next hop (the rows packed) and one token message per origin. The seed's
hook around `process_inference_result` thus still sees every row, one at a time, while the rows never leave their
batch. Batch size 1 (no batching plugin) is the same path.

Hooks that do asynchronous work return an awaitable (pluggy calls are synchronous); the Node awaits it.
`firstresult` hooks stop at the first implementation that returns something other than None, so a plugin
takes a piece of work over by returning an awaitable, or leaves it to the next one by returning None.
Wrappers (`@hookimpl(wrapper=True)`) see and may replace the awaitable the inner implementations return."""
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
  shard: which ready rows the next step takes, and when. A packed message is a step of the stage before and is due at
  once; a single message (an upstream node's, one per request) is a batch of one, which a batching policy lets others
  join for up to EXO_BATCH_TIMEOUT_MS. The core's policy takes one row a step and a long prompt
  in chunks (a node without batching runs one request at a time, as upstream does); the batching plugin's takes up to
  EXO_BATCH_SIZE rows a step."""


@hookspec
def exo_step_done(node, scheduler, step) -> None:
  """A step has run and its output has been made, before it is sent (the batching plugin keeps its view of the ring
  current here)."""


@hookspec(firstresult=True)
def exo_process_inference_result(node, shard, result: np.ndarray, request_id: str, inference_state: Optional[dict]) -> Optional[Awaitable[None]]:
  """What follows one request's forward pass (Node.process_inference_result): its outcome, added to the output of
  the step it ran in. Past the last layers its token is the one its step drew together with the step's other rows
  (each row with its own parameters), recorded and checked for its end; then it goes to the next hop and its token to
  its origin. Return an awaitable doing it. The core adds the row with `node.step_core.add`: inside a step the row
  joins the step's output, which the step sends once; called outside any step (a caller of the public method), the
  row is sampled alone and is an output of one, sent at once. A plugin that wraps this hook sees every row of every
  step, in order, before the step's output is sent."""


@hookspec
def exo_request_ended(node, request_id: str) -> None:
  """A request has ended on this node (finished, failed, cancelled or ended elsewhere): drop its work still waiting
  (ending it with exo.orchestration.requests.RequestEnded), forget it, and stop waiting for it."""


@hookspec
def exo_run_summary(node) -> Optional[str]:
  """A fragment for the summary line `exo run` prints after several prompts (e.g. "mean batch size 5.3")."""
