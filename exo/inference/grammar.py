"""The grammar engine (llguidance): a request's grammar compiled against its model's vocabulary, and the matcher
that follows its answer token by token.

A grammar is Lark text in llguidance's dialect (JSON Schemas go in as `%json {...}`; `json_fragment` writes one in
this project's fixed JSON layout). Compiling needs the model's tokenizer as llguidance sees it, built once per
tokenizer from the model's own vocabulary (the `tokenizers` object that exo/inference/tokenizers.py makes from the
GGUF metadata or tokenizer.json). Compiled grammars are kept by (tokenizer, grammar text); each request gets a copy
of the compiled matcher. Compiling and computing masks run on GRAMMAR_THREADS threads of their own, never on the
event loop or the engine's thread (llguidance releases the GIL while it works)."""
import asyncio
import functools
import importlib.util
import json
import re
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from exo.inference.closing import CLOSING_MARKERS, Budget, ClosingTokens
from exo.inference.json_numbers import START, NumberBounds, clear_bits


@functools.lru_cache(maxsize=None)
def _llguidance():
  """llguidance, imported at the first constrained request (~4 MiB resident that a node never asked for structured
  output does without); None where it is not installed: requests that need it then fail with a clear error."""
  try:
    import llguidance
    return llguidance
  except ImportError:
    return None

# JSON as json.dumps writes it: ", " and ": ", no other whitespace. A fixed layout keeps answers short (free
# whitespace lets a small model wander into newlines) and lets the tool-call parsers read calls as they stream.
ENGINE = "llguidance"  # what nodes announce they constrain with
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
MAX_GRAMMAR_CHARS = 256 * 1024  # a grammar travels the ring in a status; far beyond any real schema
COMPILED_KEPT = 256  # compiled grammars kept per process
GRAMMAR_THREADS = 1  # compiles and masks: one thread beside the engine's, on machines this small
LOG_LEVEL = 0  # llguidance's own warnings: the errors it reports are raised here with their message


class GrammarError(ValueError):
  """The grammar cannot be used: malformed, or beyond what the grammar engine does; str(self) says why."""


class CannotConstrain(RuntimeError):
  """This node cannot constrain output (llguidance is missing, or the model's tokenizer cannot be read)."""


def available() -> bool:
  return importlib.util.find_spec("llguidance") is not None


def _require() -> None:
  if _llguidance() is None:
    raise CannotConstrain("this node cannot constrain output: the llguidance package is not installed (pip install llguidance)")


def json_fragment(schema: Any, lenient: bool = False) -> str:
  """`%json {...}`: values `schema` allows, in JSON_LAYOUT, `tightened`: every answer still validates against the
  schema as given, and a small model cannot wander off into keys nobody asked for or digits without end. With
  `lenient`, keywords the engine does not implement are ignored instead of refused."""
  schema = {} if schema is True else schema  # JSON Schema's "anything"
  if not isinstance(schema, dict):
    raise GrammarError("a JSON Schema must be an object (or true)")
  options = {**JSON_LAYOUT, "lenient": bool(lenient)}
  return "%json " + json.dumps({**{k: v for k, v in tightened(schema).items() if k != "x-guidance"}, "x-guidance": options})


_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties", "propertyNames", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


SAFE_INTEGER = 2**53 - 1  # JSON's interoperable integers (RFC 8259): bounds an integer schema that has none


def tightened(schema: Any) -> Any:
  """A copy of `schema` in which every object schema with `properties` and none of _OPEN_KEYS allows no other
  properties, and every integer schema without bounds stays within +-SAFE_INTEGER."""
  if not isinstance(schema, dict):
    return schema
  out = dict(schema)
  for key in _SUBSCHEMA:
    if key in out:
      out[key] = tightened(out[key])
  for key in _SUBSCHEMA_LISTS:
    if isinstance(out.get(key), list):
      out[key] = [tightened(s) for s in out[key]]
  for key in _SUBSCHEMA_MAPS:
    if isinstance(out.get(key), dict):
      out[key] = {name: tightened(s) for name, s in out[key].items()}
  if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
    out["additionalProperties"] = False
  types = out.get("type")
  if types == "integer" or (isinstance(types, list) and "integer" in types and "number" not in types):
    if "maximum" not in out and "exclusiveMaximum" not in out:
      out["maximum"] = SAFE_INTEGER
    if "minimum" not in out and "exclusiveMinimum" not in out:
      out["minimum"] = -SAFE_INTEGER
  return out


WIDE_NUMBER = 10**17  # a schema bound this far out asks for more digits than json_numbers.MAX_DIGITS
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def asks_for_wide_numbers(schema: Any) -> bool:
  """Whether a schema lets a number reach WIDE_NUMBER by a bound of its own (`minimum`, `maximum` or their exclusive
  forms): the answer's numbers are then not held to exo/inference/json_numbers.py's bounds."""
  stack = [schema]
  while stack:
    node = stack.pop()
    if isinstance(node, dict):
      if any(isinstance(node.get(k), (int, float)) and not isinstance(node.get(k), bool) and abs(node[k]) >= WIDE_NUMBER for k in _BOUNDS):
        return True
      stack.extend(node.values())
    elif isinstance(node, list):
      stack.extend(node)
  return False


