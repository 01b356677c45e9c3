"""`exo run` as a user runs it: a real process, the embedded model, streamed output, clear errors."""
import asyncio
import subprocess
import sys

import pytest


def exo(*args, timeout=240):
  return subprocess.run([sys.executable, "-m", "exo.main", *args], capture_output=True, text=True, timeout=timeout)


def test_run_answers_from_the_embedded_model():
  result = exo("run", "smollm2-135m", "--prompt", "What is the capital of France?")
  assert result.returncode == 0, result.stderr
  assert "Paris" in result.stdout


def test_run_streams_tokens_as_they_are_produced():
  proc = subprocess.Popen([sys.executable, "-m", "exo.main", "run", "smollm2-135m", "--prompt", "Write a short poem about the sea."],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  try:
    first = proc.stdout.read1(4096)  # returns as soon as some output exists
    assert first and proc.poll() is None, "output arrived before the answer was complete"
  finally:
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("args, message", [
  (["run", "smollm2-135m", "--inference-engine", "nope"], "unknown inference engine 'nope'"),
  (["run", "no-such-model"], "unknown model 'no-such-model'"),
  (["run"], "needs a model"),
  (["run", "dummy", "--inference-engine", "numpy"], "cannot run on the numpy engine"),
])
def test_bad_arguments_give_one_line_and_exit_2(args, message):
  result = exo(*args, timeout=60)
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and message in lines[0]


def test_run_several_prompts_concurrently():
  result = exo("run", "smollm2-135m", "--prompt", "What is the capital of France?", "--prompt", "What is 2 + 2?")
  assert result.returncode == 0, result.stderr
  assert ">>> What is the capital of France?" in result.stdout and ">>> What is 2 + 2?" in result.stdout
  assert "Paris" in result.stdout and "2 prompt(s)" in result.stdout


def test_a_node_runs_on_uvloop_where_it_is_installed():
  pytest.importorskip("uvloop")
  from exo.main import run_event_loop

  async def loop_module():
    return type(asyncio.get_running_loop()).__module__

  assert run_event_loop(loop_module()).startswith("uvloop")
