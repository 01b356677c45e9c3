"""A sliding-window model (Gemma 2: the cut falls between its sliding and its full layer), mixtures of experts
(Mixtral: the cut falls between two expert layers; gpt-oss: between its sliding and its full expert layer, with
attention sinks), latent attention (DeepSeek-V3: each node caches its own layers' latents) and Gemma 3's image-and-text
form (each node reads only its share of the text model), each split over a 2-process ring by `exo run`, answer what
one process alone answers."""
import asyncio
import re

import pytest

from tests.support.checkpoints import PLAIN_TEMPLATE, fixture_checkpoint
from tests.support.cluster import ExoProcess, free_port, run_answers, wait_for_ring, write_manual_config

pytestmark = pytest.mark.cluster

PROMPTS = ["in the and of to a b c d", "a b c d e f g h"]  # only tokens the fixtures' 512-token vocabulary has
NAMES = ["gemma2", "mixtral", "gpt_oss", "deepseek_v3", "gemma3_v4"]


def run_args(path) -> list:
  return ["run", str(path), "--inference-engine", "numpy", "--max-generate-tokens", "12", *[a for p in PROMPTS for a in ("--prompt", p)]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("models")
  return {name: fixture_checkpoint(name, root / name, PLAIN_TEMPLATE) for name in NAMES}


@pytest.fixture(scope="module")
def ring_peer(checkpoints, tmp_path_factory):
  """A node serving the checkpoints' directory, for `exo run` drivers to form a 2-node ring with."""
  workdir = tmp_path_factory.mktemp("ring")
  ports = {"node-a": free_port(), "node-b": free_port()}
  config = write_manual_config(workdir / "peers.json", ports)
  peer = ExoProcess("node-b", ["--inference-engine", "numpy", "--models-dir", str(checkpoints[NAMES[0]].parent), "--node-host", "127.0.0.1",
                               "--node-port", str(ports["node-b"]), "--chatgpt-api-port", str(free_port()), "--discovery-module", "manual",
                               "--discovery-config-path", str(config), "--disable-tui"], workdir, {"DEBUG": "5"})  # 5: it logs each forward
  peer.start()
  try:
    asyncio.run(wait_for_ring({"node-b": ports["node-b"]}, 60, [peer]))
    yield peer, ports, config, workdir
  finally:
    peer.stop()


@pytest.mark.parametrize("name", NAMES)
def test_split_over_two_processes_answers_as_one(checkpoints, ring_peer, tmp_path, name):
  alone = ExoProcess("alone", run_args(checkpoints[name]), tmp_path)
  assert alone.start().wait(240) == 0, alone.log()[-3000:]
  peer, ports, config, workdir = ring_peer
  before = len(peer.log())
  driver = ExoProcess("node-a", run_args(checkpoints[name]) + ["--node-host", "127.0.0.1", "--node-port", str(ports["node-a"]),
                                                               "--discovery-module", "manual", "--discovery-config-path", str(config),
                                                               "--wait-for-peers", "1"], workdir / name)
  try:
    assert driver.start().wait(240) == 0, driver.log()[-3000:]
  finally:
    driver.stop()
    asyncio.run(wait_for_ring({"node-b": ports["node-b"]}, 30, [peer]))  # the driver gone before the next one joins
  answers = run_answers(alone.log(), PROMPTS)
  assert all(answers) and run_answers(driver.log(), PROMPTS) == answers
  assert re.search(r"forward (tensor|prompt) .* to node-a|\] token \d+ ", peer.log()[before:]), peer.log()[-3000:]  # the peer did its half
