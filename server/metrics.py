"""Prometheus metrics with vLLM's names under a `jetserve_` prefix, and GetStats percentiles.

Names use underscores only: a colon is reserved for recording rules, and a scraper that
negotiates OpenMetrics would otherwise see names rewritten. Every series carries vLLM's
`model_name` label, which dashboards built for vLLM filter on.

Per-request latencies are measured where the client's stream is written, so they include
queueing and the event loop; the phases inside the engine (queue, prefill, decode, inference)
come from the engine's own timestamps. Engine state (queue, KV usage, speculative counters) is
read from `engine.stats()` at scrape time instead of being copied into gauges on every step.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from jetserve.engine.protocol import ITERATION_TOKENS_BUCKETS

PREFIX = "jetserve_"
LABELS = ("model_name",)
# vLLM's buckets, so dashboards built for it read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
# GetStats percentiles cover this many recent samples.
WINDOW = 2048


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, … up to `limit` (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return out
            out.append(mantissa * scale)
        scale *= 10


class Metrics:
    """One server's metrics, in its own registry (several servers may share a test process).

    The request metrics exist once the model is known (`bind`): their label is its name and the
    token-count buckets reach its max_model_len.
    """

    def __init__(self, engine: Callable[[], object | None]):
        self.registry = CollectorRegistry()
        self.model_name: str | None = None
        self._engine = engine
        self.registry.register(_EngineCollector(self))
        self.recent_ttft: deque[float] = deque(maxlen=WINDOW)
        self.recent_itl: deque[float] = deque(maxlen=WINDOW)

    def bind(self, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        reg, tokens = self.registry, buckets_1_2_5(max_model_len)

        def histogram(name, help_text, buckets):
            return Histogram(PREFIX + name, help_text, LABELS, buckets=buckets, registry=reg).labels(model_name)

        def counter(name, help_text):
            return Counter(PREFIX + name, help_text, LABELS, registry=reg).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time from request arrival to its first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between two engine steps that gave one stream tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from request arrival to its last token.",
                             REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time a request waited before it was first scheduled.", REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Time from first scheduled to first token.", REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Time from first token to last token.",
                                     REQUEST_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Time from first scheduled to last token.", REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of a finished request.",
                                               tokens)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens of a finished request.", tokens)
        self.request_max_tokens = histogram("request_params_max_tokens", "The max_tokens a request asked for.",
                                            tokens)
        self.request_n = histogram("request_params_n", "The n (completions) a request asked for.", N_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                       LABELS + ("finished_reason",), registry=reg)
        for reason in ("stop", "length", "abort"):  # present from the start, so rates start at zero
            self.request_success.labels(model_name, reason)

    def request(self, params) -> "RequestTimer":
        return RequestTimer(self, params)

    def serve_http(self, host: str, port: int):
        """Start the scrape endpoint in a thread; returns the HTTP server (its port, its shutdown)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server


class RequestTimer:
    """One request's stream: feeds the histograms as its deltas pass."""

    def __init__(self, metrics: Metrics, params):
        self._m = metrics
        self._params = params
        self.start = time.monotonic()
        self.first: float | None = None
        self._last = self.start
        self.completion_tokens = 0
        self.done = False

    def observe(self, out) -> None:
        """One delta (one engine step for this request); the last one finishes the request."""
        n = sum(len(o.token_ids) for o in out.outputs)
        if n:
            now = time.monotonic()
            if self.first is None:
                self.first = now
                self._m.ttft.observe(now - self.start)
                self._m.recent_ttft.append(now - self.start)
            else:  # per step, as vLLM: several tokens from one step (drafts) are one interval
                self._m.itl.observe(now - self._last)
                self._m.recent_itl.append(now - self._last)
            self._last = now
            self.completion_tokens += n
            self._m.generation_tokens.inc(n)
        if out.finished:
            self._finish(out)

    def _finish(self, out) -> None:
        m, self.done = self._m, True
        total = time.monotonic() - self.start
        prompt_tokens = len(out.prompt_token_ids)
        m.e2e.observe(total)
        m.prompt_tokens.inc(prompt_tokens)
        m.request_prompt_tokens.observe(prompt_tokens)
        m.request_generation_tokens.observe(self.completion_tokens)
        m.request_success.labels(m.model_name, out.outputs[0].finish_reason).inc()
        if self._params.max_tokens is not None:
            m.request_max_tokens.observe(self._params.max_tokens)
        m.request_n.observe(self._params.n)
        t = out.metrics
        scheduled = t.first_scheduled_time
        if scheduled is not None:  # engine phases, on the engine's clock
            m.queue_time.observe(scheduled - t.arrival_time)
            if t.first_token_time is not None:
                m.prefill_time.observe(t.first_token_time - scheduled)
                m.decode_time.observe(t.finished_time - t.first_token_time)
            m.inference_time.observe(t.finished_time - scheduled)

    def abandoned(self) -> None:
        """The client left (or the server cancelled the stream) before the end: an abort."""
        if not self.done:
            self.done = True
            self._m.request_success.labels(self._m.model_name, "abort").inc()


