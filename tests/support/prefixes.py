"""SmolLM2 chats for the prefix-cache tests: prompts that extend one another, answers with the cache on or off."""
import contextlib
from typing import List

from exo.inference.sampling import SamplingParams
from exo.orchestration.generation import generate
from exo.orchestration.node import Node
from tests.support.models import smollm2_shard

SYSTEM = "You are a careful assistant. You answer in one short sentence and never use lists. " * 3
QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]
ANSWER_TOKENS = 8


@contextlib.contextmanager
def prefixes_off(*engines):
  for e in engines:
    e.prefixes.enabled = False
  try:
    yield
  finally:
    for e in engines:
      e.prefixes.enabled = True


async def answer(node: Node, prompt: str, max_tokens: int = ANSWER_TOKENS, ignore_eos: bool = False) -> List[int]:
  out = []
  params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
  async for tokens, _ in generate(node, smollm2_shard(), prompt, params, timeout=120):
    out += tokens
  return out


def conversation(engine, turns: int) -> List[str]:
  """The prompt of each turn of one chat; each turn's answer is a fixed text, so every prompt extends the one before."""
  messages, prompts = [{"role": "system", "content": SYSTEM}], []
  for question in QUESTIONS[:turns]:
    messages.append({"role": "user", "content": question})
    prompts.append(engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    messages.append({"role": "assistant", "content": "I would say it depends on how you count."})
  return prompts


def template(engine, messages) -> str:
  return engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


async def two_turns(engine, node: Node, first_answer_tokens: int) -> tuple:
  """A chat's first turn, answered by the model, and the second turn's prompt, which holds that answer."""
  messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Describe a walk along a river at dawn."}]
  first = template(engine, messages)
  first_answer = await answer(node, first, first_answer_tokens, ignore_eos=True)
  messages += [{"role": "assistant", "content": engine.tokenizer.decode(first_answer)}, {"role": "user", "content": QUESTIONS[1]}]
  return first, first_answer, template(engine, messages)
