"""One SendTensor for the rows of one engine step that go on to the same next hop.

Between nodes that follow routes, the hidden states (or, back to a route's first hop, the tokens) of every request a
step ran are sent together: their tensors joined along the positions, the state listing each request's id, its
positions and its own inference state (route, parameters, prefix) under `"rows"`, and the first request's route at the
top (a receiver checks the message as a routed one). The receiver runs each row as the message it stands for. A step's
rows thus cost one message per hop instead of one each, the cost a pipeline pays per token besides its steps."""
from typing import List, Tuple

import numpy as np

ROWS = "rows"
MAX_ROWS = 4096

Row = Tuple[str, np.ndarray, dict]  # request id, its tensor (1, L, ...), its inference state


def positions(tensor: np.ndarray) -> int:
  shape = np.shape(tensor)
  return shape[1] if len(shape) >= 2 else 1


def pack(rows: List[Row]) -> Tuple[np.ndarray, dict]:
  """The rows as one tensor and one state (rows of one kind: same dtype and shape past the positions)."""
  tensor = np.concatenate([np.asarray(t).reshape(1, positions(t), *np.shape(t)[2:]) for _, t, _ in rows], axis=1)
  return tensor, {"route": rows[0][2].get("route"), ROWS: [[request_id, positions(t), state] for request_id, t, state in rows]}


def unpack(tensor: np.ndarray, state: dict) -> List[Row]:
  """The rows a packed message stands for; ValueError if the state does not describe the tensor."""
  rows, start, out = state.get(ROWS), 0, []
  if not isinstance(rows, list) or not 1 <= len(rows) <= MAX_ROWS:
    raise ValueError(f"rows must list 1 to {MAX_ROWS} requests")
  for row in rows:
    if (not isinstance(row, list) or len(row) != 3 or not isinstance(row[0], str) or not row[0] or not isinstance(row[1], int)
        or isinstance(row[1], bool) or row[1] < 1 or not isinstance(row[2], dict)):
      raise ValueError("each row must be [request id, positions, state]")
    out.append((row[0], tensor[:, start:start + row[1]], row[2]))
    start += row[1]
  if np.ndim(tensor) < 2 or start != np.shape(tensor)[1]:
    raise ValueError(f"the rows hold {start} positions, the tensor {np.shape(tensor)}")
  return out
