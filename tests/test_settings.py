"""The one table of settings (exo/settings.py): the parser's flags and every environment variable exo reads come from
it, the README's Configuration table is its rendering, and a flag wins over its variable."""
import argparse
import re
from pathlib import Path

import pytest

from exo import settings
from exo.main import build_parser

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
SOURCES = [p for p in (REPO / "exo").rglob("*.py") if p.name != "settings.py" and "tinychat" not in p.parts]
# A read of the environment: os.getenv("X"), environ.get("X"), environ["X"], and the table's own accessors
READS = re.compile(r"""(?:getenv|environ\.get|environ\[|settings\.env|settings\.env_int)\(?\s*['"]([A-Za-z_][A-Za-z0-9_]*)['"]""")


def test_every_environment_variable_the_code_reads_is_in_the_table():
  read, named = set(), set()
  for path in SOURCES:
    text = path.read_text()
    read |= set(READS.findall(text))
    named |= set(re.findall(r"\b(EXO_[A-Z0-9_]+)\b", text))  # in messages and docstrings too: each names a setting a user may set
  assert read, "the pattern finds the reads"
  assert read - set(settings.BY_ENV) == set() and named - set(settings.BY_ENV) == set()


def test_nothing_but_the_table_reads_the_environment_directly():
  direct = [f"{p.relative_to(REPO)}: {line.strip()}" for p in SOURCES for line in p.read_text().splitlines()
            if re.search(r"os\.getenv\(|os\.environ\.get\(|os\.environ\[", line)]
  assert direct == []


def test_the_readme_lists_every_setting_as_the_table_says():
  readme = (REPO / "README.md").read_text()
  assert settings.markdown_table() in readme
  for s in settings.SETTINGS:
    assert (s.env is None or f"`{s.env}`" in readme) and (s.flag is None or f"`{s.flag}`" in readme)


def test_the_parsers_flags_are_the_tables():
  flags = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
  table = {s.flag for s in settings.SETTINGS if s.flag}
  assert flags == table | {"--help", "--no-disable-tui"}
  args = build_parser().parse_args([])
  assert all(getattr(args, s.name) == s.default for s in settings.SETTINGS if s.flag)


def test_a_flag_wins_over_its_variable_and_a_blank_variable_is_unset():
  args = build_parser().parse_args(["--batch-size", "4"])
  assert settings.given(args, {"EXO_BATCH_SIZE": "8"}, "batch_size") == (4, "--batch-size")
  args = build_parser().parse_args([])
  assert settings.given(args, {"EXO_BATCH_SIZE": "8"}, "batch_size") == ("8", "EXO_BATCH_SIZE")
  assert settings.given(args, {"EXO_BATCH_SIZE": "  "}, "batch_size") == (None, "EXO_BATCH_SIZE")
  assert settings.given(argparse.Namespace(), {"EXO_KEEP_ALIVE": "5m"}, "EXO_KEEP_ALIVE") == ("5m", "EXO_KEEP_ALIVE")  # a variable without a flag
  assert settings.env("EXO_HOME", "x", {}) == "x" and settings.env("EXO_HOME", None, {"EXO_HOME": "/h"}) == "/h"
  with pytest.raises(KeyError):
    settings.env("EXO_NOT_A_SETTING")  # only the table's variables are read
