"""Text fed to a streaming reader as it would stream: cut into pieces of a given size."""
from typing import List, Tuple


def in_pieces(text: str, piece: int) -> List[Tuple[str, bool]]:
  """`text` cut every `piece` characters, each piece with whether it is the last (one empty piece for no text)."""
  pieces = [text[i:i + piece] for i in range(0, len(text), piece)] or [""]
  return [(p, k == len(pieces) - 1) for k, p in enumerate(pieces)]


def split_in_pieces(reader, text: str, piece: int) -> Tuple[str, str]:
  """A reasoning reader (feed(text, final) -> (thinking, answer)) given `text` in pieces: (all thinking, all answer)."""
  thinking, answer = "", ""
  for p, last in in_pieces(text, piece):
    t, a = reader.feed(p, last)
    thinking, answer = thinking + t, answer + a
  return thinking, answer
