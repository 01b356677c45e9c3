"""The text the ring is given for a request: a conversation through the model's chat template, or raw prompts
(token ids checked against the vocabulary and sent as their text, which the first node tokenises again)."""
from typing import Any, Dict, List, Optional, Tuple

from exo.api.errors import BadRequest
from exo.api.generation_request import Prompt


def build_prompt(tokenizer, messages: List[Dict[str, Any]], tools: Optional[List[Any]] = None, system_prompt: Optional[str] = None,
                 template_kwargs: Optional[Dict[str, Any]] = None) -> str:
  """The templated prompt, with the template's extra variables `template_kwargs`. A node-wide system prompt goes first
  unless the request brings its own."""
  if system_prompt and not any(m.get("role") == "system" for m in messages):
    messages = [{"role": "system", "content": system_prompt}] + messages
  extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
  try:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
  except Exception as e:  # the template rejects this conversation (e.g. roles out of order)
    raise BadRequest(f"messages could not be formatted with the model's chat template: {e}", param="messages") from None


def prompt_texts(tokenizer, prompts: List[Prompt], param: str = "prompt") -> List[Tuple[str, List[int]]]:
  """Each raw prompt's text and token ids."""
  texts = []
  for i, prompt in enumerate(prompts):
    if isinstance(prompt, str):
      texts.append((prompt, list(tokenizer.encode(prompt))))
      continue
    vocab, name = getattr(tokenizer, "vocab_size", None), param if len(prompts) == 1 else f"{param}[{i}]"
    if vocab is not None and max(prompt) >= vocab:
      raise BadRequest(f"{name} has token id {max(prompt)}; this model's vocabulary has {vocab:,} tokens", param=name)
    texts.append((tokenizer.decode(prompt), list(prompt)))
  return texts
