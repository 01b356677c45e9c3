"""The `exo` command as a user runs it, a real process each time: `exo run` answering from the embedded model and
streaming, a node binding its API where told, and every bad argument or setting refused with one clear line."""
import asyncio
import json
import os
import re
import subprocess
import sys
import urllib.request

import psutil
import pytest

from tests.support.cluster import REPO, ExoProcess, free_port
from tests.support.waiting import eventually

pytestmark = pytest.mark.cluster


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
  (["run", "smollm2-135m", "--quantize", "3"], "--quantize must be 8 or 4 (bits a weight is kept in), or 0 for off, got '3'"),
  (["--inference-engine", "dummy", "--disable-tui", "--quantize", "8"], "--quantize / EXO_QUANTIZE needs an engine that keeps weights quantized (numpy or mlx), not dummy"),
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


def test_a_bad_api_setting_stops_the_node_with_one_line():
  result = subprocess.run([sys.executable, "-m", "exo.main", "--inference-engine", "dummy", "--disable-tui"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "EXO_MAX_QUEUED_REQUESTS": "-1"})
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == ["exo: error: EXO_MAX_QUEUED_REQUESTS must be an integer >= 0, got '-1'"]


def test_a_bad_quantize_setting_in_the_environment_stops_exo_run_with_one_line():
  result = subprocess.run([sys.executable, "-m", "exo.main", "run", "smollm2-135m", "--prompt", "hi"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "EXO_QUANTIZE": "16"})
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == ["exo: error: EXO_QUANTIZE must be 8 or 4 (bits a weight is kept in), or 0 for off, got '16'"]


def test_exo_run_quantizes_a_float_checkpoint_as_it_loads(tmp_path):
  from tests.support.checkpoints import random_llama, write_hf_dir
  path = write_hf_dir(tmp_path / "llama", *random_llama(2))  # float32, SmolLM2's whole vocabulary and chat template
  run = subprocess.run([sys.executable, "-m", "exo.main", "run", str(path), "--inference-engine", "numpy", "--prompt", "Hi", "--max-generate-tokens", "4"],
                       cwd=REPO, capture_output=True, text=True, timeout=240, env={**os.environ, "EXO_HOME": str(tmp_path / "home"), "EXO_QUANTIZE": "4"})
  assert run.returncode == 0, run.stderr
  assert "exo: float checkpoints are quantized to 4 bits as they load" in run.stderr.splitlines()
  assert re.search(r"1 prompt\(s\), [1-4] tokens", run.stdout + run.stderr), run.stderr


async def test_a_node_prints_its_api_limits_and_binds_where_told(tmp_path):
  port = free_port()
  node = ExoProcess("bind-test", ["--inference-engine", "dummy", "--disable-tui", "--discovery-module", "manual", "--discovery-config-path",
                                  str(tmp_path / "none.json"), "--chatgpt-api-port", str(port), "--chatgpt-api-host", "127.0.0.1",
                                  "--max-concurrent-requests", "3"], tmp_path, env={"EXO_MAX_QUEUED_REQUESTS": "5"})
  (tmp_path / "none.json").write_text(json.dumps({"peers": {}}))
  node.start()
  try:
    await node.wait_for_log(r"^exo: API: up to 3 requests at once and 5 waiting, KV budget [\d,]+ MiB, bodies up to 8 MiB, .*"
                      rf"API key off; listening on 127\.0\.0\.1:{port}$", 60)
    def listening_on():  # the line is printed just before the socket opens
      return [c.laddr.ip for c in psutil.Process(node.proc.pid).net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port]
    listening = await eventually(listening_on, 30, "the API listening")
    assert listening == ["127.0.0.1"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
      assert json.load(r)["status"] == "ok"
  finally:
    node.stop()


def test_a_bad_batching_setting_stops_exo_run_with_exit_2():
  env = {"PATH": "", "EXO_BATCH_TIMEOUT_MS": "10"}
  done = subprocess.run([sys.executable, "-m", "exo.main", "run", "smollm2-135m", "--prompt", "hi"], env=env, capture_output=True, text=True, timeout=60)
  assert done.returncode == 2
  assert done.stderr.strip().splitlines()[-1].startswith("exo: error: EXO_BATCH_TIMEOUT_MS is set but EXO_BATCH_SIZE is not")


def test_exo_run_refuses_a_path_without_a_checkpoint(tmp_path):
  run = subprocess.run([sys.executable, "-m", "exo.main", "run", str(tmp_path), "--inference-engine", "numpy"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env={**os.environ, "EXO_HOME": str(tmp_path / "home")})
  assert run.returncode == 2 and "not a checkpoint (expected a .gguf file or a directory with config.json)" in run.stderr


def test_manual_module_without_a_path_fails_at_startup():
  result = subprocess.run([sys.executable, "-m", "exo.main", "--inference-engine", "dummy", "--discovery-module", "manual", "--disable-tui"],
                          capture_output=True, text=True, timeout=60)
  assert result.returncode != 0 and "--discovery-config-path" in result.stderr


def test_exo_run_answers_from_a_qwen_shaped_checkpoint_and_refuses_an_unimplemented_rope_in_one_line(tmp_path):
  from tests.support.checkpoints import fixture_checkpoint, random_qwen2, write_hf_dir
  from tests.test_qwen_chat import QWEN_TEMPLATE
  config, weights, tokenizer = random_qwen2(2)
  qwen = write_hf_dir(tmp_path / "qwen", config, weights, tokenizer, split=False, model_type="qwen2", chat_template=QWEN_TEMPLATE)
  longrope = fixture_checkpoint("llama", tmp_path / "longrope")
  longrope_config = json.loads((longrope / "config.json").read_text())
  (longrope / "config.json").write_text(json.dumps({**longrope_config, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}))
  env = {**os.environ, "EXO_HOME": str(tmp_path / "home")}
  for path in (qwen, longrope):
    run = subprocess.run([sys.executable, "-m", "exo.main", "run", str(path), "--inference-engine", "numpy", "--prompt", "Hi", "--max-generate-tokens", "4"],
                         cwd=REPO, capture_output=True, text=True, timeout=240, env=env)
    if path == qwen:
      assert run.returncode == 0 and re.search(r"1 prompt\(s\), [1-4] tokens", run.stdout + run.stderr), run.stderr
    else:
      assert run.returncode == 1 and run.stderr.strip().splitlines()[-1] == "exo: error: rope_scaling.rope_type: 'longrope' is not implemented by exo's engines", run.stderr
