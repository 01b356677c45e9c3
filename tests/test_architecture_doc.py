"""docs/architecture.md names files, folders and methods; each of them exists, so the page cannot drift from the code
unnoticed (it once described a Node._run and a responses.py that were long gone)."""
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
FILES = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if ".git" not in p.parts and "__pycache__" not in p.parts]
CODE = {p: p.read_text(errors="replace") for p in (ROOT / "exo").rglob("*.py")}


def spans() -> list:
  return re.findall(r"`([^`\n]+)`", DOC.read_text())


def expand(name: str) -> list:
  """`a/{x,y}/` → a/x/, a/y/."""
  match = re.search(r"\{([^}]+)\}", name)
  if match is None:
    return [name]
  return [n for part in match.group(1).split(",") for n in expand(name[:match.start()] + part + name[match.end():])]


def paths_named() -> list:
  return sorted({n for span in spans() if re.fullmatch(r"[\w./{},-]+\.(py|md|proto)|[\w./{},-]+/", span) for n in expand(span)})


def exists(name: str) -> bool:
  """A path from the root, or the tail of one (`routing/packing.py`, `scheduler.py`, `grpc/`)."""
  name = name.rstrip("/")
  return any(f == name or f.endswith("/" + name) for f in FILES)


def test_the_page_names_paths_at_all():
  assert len(paths_named()) > 40


@pytest.mark.parametrize("name", paths_named())
def test_every_path_the_architecture_page_names_exists(name):
  assert exists(name), f"docs/architecture.md names {name}, which is not in the repository"


def methods_named() -> list:
  return sorted({span.split("(")[0] for span in spans() if re.fullmatch(r"[A-Z]\w+\.\w+(\(.*\))?", span)})


@pytest.mark.parametrize("name", methods_named())
def test_every_class_method_the_architecture_page_names_exists(name):
  cls, method = name.split(".")
  holders = [src for src in CODE.values() if re.search(rf"^class {cls}\b", src, re.M)]
  assert holders, f"docs/architecture.md names class {cls}, defined nowhere in exo/"
  assert any(re.search(rf"^\s+(async )?def {method}\(|^\s+{method}\b.*=", src, re.M) for src in holders), f"{cls} has no {method}"
