"""Every setting of the `exo` command in one table: its flag, its environment variable, its type, its default and what
it does. The argument parser (exo/main.py), every read of the environment and the README's "Configuration" table all
come from it (`python -m exo.settings` prints that table). Where a setting has both, the flag wins; each part that
uses a setting checks its value and names the flag or variable it came by in its error.

Kept free of imports from the rest of exo: exo/helpers.py reads DEBUG from here while everything else is loading."""
import argparse
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple


@dataclass(frozen=True)
class Setting:
  name: str  # the attribute the parsed arguments hold it in (flag settings), else the variable's name
  flag: Optional[str]
  env: Optional[str]
  type: Any  # what argparse turns the flag into (None for a switch); the environment's value is a string, checked where it is used
  default: Any  # what argparse gives when the flag is absent; None for a setting with a variable (the part that uses it knows its default)
  help: str
  shown_default: str = ""  # the default as the README and --help state it, where `default` does not say it
  options: Dict[str, Any] = field(default_factory=dict)  # argparse's other keywords (choices, action)


def _s(flag: Optional[str], env: Optional[str], type: Any, default: Any, help: str, shown: str = "", **options) -> Setting:
  name = flag.lstrip("-").replace("-", "_") if flag else env
  return Setting(name, flag, env, type, default, help, shown, options)


