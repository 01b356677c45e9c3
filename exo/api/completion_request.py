"""OpenAI legacy text completions (POST /v1/completions) read into a GenerationRequest: raw prompts, no chat template.
Validated the way chat requests are: bad input is a 400 naming the field, unimplemented parameters are refused."""
from dataclasses import replace
from typing import Any, Dict, List, Optional

from exo.api.errors import BadRequest
from exo.api.generation_request import FieldNames, GenerationRequest, Prompt
from exo.api.request_fields import (MAX_CHOICES, MAX_INT32, parse_flag, parse_logprobs_count, parse_n, parse_stop, parse_stream_options, parse_user,
                                    refuse_unimplemented, resolve_model, sampling_params)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this route (vLLM's too): a completion is a continuation, not an answer
IMPLEMENTED = {"model", "prompt", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "n",
               "logprobs", "echo", "ignore_eos", "user", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens"}
NEUTRAL_VALUES = {"best_of": [1], "suffix": [""]}


def _is_token_ids(value: Any) -> bool:
  return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT32 for t in value)


def parse_prompts(value: Any) -> List[Prompt]:
  """OpenAI's four forms: a string, a list of strings, a list of token ids, a list of lists of token ids."""
  why = "prompt must be a non-empty string, a list of them, a list of token ids (integers >= 0) or a list of such lists"
  if isinstance(value, str) or (isinstance(value, list) and value and not isinstance(value[0], (str, list))):
    prompts, names = [value], ["prompt"]  # one prompt: text or token ids
  elif isinstance(value, list) and value:
    prompts, names = value, [f"prompt[{i}]" for i in range(len(value))]
  else:
    raise BadRequest(why, param="prompt")
  for prompt, name in zip(prompts, names):
    if not (isinstance(prompt, str) and prompt) and not _is_token_ids(prompt):
      raise BadRequest(why, param=name)
  return prompts


def parse_completion_request(body: Dict[str, Any], default_model: str, engine_classname: str, default_temperature: float = 0.0) -> GenerationRequest:
  refuse_unimplemented(body, IMPLEMENTED, NEUTRAL_VALUES)
  model = resolve_model(body.get("model"), default_model, engine_classname)
  prompts = parse_prompts(body.get("prompt"))
  n = parse_n(body)
  if len(prompts) * n > MAX_CHOICES:
    raise BadRequest(f"{len(prompts)} prompts times n={n} asks for {len(prompts) * n} choices; at most {MAX_CHOICES} in one request",
                     param="n" if n > 1 else "prompt")
  echo = parse_flag(body, "echo")
  logprobs: Optional[int] = parse_logprobs_count(body, "logprobs")
  if logprobs is not None and echo:
    raise BadRequest("logprobs with echo would need the prompt's own logprobs, which this server does not compute; drop one of them",
                     param="logprobs", code="unsupported_parameter")
  parse_user(body)
  params = sampling_params({"max_tokens": DEFAULT_MAX_TOKENS, **{k: v for k, v in body.items() if v is not None}}, default_temperature)
  params = replace(params, logprobs=logprobs)
  return GenerationRequest(model, prompts=prompts, params=params, stop=parse_stop(body), n=n, echo=echo, stream=parse_flag(body, "stream"),
                           stream_usage=parse_stream_options(body), fields=FieldNames(prompt="prompt"))
