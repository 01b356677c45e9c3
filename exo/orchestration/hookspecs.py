"""The `exo` hook specifications: where a plugin may step into a Node's work (`node.plugins`, a pluggy manager).

The node's own behaviour is a plugin too (CorePlugin, registered `trylast`), so a node with no other plugin behaves like
upstream exo. The `exo` command registers the plugins of the `exo` entry-point group and, when EXO_BATCH_SIZE is 2 or
more, exo's batching plugin.

How the batch stays a batch: every forward pass goes through the node's one step loop, whose policy per shard
`exo_scheduler` supplies. After a step, the step core (steps/core.py) calls `Node.process_inference_result` (through
`exo_process_inference_result`) for each row, in order, inside the step's one output, which then goes out as one
message per next hop and one token message per origin: a wrapper still sees every row while the rows stay together.

Asynchronous hooks return an awaitable, which the node awaits; wrappers may replace it."""
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
  """The node is stopping: return an awaitable that ends the plugin's work and settles every request it holds."""


@hookspec(firstresult=True)
def exo_scheduler(node, shard) -> Optional["Scheduler"]:
  """The policy of this node's steps on one of its shards (steps/scheduler.py), asked once per shard. The core's takes
  one row a step, as upstream; the batching plugin's up to EXO_BATCH_SIZE, single messages waiting up to
  EXO_BATCH_TIMEOUT_MS for others while a packed message (a whole step of the stage before) is due at once."""


@hookspec
def exo_step_done(node, scheduler, step) -> None:
  """A step has run and its output has been sent: called once the next step has the engine (or before the loop
  waits), so that it is not on the way from one step to the next."""


@hookspec(firstresult=True)
def exo_process_inference_result(node, shard, result: np.ndarray, request_id: str, inference_state: Optional[dict]) -> Optional[Awaitable[None]]:
  """What follows one request's forward pass (Node.process_inference_result); return an awaitable doing it. The
  core's calls `node.step_core.add`: inside a step the row joins the step's output (past the last layers with the
  token drawn together with the other rows); outside any step the row is sampled alone and sent at once. While the
  core's is the only implementation, a one-node decoding row's next step may already run when it is called
  (steps/ahead.py): what follows a token is then the core's, which run-ahead mirrors; another implementation turns it off."""


@hookspec
def exo_request_ended(node, request_id: str) -> None:
  """A request has ended on this node: drop its work still waiting (ending it with requests.RequestEnded)."""


@hookspec
def exo_run_summary(node) -> Optional[str]:
  """A fragment for the summary line `exo run` prints after several prompts ("mean batch size 5.3")."""
