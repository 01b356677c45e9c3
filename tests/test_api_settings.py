"""The API's limits and access settings: flags over environment, one-line errors. (A real `exo` process refusing a bad
one, and printing them at start and binding where --chatgpt-api-host says: test_cli.py.)"""
import argparse

import psutil
import pytest

from exo.api.settings import DEFAULT_MAX_QUEUED, DEFAULT_MAX_RUNNING, api_settings_from
from exo.main import build_parser

pytestmark = pytest.mark.unit


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


def test_the_parser_knows_every_api_flag():
  args = build_parser().parse_args(["--chatgpt-api-host", "::1", "--allowed-origins", "*", "--kv-budget-mb", "100", "--max-request-body-mb", "1",
                                    "--max-queued-requests", "0"])
  assert isinstance(args, argparse.Namespace) and args.chatgpt_api_host == "::1" and args.allowed_origins == "*"
