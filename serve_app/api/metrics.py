"""Prometheus metrics of an Engine replica, which serves HTTP itself.

Two routes out, because a Serve app has many processes:
- `ServerMetrics` (prometheus_client, a private registry) is what GET /metrics returns:
  requests by status, TTFT, inter-token and end-to-end latency, token counts,
  speculative accept lengths (as this replica saw them), the engine gauges (labelled by
  replica), and the engine's step counters: steps by mode and seconds per step phase,
  read at scrape time (benchmarks/http_bench.py turns them into a per-step breakdown),
  and the steps that ran eagerly while graphs are on, by reason.
- `EngineGauges` (ray.serve.metrics, tagged with deployment and replica by Serve) is set
  by each Engine replica and exported through Ray's own metrics endpoint on every node:
  the cluster-wide view when there are many replicas.
"""
from __future__ import annotations

import time
from typing import Any

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serve_app.api.token_histogram import TokenHistogram

# The `*_created` timestamp series double the output and no dashboard uses them.
disable_created_metrics()

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_ACCEPT_BUCKETS = tuple(float(i) for i in range(1, 17))
# Engine replicas not heard from for this long are dropped from the gauges (scaled down).
_STALE_AFTER_S = 120.0
# The parts of a rank's device memory exported (actors/worker/memory_profile.py, MemoryPlan).
MEMORY_PARTS = ("budget", "weights", "graphs", "graphs_estimate", "other", "kv_cache")


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model = model_name
        self.registry = r = CollectorRegistry(auto_describe=True)
        m = ["model"]
        self.requests = Counter("kestrel_requests", "Finished HTTP requests by endpoint and status",
                                m + ["endpoint", "status"], registry=r)
        self.finish_reasons = Counter("kestrel_request_finish", "Finished choices by reason",
                                      m + ["reason"], registry=r)
        self.ttft = Histogram("kestrel_time_to_first_token_seconds",
                              "Handler start (before the body is read) to the first generated token",
                              m, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = TokenHistogram("kestrel_inter_token_latency_seconds",
                                  "Time between generated tokens, as streamed", model_name,
                                  _LATENCY_BUCKETS)
        r.register(self.itl)
        self.e2e = Histogram("kestrel_e2e_request_latency_seconds", "Arrival to last token", m,
                             buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kestrel_prompt_tokens", "Prompt tokens of accepted requests",
                                     m, registry=r)
        self.generation_tokens = Counter("kestrel_generation_tokens", "Generated tokens", m,
                                         registry=r)
        self.accept_length = TokenHistogram("kestrel_spec_accept_length",
                                            "Tokens emitted per speculative decode step "
                                            "(accepted drafts + bonus)", model_name, _ACCEPT_BUCKETS)
        r.register(self.accept_length)
        self.running = Gauge("kestrel_num_requests_running", "Requests decoding or prefilling",
                             m + ["replica"], registry=r)
        self.waiting = Gauge("kestrel_num_requests_waiting", "Requests queued for admission",
                             m + ["replica"], registry=r)
        self.kv_usage = Gauge("kestrel_kv_cache_usage_ratio",
                              "Fraction of KV slots in use (prefix cache counted as free)",
                              m + ["replica", "rank"], registry=r)
        self.memory = Gauge("kestrel_device_memory_bytes",
                            "A rank's device memory by part, from its start-up profile: budget "
                            "(kv_cache.memory_utilization of the device), weights, graphs "
                            "(captured), graphs_estimate, other (tables, activations), kv_cache",
                            m + ["replica", "rank", "part"], registry=r)
        self._seen: dict[str, tuple[float, list[str]]] = {}  # replica -> (time, ranks)
        # The per-token series, resolved once: .labels() costs a lookup under a lock.
        self.ttft_m, self.e2e_m = (h.labels(model_name) for h in (self.ttft, self.e2e))
        self.generation_tokens_m = self.generation_tokens.labels(model_name)
        self._engine_stats: dict[str, Any] = {}
        r.register(_StepCollector(self))

    # ---- per request -----------------------------------------------------------------
    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(self.model, endpoint, str(status)).inc()

    def tracker(self, arrival: float) -> "RequestTracker":
        return RequestTracker(self, arrival)

    # ---- engine gauges ---------------------------------------------------------------
    def update_engine(self, stats: dict[str, Any]) -> None:
        """Record one Engine replica's `stats()`; forget replicas silent for too long."""
        now = time.monotonic()
        self._engine_stats = stats
        rep = str(stats.get("replica", "engine"))
        self.running.labels(self.model, rep).set(stats.get("running", 0))
        self.waiting.labels(self.model, rep).set(stats.get("waiting", 0))
        ranks = []
        for kv in stats.get("kv", []):
            cap = max(1, kv["capacity"])
            rank = str(kv["rank"])
            ranks.append(rank)
            self.kv_usage.labels(self.model, rep, rank).set(1.0 - kv["free"] / cap)
        for mem in stats.get("memory", []):
            for part in MEMORY_PARTS:
                if mem.get(part) is not None:
                    self.memory.labels(self.model, rep, str(mem["rank"]), part).set(mem[part])
        self._seen[rep] = (now, ranks)
        for old, (t, old_ranks) in list(self._seen.items()):
            if now - t > _STALE_AFTER_S:
                for g in (self.running, self.waiting):
                    g.remove(self.model, old)
                for rank in old_ranks:
                    self.kv_usage.remove(self.model, old, rank)
                    for part in MEMORY_PARTS:
                        self.memory.remove(self.model, old, rank, part)
                del self._seen[old]

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _StepCollector:
    """The engine core's step counters (EngineClient.stats) as Prometheus counters, at scrape."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        stats = self.m._engine_stats
        rep = str(stats.get("replica", "engine"))
        # (metric, help, label, the stats() entry whose label -> value it exports)
        families = (
            ("kestrel_engine_steps", "Engine steps by mode ('mixed': decode rows and prefill "
             "chunks in one forward; 'pipelined': sent while another step was in flight)", "mode",
             "steps"),
            ("kestrel_engine_step_seconds", "Seconds per step phase: schedule, process (engine "
             "loop); execute, recv, compile (rank worker); gc (the collector's passes, rank and "
             "engine loop); wait (the worker idle before a pipelined step), gpu_idle (the GPU "
             "idle before it, by the GPU's clock)", "phase", "step_seconds"),
            ("kestrel_engine_eager_steps", "Steps that left the captured graphs while graphs are "
             "on, by reason (actors/worker/eager_steps.py REASONS)", "reason", "eager_steps"),
            ("kestrel_engine_draft_shape_steps", "Speculative decode steps by the draft shape they "
             "ran at (topk, steps, nodes; draft.adaptive_shapes), and the plain steps a draft "
             "policy chose (draft.plain_steps)", "shape", "draft_shape_steps"),
        )
        for name, help_text, label, key in families:
            family = CounterMetricFamily(name, help_text, labels=["model", "replica", label])
            for value_label, v in (stats.get(key) or {}).items():
                family.add_metric([self.m.model, rep, value_label], v)
            yield family
        accept = GaugeMetricFamily(
            "kestrel_engine_draft_accept_estimate", "The accept length the draft policy expects "
            "of each draft shape it learns one for (draft.adaptive_shapes)",
            labels=["model", "replica", "rank", "shape"])
        for e in stats.get("draft_accept") or []:
            accept.add_metric([self.m.model, rep, str(e["rank"]), e["shape"]], e["value"])
        yield accept
        period = GaugeMetricFamily(
            "kestrel_engine_draft_step_period_seconds", "The step loop's measured seconds between "
            "the outputs of a draft shape's steps at a captured batch size, as the draft policy "
            "weighs them (draft.measured_periods)", labels=["model", "replica", "rank", "shape", "batch"])
        for e in stats.get("draft_period") or []:
            period.add_metric([self.m.model, rep, str(e["rank"]), e["shape"], str(e["batch"])], e["value"])
        yield period
        pause = GaugeMetricFamily(
            "kestrel_engine_prefill_period_seconds", "The step loop's measured seconds of a "
            "prefill step while requests decode: the pause that scheduler.prefill_by_cost "
            "weighs against the waits of new requests", labels=["model", "replica", "rank"])
        for e in stats.get("prefill_period") or []:
            pause.add_metric([self.m.model, rep, str(e["rank"])], e["value"])
        yield pause


class RequestTracker:
    """Timing of one generation (one choice) as the ingress streams it."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        """`arrival`: time.monotonic() when the handler began (before its body was read)."""
        self.m = metrics
        self.arrival = arrival
        self.last: float | None = None
        self.tokens = 0

    def on_tokens(self, n: int, accept_lengths: list[int] | None = None) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        m = self.m
        if self.last is None:
            m.ttft_m.observe(now - self.arrival)
            # Tokens that came together with the first one have no gap of their own.
            n_gaps, gap = n - 1, 0.0
        else:
            n_gaps, gap = n, (now - self.last) / n
        if n_gaps:
            m.itl.observe(gap, n_gaps)
        self.last = now
        self.tokens += n
        m.generation_tokens_m.inc(n)
        for a in accept_lengths or ():
            m.accept_length.observe(a)

    def finish(self, reason: str | None, prompt_tokens: int) -> None:
        model = self.m.model
        self.m.e2e_m.observe(time.monotonic() - self.arrival)
        self.m.prompt_tokens.labels(model).inc(prompt_tokens)
        self.m.finish_reasons.labels(model, reason or "unknown").inc()


class EngineGauges:
    """Engine-side gauges through Ray's metrics pipeline (Serve adds deployment/replica tags)."""

    def __init__(self, model_name: str):
        from ray.serve import metrics as sm
        tags = {"model": model_name}
        self.running = sm.Gauge("kestrel_engine_requests_running",
                                description="Requests decoding or prefilling in this replica",
                                tag_keys=("model",))
        self.waiting = sm.Gauge("kestrel_engine_requests_waiting",
                                description="Requests queued for admission in this replica",
                                tag_keys=("model",))
        self.kv_usage = sm.Gauge("kestrel_engine_kv_cache_usage_ratio",
                                 description="Fraction of KV slots in use per DP rank",
                                 tag_keys=("model", "rank"))
        for g in (self.running, self.waiting, self.kv_usage):
            g.set_default_tags(dict(tags))  # Serve adds its own tags into the dict given

    def update(self, stats: dict[str, Any]) -> None:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        for kv in stats["kv"]:
            self.kv_usage.set(1.0 - kv["free"] / max(1, kv["capacity"]), tags={"rank": str(kv["rank"])})
