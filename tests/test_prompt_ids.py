"""A prompt is tokenised once, where it arrives: its token ids go with it to the node with the first layers, which
runs them without encoding the text again; among this fork's nodes they travel in the inference state, and a ring
route (which upstream nodes may be on) carries the text only. Ids outside the vocabulary fail the request clearly.
(The cluster tests run every API prompt this way over real gRPC.)"""

import pytest

from exo.inference.sampling import SamplingParams
from exo.networking.grpc.grpc_peer_handle import GRPCPeerHandle
from exo.orchestration.generation import GenerationError, generate
from exo.orchestration.passes import PROMPT_IDS
from exo.orchestration.routing.route import Route
from exo.topology.placement import Stage
from tests.support.toy import TOY, VOCAB, ToyEngine, encode, make_node, reference_greedy, settle

pytestmark = pytest.mark.unit

class CountingEngine(ToyEngine):
  def __init__(self):
    super().__init__()
    self.encoded = 0

  async def encode(self, shard, prompt):
    self.encoded += 1
    return await super().encode(shard, prompt)

async def answer(node, prompt, prompt_ids=None):
  out = []
  async for tokens, _ in generate(node, TOY, prompt, SamplingParams(max_tokens=5), timeout=30, prompt_ids=prompt_ids):
    out += tokens
  return out

async def test_a_prompt_given_as_ids_is_run_as_those_ids_and_never_encoded_again():
  engine = CountingEngine()
  node, _ = make_node(engine)
  # The text is what upstream nodes would get; the ids are what runs here.
  assert await answer(node, "text for upstream nodes", encode("the real prompt").tolist()) == reference_greedy("the real prompt", 5)
  assert engine.encoded == 0
  assert await answer(node, "a text prompt") == reference_greedy("a text prompt", 5)  # without ids: encoded here, once
  assert engine.encoded == 1
  await settle(node)

async def test_ids_outside_the_vocabulary_fail_the_request_with_a_clear_error():
  engine = CountingEngine()
  engine.tokenizer.vocab_size = VOCAB
  node, _ = make_node(engine)
  with pytest.raises(GenerationError, match=PROMPT_IDS):
    await answer(node, "text", [1, 2, VOCAB + 5])
  assert await answer(node, "ok", encode("ok").tolist()) == reference_greedy("ok", 5)  # the node goes on
  await settle(node)

def test_the_ids_travel_on_a_route_and_a_ring_route_carries_the_text_only():
  node, _ = make_node(ToyEngine())
  state = {PROMPT_IDS: [5, 6, 7]}
  routed = node.requests.open("routed", SamplingParams())
  node.forwarding.set_route(routed, Route((Stage("first", 0, 1), Stage(node.id, 2, 3)), "v1", node.id))
  sent = node.forwarding.outgoing(routed, state, Stage("first", 0, 1), prompt=True)
  assert sent[PROMPT_IDS] == [5, 6, 7] and PROMPT_IDS in GRPCPeerHandle.wire_state(sent).other_data_json
  ring = node.requests.open("ring", SamplingParams())
  node.forwarding.set_route(ring, Route((Stage("first", 0, 1), Stage(node.id, 2, 3))))
  assert PROMPT_IDS not in node.forwarding.outgoing(ring, state, Stage("first", 0, 1), prompt=True)
