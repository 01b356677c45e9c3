"""A model crosses the internet once per cluster: what the hub serves, and how long the nodes take, when several
nodes need one model. Real `exo` processes on loopback (manual discovery) download a random-weight Llama in the
layout of `unsloth/Llama-3.2-1B-Instruct` (llama-3.2-1b on the numpy engine) from the stand-in hub
(tests/support/stand_in_hub.py), which sends each connection at most --hub-rate bytes/s and counts what it sends.

  python bench/cluster_downloads.py                             # this checkout's exo
  python bench/cluster_downloads.py --exo-checkout /path/main   # the nodes run another checkout's exo (a baseline)

Reported:
- alone: one node downloads the model (POST /download until /modelpool says downloaded);
- together: three nodes asked at once; the time until all three hold it, / alone's (target <= 1.3x), and the
  hub's bytes and GETs per file (target: each file once);
- offline: a fourth node with HF_HUB_OFFLINE=1, idle until then, downloads it; its bytes equal to the hub's, the hub asked
  nothing;
- peer speed: a node fetches a --big-mb model from a peer that holds it (the log line each peer transfer prints),
  target >= 100 MB/s on loopback."""
import argparse
import asyncio
import hashlib
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.checkpoints import write_layer_split_llama  # noqa: E402
from tests.support.cluster import Cluster  # noqa: E402
from tests.support.stand_in_hub import StandInHub  # noqa: E402
from tests.test_downloads import FOLDER, MODEL, REPO, call, model_pool  # noqa: E402

PEER_LINE = re.compile(r"exo: (?P<file>\S+) from peer \S+ \(.*\): (?P<mb>[\d.]+) MB in (?P<s>[\d.]+) s \((?P<rate>\d+) MB/s\)")


def node_env(hub: StandInHub, home: Path, checkout) -> dict:
  env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(home / "hf_home"), "HF_TOKEN": ""}
  if checkout:
    env["PYTHONPATH"] = checkout
  return env


def cluster(work: Path, ids, hub: StandInHub, checkout) -> Cluster:
  nodes = Cluster(work, ids, "numpy", node_env(hub, work, checkout))
  if checkout:  # `python -m exo.main` imports exo from its working directory first
    for process in nodes.nodes.values():
      process.prefix = ["env", "-C", checkout]
  return nodes


async def download_all(cluster: Cluster, ids) -> float:
  """Seconds from asking every node at once until every one holds the model verified."""
  started = time.monotonic()
  for status, body in await asyncio.gather(*[call("POST", f"{cluster.url(i)}/download", {"model": MODEL}) for i in ids]):
    assert status == 200, body
  pending = set(ids)
  while pending:
    for node_id in list(pending):
      if (await model_pool(cluster.url(node_id))).get(MODEL, {}).get("downloaded"):
        pending.discard(node_id)
      download = (await call("GET", f"{cluster.url(node_id)}/v1/downloads"))[1].get(MODEL, {})
      if download.get("status") == "failed":
        raise SystemExit(f"{node_id}'s download failed: {download.get('error')}")
    assert time.monotonic() - started < 600, f"not downloaded within 600 s: {pending}"
    await asyncio.sleep(0.05)
  return time.monotonic() - started


def hub_report(hub: StandInHub, since: int = 0) -> str:
  gets = {}
  for r in hub.requests[since:]:
    if r.method == "GET" and r.path not in ("model_info", "tree"):
      gets[r.path] = gets.get(r.path, 0) + 1
  return f"{sum(hub.bytes_sent.values()) / 1e6:.1f} MB sent, GETs per file {dict(sorted(gets.items()))}"


def digests(folder: Path) -> dict:
  return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")}