def percentiles(samples) -> tuple[float, float, float]:
    """p50, p90, p99 of the samples (nearest rank); zeros when there are none."""
    ordered = sorted(samples)
    if not ordered:
        return 0.0, 0.0, 0.0
    return tuple(ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.9, 0.99))


# (metric family, name after jetserve_, help, EngineStats field), read at scrape time.
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
    (GaugeMetricFamily, "spec_decode_draft_vocab_size", "Token ids the draft heads project onto (the engine's "
     "most emitted; 0: no drafting).", "draft_vocab_size"),
    (GaugeMetricFamily, "spec_decode_draft_vocab_coverage", "Share of recently emitted tokens inside the draft "
     "vocabulary (0..1): acceptance cannot pass it.", "draft_vocab_coverage"),
)


class _EngineCollector(Collector):
    """Reads engine.stats() at scrape time; yields nothing while the model is still loading."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def collect(self):
        engine, model = self._metrics._engine(), self._metrics.model_name
        if engine is None or model is None:
            return
        s = engine.stats()
        for family, name, help_text, field in _ENGINE_METRICS:
            metric = family(PREFIX + name, help_text, labels=LABELS)
            metric.add_metric([model], getattr(s, field))
            yield metric
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=LABELS + ("position",))
        for position, count in enumerate(s.accepted_per_position):
            per_pos.add_metric([model, str(position)], count)
        yield per_pos
        yield from _draft_policy(model, s)
        if s.iteration_tokens:  # an engine that counts its steps (the torch engine)
            yield _iteration_tokens(model, s.iteration_tokens, s.iteration_tokens_sum)


def _draft_policy(model: str, s) -> list[GaugeMetricFamily]:
    """The draft policy's view: the draft length it would choose per batch bucket, the step costs
    it chooses from, and its acceptance estimate per draft position (families without samples
    where nothing drafts adaptively, as the per-position counter's)."""
    length = GaugeMetricFamily(PREFIX + "spec_decode_draft_length", "Draft length the policy would choose now "
                               "for a step of this many sequences (0: off).", labels=LABELS + ("batch_size",))
    cost = GaugeMetricFamily(PREFIX + "spec_decode_step_cost_seconds", "Measured seconds of a decode step "
                             "drafting k tokens a sequence (k=0: plain).", labels=LABELS + ("batch_size", "k"))
    for b, k, costs in zip(s.draft_buckets, s.draft_lengths, s.draft_step_costs_s):
        length.add_metric([model, str(b)], k)
        for drafts, seconds in enumerate(costs):
            if seconds:
                cost.add_metric([model, str(b), str(drafts)], seconds)
    alpha = GaugeMetricFamily(PREFIX + "spec_decode_acceptance_estimate", "Chance a draft at this position is "
                              "accepted once those before it were (the policy's decayed estimate).",
                              labels=LABELS + ("position",))
    for position, a in enumerate(s.acceptance_estimates):
        alpha.add_metric([model, str(position)], a)
    return [length, cost, alpha]


def _iteration_tokens(model: str, counts: list[int], total: int) -> HistogramMetricFamily:
    """vLLM's iteration_tokens_total: the tokens each engine step computed, recorded by the engine
    per step (counts per bucket, cumulated here as Prometheus wants them). Named without vLLM's
    `_total`, which promtool refuses on a histogram (it marks counters)."""
    family = HistogramMetricFamily(PREFIX + "iteration_tokens", "Tokens computed per engine step.",
                                   labels=LABELS)
    bounds = [str(float(b)) for b in ITERATION_TOKENS_BUCKETS] + ["+Inf"]
    family.add_metric([model], list(zip(bounds, itertools.accumulate(counts))), total)
    return family
