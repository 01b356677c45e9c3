"""The API's limits and access settings: flags over environment, one-line errors, and a real `exo` process that
prints them at start and binds its API where --chatgpt-api-host says."""
import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from tests.support.cluster import ExoProcess, free_port
from exo.api.settings import DEFAULT_MAX_QUEUED, DEFAULT_MAX_RUNNING, api_settings_from
from exo.main import build_parser


def settings(argv=(), **env):
  return api_settings_from(build_parser().parse_args(list(argv)), env)


def test_defaults_flags_and_environment():
  s = settings()
  assert (s.max_running, s.max_queued, s.max_body_bytes, s.allowed_origins, s.api_key) == (DEFAULT_MAX_RUNNING, DEFAULT_MAX_QUEUED, 8 * 2**20, (), None)
  assert 0 < s.kv_budget_bytes < psutil.virtual_memory().total
  s = settings(EXO_MAX_CONCURRENT_REQUESTS="2", EXO_MAX_QUEUED_REQUESTS="0", EXO_KV_BUDGET_MB="512", EXO_MAX_REQUEST_BODY_MB="0.5",
               EXO_ALLOWED_ORIGINS="http://a.test:3000/, https://*.b.test", EXO_API_KEY=" k ")
  assert (s.max_running, s.max_queued, s.kv_budget_bytes, s.max_body_bytes) == (2, 0, 512 * 2**20, 2**19)
  assert s.allowed_origins == ("http://a.test:3000", "https://*.b.test") and s.api_key == "k"
  s = settings(["--max-concurrent-requests", "7", "--api-key", "flag"], EXO_MAX_CONCURRENT_REQUESTS="2", EXO_API_KEY="env")
  assert (s.max_running, s.api_key) == (7, "flag")


@pytest.mark.parametrize("env, message", [
  ({"EXO_MAX_CONCURRENT_REQUESTS": "0"}, "EXO_MAX_CONCURRENT_REQUESTS must be an integer >= 1, got '0'"),
  ({"EXO_MAX_QUEUED_REQUESTS": "2.5"}, "EXO_MAX_QUEUED_REQUESTS must be an integer >= 0, got '2.5'"),
  ({"EXO_KV_BUDGET_MB": "lots"}, "EXO_KV_BUDGET_MB must be a number >= 1, got 'lots'"),
  ({"EXO_MAX_REQUEST_BODY_MB": "inf"}, "EXO_MAX_REQUEST_BODY_MB must be a number"),
])
def test_bad_values_name_the_setting(env, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
    settings(**env)


def test_a_bad_value_stops_the_node_with_one_line():
  result = subprocess.run([sys.executable, "-m", "exo.main", "--inference-engine", "dummy", "--disable-tui"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "EXO_MAX_QUEUED_REQUESTS": "-1"})
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == ["exo: error: EXO_MAX_QUEUED_REQUESTS must be an integer >= 0, got '-1'"]


def test_a_node_prints_its_limits_and_binds_where_told(tmp_path):
  port = free_port()
  node = ExoProcess("bind-test", ["--inference-engine", "dummy", "--disable-tui", "--discovery-module", "manual", "--discovery-config-path",
                                  str(tmp_path / "none.json"), "--chatgpt-api-port", str(port), "--chatgpt-api-host", "127.0.0.1",
                                  "--max-concurrent-requests", "3"], tmp_path, env={"EXO_MAX_QUEUED_REQUESTS": "5"})
  (tmp_path / "none.json").write_text(json.dumps({"peers": {}}))
  node.start()
  try:
    node.wait_for_log(r"^exo: API: up to 3 requests at once and 5 waiting, KV budget [\d,]+ MiB, bodies up to 8 MiB, .*"
                      rf"API key off; listening on 127\.0\.0\.1:{port}$", 60)
    deadline = time.monotonic() + 30
    while not (listening := [c.laddr.ip for c in psutil.Process(node.proc.pid).net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port]):
      assert time.monotonic() < deadline, "the API never listened"  # the line is printed just before the socket opens
      time.sleep(0.05)
    assert listening == ["127.0.0.1"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
      assert json.load(r)["status"] == "ok"
  finally:
    node.stop()


def test_the_parser_knows_every_api_flag():
  args = build_parser().parse_args(["--chatgpt-api-host", "::1", "--allowed-origins", "*", "--kv-budget-mb", "100", "--max-request-body-mb", "1",
                                    "--max-queued-requests", "0"])
  assert isinstance(args, argparse.Namespace) and args.chatgpt_api_host == "::1" and args.allowed_origins == "*"
