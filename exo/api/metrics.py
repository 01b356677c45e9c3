"""Prometheus metrics of one API node, served as text at /metrics. Each API has its own registry, so several nodes
in one process (tests) keep their own counts. Engine-side figures (requests per engine step, KV cache bytes) are
read from the node when scraped."""
import time
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from exo.orchestration.routing.router import REASONS

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
BATCH_BUCKETS = tuple(2**i for i in range(13))  # 1 .. 4096, the largest batch size


class EngineCollector:
  """exo_batch_size from the step loop's per-step tallies, exo_kv_cache_bytes from the engine."""

  def __init__(self, node):
    self.node = node

  def describe(self):
    return []

  def collect(self):
    sizes = Tally()
    schedulers = list(self.node.steps.schedulers.values())
    for scheduler in schedulers:
      sizes.update(scheduler.stats.sizes)
    buckets = [(str(b), sum(n for size, n in sizes.items() if size <= b)) for b in BATCH_BUCKETS] + [("+Inf", sum(sizes.values()))]
    family = HistogramMetricFamily("exo_batch_size", "Requests per engine step")
    family.add_metric([], buckets, sum(size * n for size, n in sizes.items()))
    yield family
    yield from self._stages(schedulers)
    yield from self._routing()
    masks = self.node.step_core.mask_times  # grammar masks computed during steps (structured output), beside the forward passes
    yield CounterMetricFamily("exo_grammar_mask_seconds", "Seconds spent computing grammar masks for steps' constrained rows", value=masks.seconds)
    yield CounterMetricFamily("exo_grammar_mask_steps", "Steps whose constrained rows had their masks computed", value=masks.batches)
    yield CounterMetricFamily("exo_grammar_mask_rows", "Constrained rows whose masks were computed", value=masks.rows)
    kv_bytes = sum(engine.kv_cache_bytes() for engine in self.node.model_pool.all_engines())
    yield GaugeMetricFamily("exo_kv_cache_bytes", "KV cache this node's engines hold for live requests", value=kv_bytes)
    yield GaugeMetricFamily("exo_loaded_models", "Chat models this node holds loaded", value=len(self.node.model_pool.describe()))

  def _routing(self):
    """Where this node sent its requests: by reason, and each group's requests as this node knows them."""
    router = self.node.forwarding.router
    routed = CounterMetricFamily("exo_routed_requests", "Requests this node routed to a group, by why it chose that group", labels=["reason"])
    for reason in REASONS:
      routed.add_metric([reason], router.routed[reason])
    requests = GaugeMetricFamily("exo_group_requests", "Requests of each placement group, running or waiting for their first token", labels=["group", "state"])
    for group, counts in router.groups().items():
      for state, count in counts.items():
        requests.add_metric([group, state], count)
    yield from (routed, requests)

  def _stages(self, schedulers):
    """The pipeline's bubble as this node sees it: how busy each of its stages is, and on the node with the first
    layers the micro-batches in flight and the time a group spends on the links per hop."""
    busy_total = CounterMetricFamily("exo_stage_busy_seconds", "Seconds this stage's engine spent in steps", labels=["layers"])
    busy = GaugeMetricFamily("exo_stage_busy_fraction", "Share of the last 10 s this stage's engine spent in steps", labels=["layers"])
    groups = GaugeMetricFamily("exo_micro_batches", "Groups of requests travelling the ring one behind the other", labels=["layers"])
    hop = GaugeMetricFamily("exo_hop_latency_seconds", "Estimated time per hop between stages, beyond their steps", labels=["layers"])
    now = time.monotonic()
    for scheduler in schedulers:
      layers = f"{scheduler.shard.start_layer}-{scheduler.shard.end_layer}"
      busy_total.add_metric([layers], scheduler.times.busy_total_s)
      busy.add_metric([layers], scheduler.times.busy_fraction(now))
      if scheduler.shard.is_first_layer():
        groups.add_metric([layers], scheduler.groups)
        hops = scheduler.hop_estimate()
        if hops is not None:
          hop.add_metric([layers], hops / max(1, scheduler.stages))
    yield from (busy_total, busy, groups, hop)


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
