"""One SendTensor for the rows of one engine step that go on to the same next hop: their tensors joined along the
positions, and under `"rows"` each row's request id, positions and own state (the first row's route at the top, so the
receiver checks it as a routed message). The receiver's rows enter its step loop as one batch."""
from typing import Annotated, List, Optional, Tuple

import numpy as np
from pydantic import Field, StrictInt, StrictStr, TypeAdapter, ValidationError

ROWS = "rows"
MAX_ROWS = 4096

Row = Tuple[str, np.ndarray, Optional[dict]]  # request id, its tensor (1, L, ...), its inference state
# A packed state's rows: [request id, positions, inference state], as many as the message holds.
_ROWS = TypeAdapter(Annotated[List[Tuple[Annotated[StrictStr, Field(min_length=1)], Annotated[StrictInt, Field(ge=1)], dict]],
                              Field(min_length=1, max_length=MAX_ROWS)])


def input_length(tensor: np.ndarray) -> int:
  """Positions a request's input holds: (1, L) token ids or (1, L, d) hidden states (anything else is one)."""
  shape = np.shape(tensor)
  return shape[1] if len(shape) >= 2 and shape[0] == 1 else 1


def pack(rows: List[Row]) -> Tuple[np.ndarray, dict]:
  """The rows as one tensor and one state (rows of one kind: same dtype and shape past the positions)."""
  tensor = np.concatenate([np.asarray(t).reshape(1, input_length(t), *np.shape(t)[2:]) for _, t, _ in rows], axis=1)
  return tensor, {"route": (rows[0][2] or {}).get("route"), ROWS: [[request_id, input_length(t), state or {}] for request_id, t, state in rows]}


def unpack(tensor: np.ndarray, state: dict) -> List[Row]:
  """The rows a packed message stands for; ValueError if the state does not describe the tensor."""
  try:
    rows = _ROWS.validate_python(state.get(ROWS))
  except ValidationError as e:
    raise ValueError(f"rows must list 1 to {MAX_ROWS} rows, each [request id, positions, state]: {e.errors(include_url=False)[0]['msg']}") from None
  starts = np.cumsum([0] + [length for _, length, _ in rows])
  if np.ndim(tensor) < 2 or starts[-1] != np.shape(tensor)[1]:
    raise ValueError(f"the rows hold {starts[-1]} positions, the tensor {np.shape(tensor)}")
  return [(request_id, tensor[:, start:start + length], row_state) for (request_id, length, row_state), start in zip(rows, starts)]
