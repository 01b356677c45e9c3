"""Prompt prefix reuse, the bookkeeping alone: block keys, the store (longest prefix, eviction, extension, take-over),
what a peer may send, the settings, and what of a request's state travels to a peer."""
import argparse
import json
from typing import List

import numpy as np
import pytest

from exo.inference.prefix_cache import BLOCK, MAX_ENTRIES, MAX_KEYS, PrefixStore, block_keys, checked_prefix
from exo.main import prefix_cache_budget
from exo.networking.grpc.codec import decode_inference_state
from exo.networking.grpc.grpc_peer_handle import GRPCPeerHandle
from exo.orchestration import statuses

pytestmark = pytest.mark.unit


class FakeCache:
  def __init__(self, nbytes: int, length: int = 0):
    self.nbytes, self.length = nbytes, length


def store_of(budget: int, live: List[FakeCache]) -> PrefixStore:
  return PrefixStore(budget, lambda: {id(c) for c in live}, lambda c: c.nbytes)


def test_block_keys_name_whole_prefixes():
  a, b = np.arange(3 * BLOCK + 5), np.concatenate([np.arange(2 * BLOCK), 1000 + np.arange(BLOCK)])
  keys_a, keys_b = block_keys("m", a), block_keys("m", b)
  assert len(keys_a) == 3 and len(keys_b) == 3  # only whole blocks
  assert keys_a[:2] == keys_b[:2] and keys_a[2] != keys_b[2]
  assert block_keys("other-model", a)[0] != keys_a[0]
  c = a.copy()
  c[0] = 7  # an earlier block changes every key after it
  assert all(x != y for x, y in zip(block_keys("m", c), keys_a))


def test_the_longest_held_prefix_is_found_and_an_extension_replaces_its_prefix():
  store, keys = store_of(1 << 20, []), [f"{i:024x}" for i in range(6)]
  short, long = FakeCache(10), FakeCache(20)
  store.add(short, keys[:2])
  assert store.longest(keys, 10 * BLOCK) == (store.entries[next(iter(store.entries))], 2 * BLOCK)
  store.add(long, keys[:5])
  assert [e.cache for e in store.entries.values()] == [long]  # the shorter one is part of it
  entry, positions = store.longest(keys, 3 * BLOCK + 1)  # a limit inside a block rounds down
  assert entry.cache is long and positions == 3 * BLOCK
  store.add(FakeCache(30), keys[:3])  # already held
  assert len(store.entries) == 1
  assert store.longest(keys[5:], 10 * BLOCK) == (None, 0)


def test_eviction_follows_use_and_never_touches_a_live_cache():
  live = [FakeCache(100)]
  store = store_of(150, live)
  a, b = FakeCache(100), FakeCache(100)
  store.add(live[0], ["0" * 24])
  store.add(a, ["a" * 24])
  store.add(b, ["b" * 24])  # over budget: a, least recently used, goes; the live one stays and costs nothing
  assert [e.cache for e in store.entries.values()] == [live[0], b]
  assert store.held_bytes() == 100
  store.set_budget(0)
  assert [e.cache for e in store.entries.values()] == [live[0]] and not store.enabled
  many = store_of(1 << 30, [])
  for i in range(MAX_ENTRIES + 5):
    many.add(FakeCache(1), [f"{i:024x}"])
  assert len(many.entries) == MAX_ENTRIES


def test_a_finished_request_extends_its_entry_and_a_taken_over_cache_keeps_only_the_shared_blocks():
  store, keys = store_of(1 << 20, []), [f"{i:024x}" for i in range(6)]
  cache = FakeCache(10, length=4 * BLOCK + 3)
  store.add(cache, keys[:2], "r1")
  store.extend("r1", keys[1:5], lambda c: c.length)  # not its prompt's blocks first: ignored
  store.extend("r2", keys[:5], lambda c: c.length)  # no entry of that request
  assert store.longest(keys, 10 * BLOCK)[1] == 2 * BLOCK
  store.extend("r1", keys, lambda c: c.length)  # its answer: as far as the cache holds whole blocks
  entry, positions = store.longest(keys, 10 * BLOCK)
  assert entry.cache is cache and positions == 4 * BLOCK and len(store.entries) == 1
  store.take_over(entry, 3 * BLOCK, "r3")  # r3 writes from position 48 on
  assert store.longest(keys, 10 * BLOCK) == (entry, 3 * BLOCK) and keys[3] not in store.by_key
  store.add(cache, keys[:3], "r3")  # r3's prompt is all held already, in the cache it took over: the entry is r3's
  store.extend("r3", keys[:5], lambda c: 5 * BLOCK)
  assert store.longest(keys, 10 * BLOCK)[1] == 5 * BLOCK and list(store.by_request) == ["r3"]


@pytest.mark.parametrize("bad", [None, [], {"keys": []}, {"keys": ["x"], "reuse": 0}, {"keys": ["0" * 24], "reuse": BLOCK + 1},
                                 {"keys": ["0" * 24], "reuse": 2 * BLOCK}, {"keys": ["0" * 24], "reuse": True},
                                 {"keys": ["0" * 24], "reuse": 0, "more": 1}])
def test_a_peers_unusable_prefix_is_refused(bad):
  with pytest.raises(ValueError, match="prefix"):
    checked_prefix(bad)


@pytest.mark.parametrize("bad", [{"keys": ["0" * 24]}, {"request_id": "r", "keys": "0" * 24}, {"request_id": "r", "keys": ["x"]},
                                 {"request_id": "r", "keys": ["0" * 24] * (MAX_KEYS + 1)}, {"request_id": "", "keys": ["0" * 24]}])
def test_a_peers_unusable_answer_blocks_are_refused(bad):
  assert statuses.parse(statuses.PrefixExtend.build(request_id="r", keys=["0" * 24]))[1].keys == ["0" * 24]
  with pytest.raises(statuses.InvalidStatus):
    statuses.parse(json.dumps({"type": statuses.PREFIX_EXTEND, **bad}))


def test_settings_on_by_default_a_budget_and_an_off_switch():
  args = lambda mb=None, off=False: argparse.Namespace(prefix_cache_mb=mb, no_prefix_cache=off)
  assert prefix_cache_budget(args(), {}) == 1 << 30
  assert prefix_cache_budget(args(), {"EXO_PREFIX_CACHE_MB": "64"}) == 64 << 20
  assert prefix_cache_budget(args(mb=8), {"EXO_PREFIX_CACHE_MB": "64"}) == 8 << 20
  assert prefix_cache_budget(args(), {"EXO_PREFIX_CACHE": "0"}) == 0
  assert prefix_cache_budget(args(off=True), {}) == 0
  for env in ({"EXO_PREFIX_CACHE_MB": "lots"}, {"EXO_PREFIX_CACHE_MB": "-1"}, {"EXO_PREFIX_CACHE": "maybe"}):
    with pytest.raises(ValueError, match="EXO_PREFIX_CACHE"):
      prefix_cache_budget(args(), env)


def test_only_the_prefix_travels_to_a_peer():
  assert decode_inference_state(GRPCPeerHandle.wire_state({"secret": 1})) == {}
  prefix = {"keys": ["0" * 24], "reuse": 0}
  assert decode_inference_state(GRPCPeerHandle.wire_state({"prefix": prefix, "secret": 1})) == {"prefix": prefix}
