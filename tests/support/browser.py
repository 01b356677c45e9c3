"""Finding a Chromium or Google Chrome to drive, wherever this machine has one: Debian's `chromium` package, or the
Google Chrome and Chromium that GitHub's Ubuntu runners ship (Ubuntu's own `chromium` package is a stub that only
asks for the snap, and does not run there)."""
import functools
import os
import shutil
import subprocess
from typing import Optional

# EXO_TEST_BROWSER names one explicitly; CHROME_BIN is what GitHub's runners (and Karma-style setups) set.
ENVIRONMENT = ("EXO_TEST_BROWSER", "CHROME_BIN")
NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def runs(path: str) -> bool:
  """Whether `path --version` works: a snap stub prints where to get the snap and fails."""
  try:
    return subprocess.run([path, "--version"], capture_output=True, timeout=30).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


@functools.lru_cache(maxsize=None)
def find_browser() -> Optional[str]:
  """The first Chromium or Chrome that runs: named by the environment, else found on PATH; None if there is none."""
  candidates = [os.environ.get(name) for name in ENVIRONMENT] + [shutil.which(name) for name in NAMES]
  return next((path for path in candidates if path and runs(path)), None)
