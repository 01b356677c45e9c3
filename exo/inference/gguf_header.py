"""What a GGUF file is, from its first bytes: whether a file is GGUF at all (Ollama's blobs have no .gguf suffix),
and a few metadata values read without parsing the whole file.

gguf's reader parses every metadata value, the tokenizer's hundreds of thousands of strings included (about a second
a file); listing a store of models needs only each one's architecture and layer count, which writers put before the
tokenizer, so reading stops as soon as the values asked for are found."""
import struct
from pathlib import Path
from typing import BinaryIO, Dict, Iterable, Union

MAGIC = b"GGUF"
ARCHITECTURES = ("llama",)  # the GGUF architectures exo/inference/weights.py reads
# value type -> struct format of a scalar (GGUF's numbering); 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def is_gguf(path: Union[str, Path]) -> bool:
  """A regular file that starts with GGUF's magic (whatever its name)."""
  try:
    with open(path, "rb") as f:
      return f.read(4) == MAGIC
  except OSError:  # a directory, a missing file, no permission
    return False


def _read(f: BinaryIO, fmt: str):
  size = struct.calcsize("<" + fmt)
  data = f.read(size)
  if len(data) != size:
    raise ValueError("the file ends inside its metadata")
  return struct.unpack("<" + fmt, data)[0]


def _string(f: BinaryIO) -> str:
  length = _read(f, "Q")
  data = f.read(length)
  if len(data) != length:
    raise ValueError("the file ends inside its metadata")
  return data.decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int, keep: bool):
  """The next value (None for an array or a value not kept: skipped)."""
  if kind == _STRING:
    if keep:
      return _string(f)
    f.seek(_read(f, "Q"), 1)
    return None
  if kind in _SCALARS:
    return _read(f, _SCALARS[kind])
  if kind == _ARRAY:
    item_kind, count = _read(f, "I"), _read(f, "Q")
    if item_kind in _SCALARS:
      f.seek(struct.calcsize("<" + _SCALARS[item_kind]) * count, 1)
    else:
      for _ in range(count):
        _value(f, item_kind, False)
    return None
  raise ValueError(f"unknown metadata value type {kind}")


def read_fields(path: Union[str, Path], keys: Iterable[str]) -> Dict[str, object]:
  """The scalar or string metadata values of `keys` that the file has; ValueError for a file that is not GGUF or
  ends early."""
  wanted, found = set(keys), {}
  with open(path, "rb") as f:
    if f.read(4) != MAGIC:
      raise ValueError(f"{path}: not a GGUF file")
    version = _read(f, "I")
    if version < 2:
      raise ValueError(f"{path}: GGUF version {version} is too old (2 or later)")
    _read(f, "Q")  # tensor count
    for _ in range(_read(f, "Q")):
      key, kind = _string(f), _read(f, "I")
      value = _value(f, kind, key in wanted)
      if key in wanted:
        found[key] = value
        if len(found) == len(wanted):
          break
  return found


def architecture_and_layers(path: Union[str, Path]) -> tuple:
  """(general.architecture, its block count) as the file states them (None where absent)."""
  arch = read_fields(path, ["general.architecture"]).get("general.architecture")
  layers = read_fields(path, [f"{arch}.block_count"]).get(f"{arch}.block_count") if arch else None
  return arch, layers
