"""The soak (bench/soak.py) for a minute in all: 64 closed-loop clients, a quarter of them leaving mid-answer, one
asking for a second model, 30 s against one node and 30 s against a 2-process ring (prompts up to 500 tokens here,
1,500 in the full soak). Nothing fails, every answer equals
its prompt's solo answer, and afterwards no request and no KV byte is left on any node."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)
def test_a_minute_of_soak_leaves_nothing_behind(tmp_path):
  # One request for the second model (the first client's first), so the nodes switch models once each way.
  run = subprocess.run([sys.executable, "bench/soak.py", "--seconds", "30", "--rings", "1,2", "--second-model-fraction", "0",
                        "--prompt-tokens", "30,60,120,250,500", "--log-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
  report = run.stdout[-4000:] + run.stderr[-4000:]
  results = [json.loads(line) for line in (tmp_path / "soak.jsonl").read_text().splitlines()]
  assert [r["nodes"] for r in results] == [1, 2], report
  for r in results:
    assert r["errors"] == 0 and r["divergences"] == 0, report
    assert r["live_after"] == 0 and r["kv_bytes_after"] == 0, report
    assert r["finished"] > 0 and r["cancelled"] > 0 and r["second_model"] > 0, report
  assert run.returncode == 0 and "soak: passed" in run.stdout, report
