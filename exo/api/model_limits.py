"""What a request may ask of a model, known from its configuration before anything is allocated: the context
length (GGUF `llama.context_length`, config.json `max_position_embeddings`) and the KV cache each position takes, at
the width the node's engine stores it in (InferenceEngine.kv_bytes_per_value), a sliding-window layer's no more than
its window."""
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

from exo.api.errors import BadRequest
from exo.inference.weights import LlamaConfig


@dataclass(frozen=True)
class ModelLimits:
  context_length: Optional[int] = None  # None: not known (the dummy model), nothing is checked
  kv_bytes_per_position_per_layer: int = 0
  sliding_window: Optional[int] = None  # the positions a sliding layer's cache holds at most
  sliding_layers: Tuple[int, ...] = ()

  @staticmethod
  def of(config: LlamaConfig, kv_bytes_per_value: int, keeps_window: bool = False) -> "ModelLimits":
    """`keeps_window`: the engine's sliding layers keep only their window (InferenceEngine.kv_keeps_window)."""
    sliding = keeps_window and config.sliding_window is not None
    return ModelLimits(config.max_position_embeddings, config.kv_values_per_position * kv_bytes_per_value,  # K and V, or MLA's latent
                       config.sliding_window if sliding else None, config.sliding_layers if sliding else ())

  def kv_bytes(self, positions: int, layers: Iterable[int]) -> int:
    """The KV cache a request of `positions` positions takes in `layers` (the model's layer numbers a node holds):
    every position in a layer that attends to all, at most the window in a sliding one."""
    window = self.sliding_window or positions
    held = sum(min(positions, window) if layer in self.sliding_layers else positions for layer in layers)
    return held * self.kv_bytes_per_position_per_layer

  def reply_budget(self, prompt_tokens: int, max_tokens: Optional[int], param: str = "messages", max_tokens_param: str = "max_tokens") -> Optional[int]:
    """The most tokens the reply may take: max_tokens if the context holds it beside the prompt, else what the
    context leaves when max_tokens is not given. Raises BadRequest (vLLM's rule) when the prompt, or the prompt
    plus max_tokens, does not fit; `param` and `max_tokens_param` are the request's names of the two."""
    context = self.context_length
    if context is None:
      return max_tokens
    if prompt_tokens >= context:
      raise BadRequest(f"the prompt is {prompt_tokens:,} tokens; this model's context is {context:,} (shorten the {param})",
                       param=param, code="context_length_exceeded")
    if max_tokens is None:
      return context - prompt_tokens
    if prompt_tokens + max_tokens > context:
      raise BadRequest(f"the prompt is {prompt_tokens:,} tokens and {max_tokens_param} asks for {max_tokens:,} more; this model's context is "
                       f"{context:,} (ask for at most {context - prompt_tokens:,})", param=max_tokens_param, code="context_length_exceeded")
    return max_tokens
