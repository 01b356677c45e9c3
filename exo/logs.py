"""exo's diagnostics go through `logging`: each module logs to its own logger (logging.getLogger(__name__)), under
the `exo` logger that the exo command sets up once (configure). The DEBUG variable sets how much is shown, as it did
when these were prints behind `if DEBUG >= n`:

  DEBUG=0 (default)  INFO and above: what an operator needs to hear (a peer's bad status, a download's source)
  DEBUG=1            VERBOSE as well: what the node does, once per event (peers joining, placements, failures it survives)
  DEBUG=2            logging.DEBUG as well: every detail (each request's parameters, each sampled token)
  DEBUG=n > 2        finer still (level_of(n)): DEBUG=5 each gRPC message, DEBUG=8 each status

Discovery's own messages go to the `exo.discovery` logger, whose verbosity DEBUG_DISCOVERY sets the same way.
Without configure (a test, a program that embeds a node) Python's defaults apply: warnings and errors on stderr."""
import logging
import sys
from typing import Optional, TextIO

from exo import settings

VERBOSE = 15
logging.addLevelName(VERBOSE, "VERBOSE")
DISCOVERY = "exo.discovery"


def level_of(debug: int) -> int:
  """The logging level of what `DEBUG >= debug` showed, and the threshold DEBUG=debug sets."""
  if debug <= 0:
    return logging.INFO
  if debug == 1:
    return VERBOSE
  return max(logging.DEBUG - (debug - 2), 1)


def discovery_log() -> logging.Logger:
  return logging.getLogger(DISCOVERY)


def configure(stream: Optional[TextIO] = None) -> None:
  """Once, by the exo command: exo's messages as plain lines on stdout (where its prints went), at the levels DEBUG
  and DEBUG_DISCOVERY set."""
  root = logging.getLogger("exo")
  if any(getattr(h, "exo_handler", False) for h in root.handlers):
    return
  handler = logging.StreamHandler(stream or sys.stdout)
  handler.setFormatter(logging.Formatter("%(message)s"))
  handler.exo_handler = True
  root.addHandler(handler)
  root.propagate = False
  root.setLevel(level_of(settings.env_int("DEBUG")))
  logging.getLogger(DISCOVERY).setLevel(level_of(settings.env_int("DEBUG_DISCOVERY")))
