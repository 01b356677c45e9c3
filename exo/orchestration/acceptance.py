"""A message's acceptance: the node's word to the gRPC server that the forward pass a SendTensor / SendPrompt asked
for has been taken up, so the server can reply now.

The server makes one future per message and hands it to the node with the work (`Node.process_tensor(...,
accepted=)`); whatever starts the pass resolves it with `accept`: the node's step loop just before the step that runs
the message's rows (or the node, when the message's work goes on elsewhere). A batch's messages then get their
replies while its step runs, not one by one before it (replying costs the server about as much as receiving)."""
import asyncio
from typing import Optional


def accept(accepted: Optional[asyncio.Future]) -> None:
  """Resolve a message's acceptance, if it has one that nobody resolved yet."""
  if accepted is not None and not accepted.done():
    accepted.set_result(None)
