"""Prometheus metrics of one API node, served as text at /metrics. Each API has its own registry, so several nodes
in one process (tests) keep their own counts. Engine-side figures (requests per engine step, KV cache bytes) are
read from the node when scraped."""
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
BATCH_BUCKETS = tuple(2**i for i in range(13))  # 1 .. 4096, the largest batch size


class EngineCollector:
  """exo_batch_size from the batching plugin's per-step tallies, exo_kv_cache_bytes from the engine."""

  def __init__(self, node):
    self.node = node

  def describe(self):
    return []

  def collect(self):
    sizes = Tally()
    plugin = self.node.plugins.get_plugin("exo-batching")
    for scheduler in list(getattr(plugin, "schedulers", {}).values()):
      sizes.update(scheduler.stats.sizes)
    buckets = [(str(b), sum(n for size, n in sizes.items() if size <= b)) for b in BATCH_BUCKETS] + [("+Inf", sum(sizes.values()))]
    family = HistogramMetricFamily("exo_batch_size", "Requests per engine step (batching on)")
    family.add_metric([], buckets, sum(size * n for size, n in sizes.items()))
    yield family
    kv_cache_bytes = getattr(self.node.inference_engine, "kv_cache_bytes", None)
    if kv_cache_bytes is not None:
      yield GaugeMetricFamily("exo_kv_cache_bytes", "KV cache this node's engine holds for live requests", value=kv_cache_bytes())


class ApiMetrics:
  def __init__(self, node, admission):
    self.registry = CollectorRegistry()
    r = self.registry
    Gauge("exo_requests_running", "Requests this API node is serving", registry=r).set_function(lambda: admission.running)
    Gauge("exo_requests_waiting", "Requests accepted and waiting for a place", registry=r).set_function(lambda: admission.waiting)
    self.rejected = Counter("exo_requests_rejected", "Requests refused because every place was taken (429)", registry=r)
    self.prompt_tokens = Counter("exo_prompt_tokens", "Prompt tokens of the requests served", registry=r)
    self.generation_tokens = Counter("exo_generation_tokens", "Tokens generated", registry=r)
    self.ttft = Histogram("exo_time_to_first_token_seconds", "From a request's arrival to its first token", buckets=TTFT_BUCKETS, registry=r)
    self.itl = Histogram("exo_inter_token_latency_seconds", "Between one request's successive tokens", buckets=ITL_BUCKETS, registry=r)
    self.errors = Counter("exo_errors", "Error replies, by kind (the error's code, else its type)", ["kind"], registry=r)
    r.register(EngineCollector(node))

  def render(self) -> bytes:
    return generate_latest(self.registry)