def lark_string(text: str) -> str:
  """A Lark string literal matching `text` exactly."""
  return json.dumps(text)


def regex_literal(text: str) -> str:
  """`text` inside a Lark /regex/, matching it exactly."""
  return "".join("\\" + c if c in ".^$*+?()[]{}|\\/" else c for c in text)


def marker(tokenizer, text: str) -> str:
  """A marker the model writes (`<tool_call>`, `</think>`, `[TOOL_CALLS]`) in a grammar: the token by its id
  (`<[id]>`) where the model has it as a token the grammar engine holds special (every added token: Qwen's `<tool_call>` and `<think>` too, which
  text never matches), else the literal text."""
  backend = getattr(tokenizer, "backend", None)
  token = backend.token_to_id(text) if backend is not None else None
  return f"<[{token}]>" if token is not None and vocabulary(tokenizer).is_special_token(token) else lark_string(text)


def check(grammar: str) -> None:
  """GrammarError if the grammar does not compile (checked without a vocabulary)."""
  _require()
  if len(grammar) > MAX_GRAMMAR_CHARS:
    raise GrammarError(f"the grammar is {len(grammar):,} characters; at most {MAX_GRAMMAR_CHARS:,}")
  matchers = _llguidance().LLMatcher
  error = matchers.validate_grammar(matchers.grammar_from_lark(grammar), None)
  if error:
    raise GrammarError(_first_lines(error))


def _first_lines(error: str, lines: int = 1) -> str:
  """llguidance's message without the grammar listing it appends (and without the grammar's own line:column)."""
  text = "\n".join(error.strip().splitlines()[:lines])
  return re.sub(r"^at \d+\(\d+\): ", "", text)[:600]


# --- the vocabulary, once per tokenizer ---

_vocabularies: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_vocabulary_lock = threading.Lock()


def vocabulary(tokenizer) -> "llguidance.LLTokenizer":
  """llguidance's view of a model's tokenizer (exo/inference/tokenizers.py's Tokenizer), built once (~0.5 s)."""
  _require()
  with _vocabulary_lock:
    built = _vocabularies.get(tokenizer)
    if built is None:
      backend = getattr(tokenizer, "backend", None)
      if backend is None or not hasattr(backend, "to_str"):
        raise CannotConstrain(f"this model's tokenizer ({type(tokenizer).__name__}) has no vocabulary the grammar engine can read")
      eos = sorted(getattr(tokenizer, "eos_token_ids", None) or {tokenizer.eos_token_id})
      built = _vocabularies[tokenizer] = _llguidance().LLTokenizer(backend.to_str(), eos_token=eos)
    return built


_tables: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def vocabulary_tables(tokenizer) -> Tuple[NumberBounds, ClosingTokens]:
  """A model's vocabulary as the number bounds (exo/inference/json_numbers.py) and the closing of answers within
  their budget (exo/inference/closing.py) read it, built once per tokenizer."""
  vocab = vocabulary(tokenizer)
  with _vocabulary_lock:
    built = _tables.get(tokenizer)
    if built is None:
      # Bytes read as Latin-1: one character per byte, and the characters either looks for are ASCII.
      special = [i for i in range(vocab.vocab_size) if vocab.is_special_token(i)]
      texts = [vocab.decode_bytes([i]).decode("latin-1") for i in range(vocab.vocab_size)]
      closers = list(texts)  # a special token that closes (a reasoning model's </think>) keeps its text there
      for i in special:
        texts[i] = ""
        closers[i] = closers[i] if closers[i] in CLOSING_MARKERS else ""
      restarts = [i for i in special if closers[i]]
      built = _tables[tokenizer] = (NumberBounds(texts, restarts), ClosingTokens(closers))
    return built


# --- compiled grammars, cached ---

_compiled: "OrderedDict[Tuple[int, str], Tuple[Any, Any]]" = OrderedDict()  # (id(vocabulary), grammar) -> (vocabulary, matcher)
_compiled_lock = threading.Lock()


def compile_matcher(tokenizer, grammar: str):
  """A fresh matcher for `grammar` on `tokenizer`'s vocabulary (a copy of the cached compiled one)."""
  vocab = vocabulary(tokenizer)
  key = (id(vocab), grammar)
  with _compiled_lock:
    entry = _compiled.get(key)
    if entry is not None:
      _compiled.move_to_end(key)
  if entry is None:
    if len(grammar) > MAX_GRAMMAR_CHARS:
      raise GrammarError(f"the grammar is {len(grammar):,} characters; at most {MAX_GRAMMAR_CHARS:,}")
    matchers = _llguidance().LLMatcher
    matcher = matchers(vocab, matchers.grammar_from_lark(grammar), log_level=LOG_LEVEL)
    if matcher.is_error():
      raise GrammarError(_first_lines(matcher.get_error()))
    entry = (vocab, matcher)
    with _compiled_lock:
      _compiled[key] = entry
      while len(_compiled) > COMPILED_KEPT:
        _compiled.popitem(last=False)
  return entry[1].deep_copy()