SETTINGS: Tuple[Setting, ...] = (
  # The model and the engine
  _s("--inference-engine", None, str, None, "`numpy`, `tinygrad`, `mlx` or `dummy`", "`mlx` on Apple silicon, else `numpy`"),
  _s("--default-model", None, str, None, "the API's model when a request names none (an id or a checkpoint's path)", "`smollm2-135m`"),
  _s("--models-dir", None, str, [], "serve local checkpoints under this directory, named by absolute path in the API's `model` and by ring peers "
     "(repeatable; see \"Checkpoints\")", "none", action="append"),
  _s("--ollama-models", "OLLAMA_MODELS", str, None, "an Ollama model store (Ollama's own variable): its models are served under Ollama's "
     "names (`llama3.2:1b`), read in place (`off`: none); see \"Checkpoints\"", "`~/.ollama/models` where it exists"),
  _s("--run-model", None, str, None, "the same as `exo run MODEL`"),
  _s("--max-generate-tokens", None, int, 10000, "cap on tokens per request"),
  _s("--default-temp", None, float, 0.0, "temperature when a request gives none"),
  _s("--quantize", "EXO_QUANTIZE", str, None, "`8` or `4`: a float checkpoint's weights are quantized as they load, kept at that many bits "
     "(numpy and MLX engines; `0` = off); see \"Checkpoints\"", "off"),
  _s("--max-loaded-models", "EXO_MAX_LOADED_MODELS", int, None, "chat models a node holds loaded at once, while its memory (`--memory-mb`) "
     "allows; 1 = one at a time; see \"Several models\"", "3"),
  _s("--system-prompt", None, str, None, "a system message for chat requests that bring none", "none"),
  _s("--prompt", None, str, None, "`exo run`'s prompt; repeat to run several concurrently", "\"Who are you?\"", action="append"),
  _s("--prompts-file", None, str, None, "`exo run`: one prompt a line, run concurrently", "none"),
  # The HTTP API
  _s("--chatgpt-api-port", None, int, 52415, "the port the HTTP API listens on"),
  _s("--chatgpt-api-host", None, str, "0.0.0.0", "the address the HTTP API listens on (127.0.0.1: this machine only)", "`0.0.0.0`"),
  _s("--chatgpt-api-response-timeout", None, int, 900, "longest wait (s) for a request's next token"),
  _s("--max-concurrent-requests", "EXO_MAX_CONCURRENT_REQUESTS", int, None, "requests (choices) served at once", "256"),
  _s("--max-queued-requests", "EXO_MAX_QUEUED_REQUESTS", int, None, "more that may wait; beyond them, 429", "1024"),
  _s("--kv-budget-mb", "EXO_KV_BUDGET_MB", float, None, "KV cache the running requests may claim", "half the memory free at start"),
  _s("--max-request-body-mb", "EXO_MAX_REQUEST_BODY_MB", float, None, "largest request body", "8"),
  _s("--allowed-origins", "EXO_ALLOWED_ORIGINS", str, None, "comma-separated web origins, besides the node's own, whose pages may use the API "
     "(`*` for any)", "none"),
  _s("--api-key", "EXO_API_KEY", str, None, "require `Authorization: Bearer <key>`", "off"),
  _s(None, "EXO_KEEP_ALIVE", str, None, "how long an idle model (chat or embedding) stays loaded: seconds or a duration such as `5m` (negative: "
     "always); a request's Ollama `keep_alive` sets its model's", "5m"),
  # Batching and the prefix cache
  _s("--batch-size", "EXO_BATCH_SIZE", int, None, "most requests in one step or sampling call (1 = off); see \"Batching\"", "off"),
  _s("--batch-timeout-ms", "EXO_BATCH_TIMEOUT_MS", float, None, "longest a request waits for others to join its batch; see \"Batching\"", "5"),
  _s("--prefill-chunk", "EXO_PREFILL_CHUNK", int, None, "prompt tokens one batched step takes while other streams run (0 = whole prompts); "
     "see \"Batching\"", "24"),
  _s("--prefix-cache-mb", "EXO_PREFIX_CACHE_MB", float, None, "KV memory kept for ended requests' prompts, so later prompts that start the same "
     "way skip them (0 = off); see \"Batching\"", "1024"),
  _s("--no-prefix-cache", "EXO_PREFIX_CACHE", None, False, "never reuse prompt prefixes (the variable: 0 or 1, off or on)", "on",
     action="store_true"),
  # Placement
  _s("--placement", "EXO_PLACEMENT", str, None, "how a model's layers are spread over the nodes: `auto` (a whole copy on each group of the fewest "
     "nodes that hold one), `pipeline` (one ring over every node), `replicas` (a whole copy on every node); see \"Placement and routing\"", "`auto`",
     choices=["auto", "pipeline", "replicas"]),
  _s("--memory-mb", "EXO_MEMORY_MB", int, None, "memory (MiB) this node offers the cluster; see \"Placement and routing\"", "the machine's"),
  # The node and its ring
  _s("--node-id", None, str, None, "this node's id", "one kept in `$EXO_HOME`"),
  _s("--node-host", None, str, "0.0.0.0", "the address its gRPC server listens on", "`0.0.0.0`"),
  _s("--node-port", None, int, None, "the port its gRPC server listens on", "a free one"),
  _s("--wait-for-peers", None, int, 0, "peers to wait for before starting"),
  _s("--discovery-module", None, str, None, "how nodes find each other: `udp`, `tailscale` or `manual`", "`udp` (`exo run` alone: none)",
     choices=["udp", "tailscale", "manual"]),
  _s("--discovery-timeout", None, int, 30, "seconds after which a silent peer is dropped"),
  _s("--discovery-config-path", None, str, None, "manual discovery's JSON file of nodes", "none"),
  _s("--listen-port", None, int, 5678, "UDP discovery: the port it listens on"),
  _s("--broadcast-port", None, int, 5678, "UDP discovery: the port it announces to"),
  _s("--interface-type-filter", None, str, None, "UDP discovery: comma-separated interface types a peer may be found over", "all"),
  _s("--node-id-filter", None, str, None, "comma-separated node ids to accept as peers", "all"),
  _s("--tailscale-api-key", None, str, None, "Tailscale discovery: the API key", "none"),
  _s("--tailnet-name", None, str, None, "Tailscale discovery: the tailnet", "none"),
  # Downloads
  _s(None, "EXO_HOME", str, None, "where downloaded models live", "`~/.cache/exo`"),
  _s("--models-seed-dir", None, str, None, "(upstream's; not used by this build)", "none"),
  _s("--download-quick-check", None, None, False, "(upstream's; not used by this build)", action="store_true"),
  _s("--max-parallel-downloads", None, int, 8, "files downloaded at once"),
  _s(None, "EXO_PEER_UPLOAD_BYTES_PER_S", str, None, "the most a node sends one peer's transfer per second", "unset: as fast as the link goes"),
  # Engines, the terminal, diagnostics
  _s(None, "EXO_KV_BITS", int, 32, "the numpy engine's KV cache: `32` (float32) or `16` (float16: half the memory; decode about 0.8-0.85x as "
     "fast, and a prompt's reused prefix may round otherwise than a fresh computation, so a seeded sample can differ)", "`32`"),
  _s(None, "EXO_RUN_AHEAD", int, 1, "a node holding a model's every layer starts a decoding request's next step as soon as its token is sampled, "
     "while the token goes to its client (`0`: after)", "`1`"),
  _s(None, "EXO_TINYGRAD_DTYPE", str, None, "the tinygrad engine's precision: `float16` or `float32`", "float32 on CPUs, float16 on GPUs"),
  _s(None, "EXO_MLX_OPENBLAS", str, "1", "the MLX engine on Linux preloads OpenBLAS (`0`: not; or a library's path)", "`1`"),
  _s(None, "OPENBLAS_NUM_THREADS", str, None, "the numpy engine's OpenBLAS threads", "1"),
  _s(None, "CC", str, None, "the C compiler that builds the numpy engine's kernels at first use (kept in `$EXO_HOME/kernels`, else a private folder in the temporary directory; none "
     "working: numpy's slower forms)", "the first of `cc`, `gcc`, `clang`"),
  _s(None, "GOMP_SPINCOUNT", str, "10000", "how long the OpenMP threads quantized decode products share wait spinning for the next product before they sleep", "10000"),
  _s("--disable-tui", None, None, None, "no terminal view of the ring", "shown (`exo run`: none)", action=argparse.BooleanOptionalAction),
  _s(None, "DEBUG", int, 0, "log verbosity (0-9): 1 info on what the node does, 2 and more every detail (`DEBUG=2` logs every sampled token)"),
  _s(None, "DEBUG_DISCOVERY", int, 0, "discovery's log verbosity (0-9)"),
  _s(None, "TINYGRAD_DEBUG", int, 0, "tinygrad's own DEBUG"),
)

