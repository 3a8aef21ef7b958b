"""Prometheus metrics with vLLM's names under a `jetserve:` prefix, and GetStats percentiles.

Per-request latencies are measured here, where the client's stream is written, so they include
queueing and the event loop. Engine state (queue, KV usage, speculative counters) is read from
`engine.stats()` at scrape time instead of being copied into gauges on every step.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# vLLM's buckets, so dashboards built for it read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# GetStats percentiles cover this many recent samples.
WINDOW = 2048


class Metrics:
    """One server's metrics, in its own registry (several servers may share a test process)."""

    def __init__(self, engine_stats: Callable[[], object | None]):
        self.registry = CollectorRegistry()
        reg = self.registry
        self.ttft = Histogram("jetserve:time_to_first_token_seconds",
                              "Time from request arrival to its first token.",
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("jetserve:inter_token_latency_seconds",
                             "Time between tokens of one stream (a multi-token step counts per token).",
                             buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("jetserve:e2e_request_latency_seconds",
                             "Time from request arrival to its last token.",
                             buckets=E2E_BUCKETS, registry=reg)
        self.prompt_tokens = Counter("jetserve:prompt_tokens", "Prefilled prompt tokens.", registry=reg)
        self.generation_tokens = Counter("jetserve:generation_tokens", "Generated tokens.", registry=reg)
        self.request_success = Counter("jetserve:request_success", "Finished streams by finish reason.",
                                       ["finished_reason"], registry=reg)
        reg.register(_EngineCollector(engine_stats))
        self.recent_ttft: deque[float] = deque(maxlen=WINDOW)
        self.recent_itl: deque[float] = deque(maxlen=WINDOW)

    def request(self) -> "RequestTimer":
        return RequestTimer(self)

    def serve_http(self, host: str, port: int):
        """Start the scrape endpoint in a thread; returns the HTTP server (its port, its shutdown)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server


class RequestTimer:
    """Timestamps of one stream: feeds the histograms and the final Timing message."""

    def __init__(self, metrics: Metrics):
        self._m = metrics
        self.start = time.monotonic()
        self.first: float | None = None
        self._last = self.start
        self.completion_tokens = 0

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self._m.ttft.observe(now - self.start)
            self._m.recent_ttft.append(now - self.start)
        else:
            gap = (now - self._last) / n  # a multi-token (speculative) step spreads over its tokens
            for _ in range(n):
                self._m.itl.observe(gap)
                self._m.recent_itl.append(gap)
        self._last = now
        self.completion_tokens += n
        self._m.generation_tokens.inc(n)

    def finished(self, prompt_tokens: int, reason: str) -> tuple[float, float]:
        """Record the end; returns (time to first token, total) in seconds."""
        total = time.monotonic() - self.start
        self._m.e2e.observe(total)
        self._m.prompt_tokens.inc(prompt_tokens)
        self._m.request_success.labels(reason).inc()
        return (self.first - self.start if self.first is not None else total), total


def percentiles(samples) -> tuple[float, float, float]:
    """p50, p90, p99 of the samples (nearest rank); zeros when there are none."""
    ordered = sorted(samples)
    if not ordered:
        return 0.0, 0.0, 0.0
    return tuple(ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.9, 0.99))


# (metric family, name under jetserve:, help, EngineStats field), read at scrape time.
_ENGINE_METRICS = (
    (GaugeMetricFamily, "num_requests_running", "Sequences in the running batch.", "num_running"),
    (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", "kv_usage"),
    (CounterMetricFamily, "num_preemptions", "Sequences preempted for lack of KV blocks.", "num_preemptions"),
    (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found there (KV reused).", "prefix_cache_hits"),
    (CounterMetricFamily, "spec_decode_num_drafts", "Speculative drafting steps.", "num_drafts"),
    (CounterMetricFamily, "spec_decode_num_draft_tokens", "Draft tokens proposed.", "num_draft_tokens"),
    (CounterMetricFamily, "spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens"),
)


class _EngineCollector(Collector):
    """Reads engine.stats() at scrape time; yields nothing while the model is still loading."""

    def __init__(self, engine_stats):
        self._engine_stats = engine_stats

    def collect(self):
        s = self._engine_stats()
        if s is None:
            return
        for family, name, help_text, field in _ENGINE_METRICS:
            yield family("jetserve:" + name, help_text, value=getattr(s, field))
        per_pos = CounterMetricFamily("jetserve:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.", labels=["position"])
        for position, count in enumerate(s.accepted_per_position):
            per_pos.add_metric([str(position)], count)
        yield per_pos
