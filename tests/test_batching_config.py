"""EXO_BATCH_SIZE / EXO_BATCH_TIMEOUT_MS / EXO_PREFILL_CHUNK and their flags: on, off, defaults, refusals."""
from argparse import Namespace

import pytest

from exo.orchestration.batching.config import DEFAULT_PREFILL_CHUNK, DEFAULT_TIMEOUT_MS, BatchingConfig, batching_config_from

pytestmark = pytest.mark.unit


def args(batch_size=None, batch_timeout_ms=None, prefill_chunk=None):
  return Namespace(batch_size=batch_size, batch_timeout_ms=batch_timeout_ms, prefill_chunk=prefill_chunk)


@pytest.mark.parametrize("env, flags, expected", [
  ({}, {}, None),
  ({"EXO_BATCH_SIZE": "1"}, {}, None),
  ({"EXO_BATCH_SIZE": "1", "EXO_BATCH_TIMEOUT_MS": "20"}, {}, None),
  ({"EXO_BATCH_SIZE": ""}, {}, None),
  ({"EXO_BATCH_SIZE": "8"}, {}, BatchingConfig(8, DEFAULT_TIMEOUT_MS, DEFAULT_PREFILL_CHUNK)),
  ({"EXO_BATCH_SIZE": " 16 ", "EXO_BATCH_TIMEOUT_MS": "2.5"}, {}, BatchingConfig(16, 2.5, DEFAULT_PREFILL_CHUNK)),
  ({"EXO_BATCH_SIZE": "4", "EXO_BATCH_TIMEOUT_MS": "0", "EXO_PREFILL_CHUNK": "0"}, {}, BatchingConfig(4, 0.0, 0)),
  ({"EXO_BATCH_SIZE": "4", "EXO_PREFILL_CHUNK": "32"}, {}, BatchingConfig(4, DEFAULT_TIMEOUT_MS, 32)),
  # flags win over the environment, in both directions
  ({"EXO_BATCH_SIZE": "8", "EXO_BATCH_TIMEOUT_MS": "9"}, {"batch_size": 2, "batch_timeout_ms": 1.0}, BatchingConfig(2, 1.0, DEFAULT_PREFILL_CHUNK)),
  ({"EXO_BATCH_SIZE": "8"}, {"batch_size": 1}, None),
  ({}, {"batch_size": 32, "prefill_chunk": 64}, BatchingConfig(32, DEFAULT_TIMEOUT_MS, 64)),
  ({"EXO_BATCH_SIZE": "not a number"}, {"batch_size": 4}, BatchingConfig(4, DEFAULT_TIMEOUT_MS, DEFAULT_PREFILL_CHUNK)),
])
def test_accepted(env, flags, expected):
  assert batching_config_from(args(**flags), env) == expected


@pytest.mark.parametrize("env, flags, names", [
  ({"EXO_BATCH_TIMEOUT_MS": "10"}, {}, ["EXO_BATCH_TIMEOUT_MS", "EXO_BATCH_SIZE", "2 to 4096"]),
  ({}, {"batch_timeout_ms": 10.0}, ["--batch-timeout-ms", "EXO_BATCH_SIZE"]),
  ({"EXO_PREFILL_CHUNK": "64"}, {}, ["EXO_PREFILL_CHUNK", "EXO_BATCH_SIZE"]),
  ({"EXO_BATCH_SIZE": "0"}, {}, ["EXO_BATCH_SIZE", "1 to 4096", "'0'"]),
  ({"EXO_BATCH_SIZE": "-3"}, {}, ["EXO_BATCH_SIZE", "1 to 4096"]),
  ({"EXO_BATCH_SIZE": "2.5"}, {}, ["EXO_BATCH_SIZE", "integer"]),
  ({"EXO_BATCH_SIZE": "eight"}, {}, ["EXO_BATCH_SIZE", "'eight'"]),
  ({"EXO_BATCH_SIZE": "100000"}, {}, ["EXO_BATCH_SIZE", "1 to 4096"]),
  ({"EXO_BATCH_SIZE": "nan"}, {}, ["EXO_BATCH_SIZE"]),
  ({}, {"batch_size": 0}, ["--batch-size", "1 to 4096"]),
  ({"EXO_BATCH_SIZE": "8", "EXO_BATCH_TIMEOUT_MS": "-1"}, {}, ["EXO_BATCH_TIMEOUT_MS", "0 to 60000"]),
  ({"EXO_BATCH_SIZE": "8", "EXO_BATCH_TIMEOUT_MS": "inf"}, {}, ["EXO_BATCH_TIMEOUT_MS", "milliseconds"]),
  ({"EXO_BATCH_SIZE": "8", "EXO_BATCH_TIMEOUT_MS": "soon"}, {}, ["EXO_BATCH_TIMEOUT_MS"]),
  ({"EXO_BATCH_SIZE": "1", "EXO_BATCH_TIMEOUT_MS": "-5"}, {}, ["EXO_BATCH_TIMEOUT_MS"]),  # checked even when off
  ({"EXO_BATCH_SIZE": "8", "EXO_PREFILL_CHUNK": "-1"}, {}, ["EXO_PREFILL_CHUNK", "tokens"]),
])
def test_refused_with_one_line_naming_the_setting(env, flags, names):
  with pytest.raises(ValueError) as info:
    batching_config_from(args(**flags), env)
  message = str(info.value)
  assert "\n" not in message
  for name in names:
    assert name in message