BY_NAME = {s.name: s for s in SETTINGS}
BY_ENV = {s.env: s for s in SETTINGS if s.env}


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """A flag for each setting that has one."""
  for s in SETTINGS:
    if s.flag is None:
      continue
    help = s.help + (f" (overrides {s.env})" if s.env else "") + (f"; default {s.shown_default}" if s.shown_default else "")
    kwargs = dict(default=s.default, help=help.replace("%", "%%"), **s.options)
    if s.type is not None:
      kwargs["type"] = s.type
    parser.add_argument(s.flag, **kwargs)


def env(name: str, default: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
  """The environment variable's value (`default` when unset); only the table's variables are read."""
  return (os.environ if environ is None else environ).get(BY_ENV[name].env, default)


def env_int(name: str) -> int:
  """A whole-number variable, its table default when unset or not a number."""
  try:
    return int(env(name) or BY_ENV[name].default)
  except ValueError:
    return BY_ENV[name].default


def given(args, environ: Mapping[str, str], name: str) -> Tuple[Any, str]:
  """(the setting's value as given, or None; the flag or variable it came by): the flag's when the parsed arguments hold
  one, else the variable's when it is set to more than blanks. With neither, (None, the variable's name)."""
  s = BY_NAME[name]
  if s.flag is not None:
    value = getattr(args, s.name, None)
    if value is not None:
      return value, s.flag
  value = environ.get(s.env) if s.env else None
  return (value, s.env) if value is not None and str(value).strip() else (None, s.env or s.flag)



def number(args, environ: Mapping[str, str], name: str, low: float, high: float, what: str, integer: bool = True) -> Tuple[Optional[float], str]:
  """(the setting's value as given, or None; the flag or variable it came by), checked: a finite number from `low` to
  `high` (a whole one where `integer`), else ValueError in one line: "<flag or variable> must be <what>, got <value>"."""
  raw, source = given(args, environ, name)
  if raw is None:
    return None, source
  try:
    value = float(str(raw).strip())
  except ValueError:
    value = math.nan
  if not (math.isfinite(value) and low <= value <= high and (value.is_integer() or not integer)):
    raise ValueError(f"{source} must be {what}, got {raw!r}")
  return (int(value) if integer else value), source

def markdown_table() -> str:
  """The README's "Configuration" table."""
  def cell(text: Optional[str]) -> str:
    return f"`{text}`" if text else ""
  rows = ["| variable | flag | default | meaning |", "|---|---|---|---|"]
  for s in SETTINGS:
    default = s.shown_default or (f"{s.default:g}" if isinstance(s.default, (int, float)) and not isinstance(s.default, bool) else "")
    rows.append(f"| {cell(s.env)} | {cell(s.flag)} | {default} | {s.help} |")
  return "\n".join(rows)


if __name__ == "__main__":
  sys.stdout.write(markdown_table() + "\n")