_pool: Optional[ThreadPoolExecutor] = None
_executor = None  # llguidance's parallel mask computer


def _grammar_pool() -> ThreadPoolExecutor:
  global _pool
  if _pool is None:
    _pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="exo-grammar")
  return _pool


async def in_grammar_thread(fn, *args):
  """Run fn(*args) on the grammar threads (neither the event loop nor the engine's thread)."""
  return await asyncio.get_running_loop().run_in_executor(_grammar_pool(), fn, *args)


# --- one request's matcher ---

class Constraint:
  """One request's grammar on the node that samples it: compiled once (`prepare`), then advanced by each sampled
  token. `finished` once the grammar admits nothing more: the request ends there. With `bounded_numbers`, the JSON
  numbers it writes keep within exo/inference/json_numbers.py's bounds (`limit` applies them to its masks)."""

  def __init__(self, grammar: str, bounded_numbers: bool = True):
    self.grammar = grammar
    self.matcher = None
    self.vocab_size = 0
    self.lexer: Optional[NumberBounds] = None  # follows where the answer stands in its JSON (json_numbers.py)
    self.lexer_state = START
    self.bounded_numbers = bounded_numbers
    self.closing: Optional[ClosingTokens] = None
    self.budget = Budget()
    self._preparing: Optional[asyncio.Future] = None

  def prepare(self, tokenizer) -> asyncio.Future:
    """Start compiling on the grammar threads (once); the future fails with GrammarError or CannotConstrain."""
    if self._preparing is None:
      async def compile_it():
        self.matcher = await in_grammar_thread(compile_matcher, tokenizer, self.grammar)
        self.vocab_size = vocabulary(tokenizer).vocab_size
        self.lexer, self.closing = await in_grammar_thread(vocabulary_tables, tokenizer)
      self._preparing = asyncio.ensure_future(compile_it())
      self._preparing.add_done_callback(lambda f: f.cancelled() or f.exception())  # its error is raised where it is awaited
    return self._preparing

  @property
  def ready(self) -> bool:
    return self.matcher is not None

  @property
  def finished(self) -> bool:
    return self.matcher is not None and self.matcher.is_stopped() and not self.matcher.is_error()

  def advance(self, token: int) -> None:
    if not self.matcher.consume_token(int(token)):
      raise GrammarError(f"token {int(token)} does not follow the grammar: {_first_lines(self.matcher.get_error(), 1)}")
    if self.lexer is not None and 0 <= int(token) < len(self.lexer.texts):
      self.lexer_state = self.lexer.advance(self.lexer_state, int(token))

  def limit(self, mask: np.ndarray) -> np.ndarray:
    """`mask` (this constraint's row of allowed tokens, from the grammar) less the tokens that would take a JSON
    number past its bounds; the mask as it was if that would leave nothing (a schema's own bounds decide then)."""
    if self.lexer is None or not self.bounded_numbers:
      return mask
    banned = self.lexer.banned(self.lexer_state)
    if not len(banned):
      return mask
    limited = mask.copy()
    clear_bits(limited, banned)
    return limited if limited.any() else mask


def mask_words(vocab_size: int) -> int:
  return (vocab_size + 31) // 32


class MaskTimes:
  """How long mask computations took (the metrics and the bench read it)."""

  def __init__(self) -> None:
    self.seconds = 0.0
    self.batches = 0
    self.rows = 0

  def record(self, seconds: float, rows: int) -> None:
    self.seconds += seconds
    self.batches += 1
    self.rows += rows


def compute_masks(constraints: Sequence[Constraint], times: Optional[MaskTimes] = None) -> np.ndarray:
  """Each constraint's allowed next tokens as a bitmask row (int32 words; bit i of word w is token 32 w + i), all
  rows in one parallel call, each `limit`ed. Every constraint must be ready and on one model's vocabulary. Call on the grammar
  threads."""
  global _executor
  start = time.perf_counter()
  masks = np.zeros((len(constraints), mask_words(constraints[0].vocab_size)), dtype=np.int32)
  if _executor is None:
    _executor = _llguidance().LLExecutor(GRAMMAR_THREADS)
  _executor.unsafe_compute_mask_ptr([(c.matcher, i) for i, c in enumerate(constraints)], masks.ctypes.data, masks.shape[1] * 4, len(constraints))
  for i, c in enumerate(constraints):
    masks[i] = c.limit(masks[i])
  if times is not None:
    times.record(time.perf_counter() - start, len(constraints))
  return masks
