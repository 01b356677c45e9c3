"""exo's logging (exo/logs.py): DEBUG's levels as logging levels, and what the exo command's configuration shows: a
message as the plain line a print gave, on stdout, at the level DEBUG (and DEBUG_DISCOVERY for discovery) sets."""
import io
import logging
import subprocess
import sys

import pytest

from exo import logs

pytestmark = pytest.mark.unit


def test_each_debug_level_shows_what_it_showed_before_and_no_more():
  assert logs.level_of(0) == logging.INFO and logs.level_of(1) == logs.VERBOSE and logs.level_of(2) == logging.DEBUG
  assert logging.INFO > logs.VERBOSE > logging.DEBUG > logs.level_of(5) > logs.level_of(8) >= 1
  for debug in range(10):
    for n in range(1, 10):
      shown = logs.level_of(n) >= logs.level_of(debug)  # what `if DEBUG >= n: print(...)` did
      assert shown == (debug >= n)


@pytest.fixture
def configured(monkeypatch):
  """configure() as the exo command runs it, with the environment given, into a stream; exo's loggers as they were after."""
  root, discovery = logging.getLogger("exo"), logging.getLogger(logs.DISCOVERY)
  saved = (list(root.handlers), root.propagate, root.level, discovery.level)

  def run(**env) -> list:
    for name in ("DEBUG", "DEBUG_DISCOVERY"):
      monkeypatch.setenv(name, env.get(name, ""))
    root.handlers[:] = []
    stream = io.StringIO()
    logs.configure(stream)
    logs.configure(stream)  # once: a second call adds nothing
    logging.getLogger("exo.orchestration.inbox").warning("exo: a warning")
    logging.getLogger("exo.download.shard_download").info("exo: %s from %s", "w.safetensors", "peer a")
    logging.getLogger("exo.orchestration.ring_member").log(logs.VERBOSE, "peers changed")
    logging.getLogger("exo.api.serving").debug("every detail")
    logging.getLogger(logs.DISCOVERY).debug("Peer statuses: {}")
    return stream.getvalue().splitlines()
  yield run
  root.handlers[:], root.propagate = saved[0], saved[1]
  root.setLevel(saved[2])
  discovery.setLevel(saved[3])


def test_the_exo_command_shows_plain_lines_at_the_level_debug_sets(configured):
  assert configured() == ["exo: a warning", "exo: w.safetensors from peer a"]
  assert configured(DEBUG="1") == ["exo: a warning", "exo: w.safetensors from peer a", "peers changed"]
  assert configured(DEBUG="2") == ["exo: a warning", "exo: w.safetensors from peer a", "peers changed", "every detail"]
  assert configured(DEBUG_DISCOVERY="2") == ["exo: a warning", "exo: w.safetensors from peer a", "Peer statuses: {}"]


def test_by_default_the_exo_command_logs_to_stdout_where_its_prints_went():
  done = subprocess.run([sys.executable, "-c", "import logging; from exo import logs; logs.configure(); logging.getLogger('exo.x').info('exo: hello')"],
                        capture_output=True, text=True, timeout=60)
  assert (done.returncode, done.stdout, done.stderr) == (0, "exo: hello\n", "")