async def one_model(args, work: Path, model: Path) -> None:
  size = sum(p.stat().st_size for p in model.iterdir()) / 1e6
  print(f"model: {size:.1f} MB in {len(list(model.iterdir()))} files; hub: {args.hub_rate / 1e6:g} MB/s per connection")
  hub = StandInHub().start()
  hub.add_repo(REPO, model)
  hub.bytes_per_second = args.hub_rate
  try:
    (work / "alone").mkdir()
    solo = cluster(work / "alone", ["solo"], hub, args.exo_checkout)
    try:
      await solo.start()
      alone = await download_all(solo, ["solo"])
    finally:
      solo.stop()
    print(f"alone: {alone:.2f} s; hub {hub_report(hub)}")
    hub.requests.clear()
    hub.bytes_sent.clear()
    (work / "together").mkdir()
    ids = ["a", "b", "c", "d"]
    together_cluster = cluster(work / "together", ids, hub, args.exo_checkout)
    d = together_cluster.nodes["d"]
    d.extra_env = {**d.extra_env, "HF_HUB_OFFLINE": "1"}
    try:
      await together_cluster.start()  # d idle meanwhile (started late, its preassigned ports may have been taken by then)
      together = await download_all(together_cluster, ids[:3])
      print(f"together (3 nodes asked at once): {together:.2f} s = {together / alone:.2f}x alone; hub {hub_report(hub)}")
      asked = len(hub.requests)
      try:
        offline = await download_all(together_cluster, ["d"])
        same = digests(d.home / "downloads" / FOLDER) == digests(model)
        print(f"offline 4th node joins: {offline:.2f} s; bytes equal to the hub's: {same}; hub requests meanwhile: {len(hub.requests) - asked}")
      except (SystemExit, AssertionError) as e:
        print(f"offline 4th node: {e}"[:300])
    finally:
      together_cluster.stop()
  finally:
    hub.stop()


async def peer_speed(args, work: Path) -> None:
  (work / "big").mkdir()
  model = write_layer_split_llama(work / "big" / REPO.split("/")[1], 16, hidden=args.big_hidden)
  size = sum(p.stat().st_size for p in model.iterdir()) / 1e6
  hub = StandInHub().start()
  hub.add_repo(REPO, model)
  try:
    nodes = cluster(work / "big", ["holder", "fetcher"], hub, args.exo_checkout)
    try:
      await nodes.start()
      await download_all(nodes, ["holder"])
      hub.bytes_per_second = args.hub_rate  # the hub's rate bounds nothing that follows
      hub.requests.clear()
      hub.bytes_sent.clear()
      seconds = await download_all(nodes, ["fetcher"])
      lines = [m for m in PEER_LINE.finditer(nodes.nodes["fetcher"].current_log())]
      biggest = max(lines, key=lambda m: float(m["mb"]), default=None)
      shown = f"{biggest['file']}: {biggest['mb']} MB in {biggest['s']} s = {biggest['rate']} MB/s" if biggest else "no peer transfer logged"
      print(f"peer speed ({size:.0f} MB model): whole download {seconds:.2f} s ({size / seconds:.0f} MB/s incl. listing and checks); "
            f"largest file {shown}; hub sent the fetcher {hub_report(hub)}")
    finally:
      nodes.stop()
  finally:
    hub.stop()


async def main(args) -> None:
  with tempfile.TemporaryDirectory() as tmp:
    work = Path(tmp)
    (work / "model").mkdir()
    model = write_layer_split_llama(work / "model" / REPO.split("/")[1], 16, hidden=args.hidden)
    if not args.peer_speed_only:
      await one_model(args, work, model)
    if args.big_hidden:
      await peer_speed(args, work)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--hub-rate", type=float, default=3e6, help="bytes/s the hub sends each connection")
  parser.add_argument("--hidden", type=int, default=128, help="the model's hidden size (128: about 34 MB)")
  parser.add_argument("--big-hidden", type=int, default=512, help="hidden size of the peer-speed model (512: about 240 MB); 0 skips it")
  parser.add_argument("--peer-speed-only", action="store_true", help="only the peer-speed case")
  parser.add_argument("--exo-checkout", default=None, help="run the nodes from this checkout (PYTHONPATH) instead of this one")
  arguments = parser.parse_args()
  os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
  asyncio.run(main(arguments))
