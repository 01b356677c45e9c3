"""OpenAI legacy text completions (POST /v1/completions) read into a GenerationRequest: raw prompts, no chat template.
Validated the way chat requests are: bad input is a 400 naming the field, unimplemented parameters are refused."""
from typing import Any, Dict, List, Optional

from exo.api.body_model import MAX_INT32, Flag, neutral
from exo.api.errors import BadRequest
from exo.api.generation_request import FieldNames, GenerationRequest, Prompt
from exo.api.request_fields import MAX_CHOICES, LogprobCount, OpenAIBody, resolve_model, sampling_params

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this route (vLLM's too): a completion is a continuation, not an answer


class CompletionBody(OpenAIBody):
  prompt: Any = None
  logprobs: LogprobCount = None
  echo: Flag = None
  best_of: neutral(1) = None
  suffix: neutral("") = None

  def budget(self) -> Optional[int]:
    return self.max_tokens or DEFAULT_MAX_TOKENS


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
  completion = CompletionBody.read(body)
  model = resolve_model(completion.model, default_model, engine_classname)
  prompts, n = parse_prompts(completion.prompt), completion.n or 1
  if len(prompts) * n > MAX_CHOICES:
    raise BadRequest(f"{len(prompts)} prompts times n={n} asks for {len(prompts) * n} choices; at most {MAX_CHOICES} in one request",
                     param="n" if n > 1 else "prompt")
  if completion.logprobs is not None and completion.echo:
    raise BadRequest("logprobs with echo would need the prompt's own logprobs, which this server does not compute; drop one of them",
                     param="logprobs", code="unsupported_parameter")
  params = sampling_params(completion, default_temperature, max_tokens=completion.budget())
  return GenerationRequest(model, prompts=prompts, params=params, stop=completion.stop, n=n, echo=bool(completion.echo),
                           stream=bool(completion.stream), stream_usage=bool(completion.stream_options and completion.stream_options.include_usage),
                           fields=FieldNames(prompt="prompt"))
