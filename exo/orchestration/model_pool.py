"""The chat models this node holds at once, one engine each, and the room the model gate gives another model.

The node's engine takes the first model; each further one gets an engine of the same class, set up like the first (a
subclass exo cannot build again holds one model at a time). Another model is let in while the models held number at
most `max_models` and weigh at most the memory this node offers; idle models are unloaded to make room, least recently
used first, or after their keep-alive (exo/keep_alive.py); the node's own engine's model stays unless asked."""
import logging
import math
from typing import Callable, Collection, Dict, List, Optional

from exo import settings
from exo.inference.inference_engine import InferenceEngine, inference_engine_classes
from exo.inference.shard import Shard
from exo.keep_alive import KeepAlive, KeptPool
from exo.orchestration.model_gate import gate_key
from exo.topology.placement import MemberFacts, stage_bytes

log = logging.getLogger(__name__)

DEFAULT_MAX_LOADED_MODELS = 3  # as Ollama's OLLAMA_MAX_LOADED_MODELS on a machine without GPUs
SHARDS_KEPT = 256  # the models asked for that are not loaded, remembered for their size (a bound against made-up names)


def max_loaded_models(args, environ) -> int:
  """--max-loaded-models / EXO_MAX_LOADED_MODELS (ValueError naming it if it is not a whole number from 1)."""
  value, _ = settings.number(args, environ, "max_loaded_models", 1, math.inf, "a whole number of models, at least 1")
  return DEFAULT_MAX_LOADED_MODELS if value is None else value


class ModelPool(KeptPool):
  def __init__(self, engine: InferenceEngine, downloader, own_facts: Callable[[], MemberFacts]):
    # own_facts: what this node announces (float width, memory offered), by which a model's size is weighed.
    self.engine, self.downloader, self.own_facts = engine, downloader, own_facts
    self.max_models = DEFAULT_MAX_LOADED_MODELS  # EXO_MAX_LOADED_MODELS's, which exo.main sets
    self.engines: Dict[str, InferenceEngine] = {}  # gate key -> the engine that holds it
    self.shards: Dict[str, Shard] = {}  # gate key -> its shard, for its size
    self.free: List[InferenceEngine] = [engine]  # engines that hold no model now
    self.residents = KeepAlive(self._unload)
    self.asked_keep_alive: Dict[str, float] = {}  # model id -> the keep-alive its latest request asked for
    self.loads = 0  # models loaded so far: how tests and logs see that nothing was loaded twice

  def engine_of(self, shard: Shard) -> InferenceEngine:
    """The engine that holds (or is loading) `shard`; the node's own engine when none does."""
    return self.engines.get(gate_key(shard)) or self.engine

  def all_engines(self) -> List[InferenceEngine]:
    return list(self.engines.values()) + [e for e in self.free if e not in self.engines.values()]

  def _engine_name(self) -> Optional[str]:
    """The short name exo builds the node's engine class by; None for a class it does not build (a subclass)."""
    classname = type(self.engine).__name__
    return next((name for name, cls in inference_engine_classes.items() if cls == classname), None)

  def _build_engine(self) -> InferenceEngine:
    from exo.inference.engines import get_inference_engine
    first = self.engine
    engine = get_inference_engine(self._engine_name(), self.downloader)
    if getattr(first, "quantize_bits", None) is not None:
      engine.quantize_bits = first.quantize_bits
    prefixes = getattr(first, "prefixes", None)
    if prefixes is not None:
      engine.set_prefix_budget(prefixes.budget_bytes)
    return engine

  def expect(self, shard: Shard) -> None:
    """A request (or preload) is about to ask the gate for `shard`: its size is known from here on."""
    if len(self.shards) >= SHARDS_KEPT:
      self.shards = {k: s for k, s in self.shards.items() if k in self.engines}
    self.shards[gate_key(shard)] = shard

  def bytes_of(self, key: str) -> float:
    shard = self.shards.get(key)
    return 0.0 if shard is None else stage_bytes(self.own_facts(), shard)

  def _other_layers(self, key: str, keys: Collection[str]) -> List[str]:
    """Those of `keys` that are other layers of the same model (never held beside each other)."""
    shard = self.shards.get(key)
    return [k for k in keys if k != key and shard is not None and k in self.shards and self.shards[k].model_id == shard.model_id]

  def _room_for(self, model: str, keys: Collection[str]) -> bool:
    """Whether `model` fits beside the models `keys`: fewer than the limit, and their weight with it within memory."""
    if not keys:
      return True
    most = max(1, self.max_models) if self._engine_name() is not None else 1  # (an engine exo cannot build: one model)
    memory_mb = self.own_facts().memory_mb  # (none known: any weight fits)
    weight = sum(map(self.bytes_of, keys)) + self.bytes_of(model)
    return len(keys) < most and (memory_mb <= 0 or weight <= memory_mb * 2**20)

  def fits(self, model: str, held: Collection[str]) -> bool:
    """Whether `model` may be loaded while requests hold the models `held` (it is not one of them)."""
    held = [key for key in self.engines if key in held]
    return not self._other_layers(model, held) and self._room_for(model, held)

  def admit(self, model: str) -> None:
    """A request (or preload) now holds `model`, and none did before."""
    if model not in self.residents:
      self._make_room(model)
      self.engines[model] = self.free.pop(0) if self.free else self._build_engine()
      self.residents.add(model)
      self.loads += 1
      log.info("exo: loading %s beside %s", model, ", ".join(k for k in self.engines if k != model) or "nothing")
    self.residents.take(model)

  def release(self, model: str) -> None:
    """The last request holding `model` has let it go."""
    shard = self.shards.get(model)
    asked = self.asked_keep_alive.pop(shard.model_id, None) if shard is not None else None
    if asked is None and self.engines.get(model) is self.engine:
      # The own engine's model stays unless asked or room is needed: placement would only load it again.
      asked = math.inf
    self.residents.release(model, asked)

  def _make_room(self, model: str) -> None:
    """Unload idle models, least recently used first, until `model` fits beside the rest; and other layers of its model."""
    other_layers = self._other_layers(model, self.engines)
    for idle in self.residents.idle():
      if self._room_for(model, list(self.engines)) and idle not in other_layers:
        continue
      log.info("exo: unloading %s (idle) to make room for %s", idle, model)
      self.residents.remove(idle)

  def _unload(self, key: str) -> None:
    engine = self.engines.pop(key, None)
    if engine is None:
      return
    log.info("exo: unloaded %s", key)
    unload = getattr(engine, "unload", None)  # the Llama engines let their weights go; another engine's go when it loads the next
    if unload is not None:
      unload()
    self.free.append(engine)

  def keep(self, model_id: str, seconds: float, now: bool = False) -> None:
    """Keep `model_id` `seconds` after its requests end (Ollama's keep_alive); `now`: apply it to an idle model at once."""
    for key, shard in self.shards.items():
      resident = self.residents.residents.get(key)
      if now and shard.model_id == model_id and resident is not None and resident.in_use == 0:
        resident.keep_alive = seconds
        self.residents.sweep()
        return
    self.asked_keep_alive[model_id] = seconds

  def close(self) -> None:
    if self.residents.timer is not None:
      self.residents.timer.cancel()

  def holds(self, shard: Shard) -> bool:
    """Whether the shard is loaded here (its engine has it, not only the gate's leave to load it)."""
    engine = self.engines.get(gate_key(shard))
    return engine is not None and engine.shard == shard

  def shards_loaded(self) -> List[Shard]:
    """The shards of the models loaded (or loading) here, in the order they loaded."""
    return [self.shards[key] for key in self.residents.residents if key in self.shards]

  def announced(self) -> Optional[Shard]:
    """The shard this node tells the ring it holds: the own engine's while it holds it (steady as requests alternate
    between models), else the loaded one used last, one in use first."""
    own, residents = self.engine.shard, self.residents.residents
    if own is not None and self.holds(own):
      return own
    loaded = [k for k in residents if k in self.shards and self.holds(self.shards[k])]
    latest = max(loaded, key=lambda k: (residents[k].in_use > 0, residents[k].last_used, residents[k].uses), default=None)
    return self.shards[latest] if latest is not None else own

  def describe(self) -> List[dict]:
    """The chat models loaded, for /api/ps, /v1/models and /v1/state (what has expired is unloaded first)."""
    self.residents.sweep()
    now = self.residents.clock()
    rows = []
    for key, resident in self.residents.residents.items():
      shard = self.shards.get(key)
      if shard is None:  # held through the gate alone, by a name and not a shard (no request runs on it)
        continue
      rows.append({"model": shard.model_id, "layers": [shard.start_layer, shard.end_layer], "n_layers": shard.n_layers,
                   "requests": resident.in_use, "bytes": self.bytes_of(key), **resident.times(now)})
    return rows
