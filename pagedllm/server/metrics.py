"""Prometheus metrics for /metrics, named like vLLM's `vllm:*` ones with a `pagedllm:` prefix.

Engine state (queue lengths, KV-cache usage, prefix-cache hit rate, token counters,
batch sizes) is read from the engine at scrape time by a custom collector, so the
engine needs no Prometheus code and the numbers cannot drift from `engine.stats`.
Latency histograms are observed by the server as outputs reach it, which is what a
client experiences. Each app has its own registry, so several apps (tests) can share
a process.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedllm.core.engine import AsyncLLMEngine
from pagedllm.core.request import RequestOutput

PREFIX = "pagedllm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds), trimmed at the top.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
FINISHED_REASONS = ("stop", "length", "abort")  # exported at 0 from the start, as vLLM does


class _EngineCollector(Collector):
    """Reads the engine's counters and gauges when Prometheus scrapes."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        """One series per engine (label `engine`: the data-parallel replica, "0" alone), as vLLM."""
        engines = getattr(self.engine, "engines", None) or [self.engine.engine]
        labels = ["model_name", "engine"]
        families: dict[str, Any] = {}

        def add(kind: type, name: str, doc: str, index: int, value: float, extra: dict[str, str] | None = None) -> None:
            key = PREFIX + name
            if key not in families:
                families[key] = kind(key, doc, labels=labels + list(extra or {}))
            families[key].add_metric([self.model_name, str(index), *(extra or {}).values()], value)

        for i, core in enumerate(engines):
            stats = core.stats
            add(GaugeMetricFamily, "num_requests_running", "Sequences in the running batch.", i, core.num_running)
            add(GaugeMetricFamily, "num_requests_waiting", "Sequences waiting to be scheduled.", i, core.num_waiting)
            add(GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", i,
                core.block_manager.usage)
            add(GaugeMetricFamily, "prefix_cache_hit_rate",
                "Fraction of queried prompt tokens found in the prefix cache.", i, core.block_manager.prefix_hit_rate)
            add(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", i,
                core.block_manager.num_query_tokens)
            add(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", i,
                core.block_manager.num_hit_tokens)
            add(GaugeMetricFamily, "max_num_seqs_per_step", "Most sequences batched in one engine step so far.", i,
                stats.max_seqs_in_step)
            recent = stats.seqs_per_step[-100:]
            add(GaugeMetricFamily, "avg_num_seqs_per_step", "Mean sequences per step over the last 100 steps.", i,
                sum(recent) / len(recent) if recent else 0.0)
            add(CounterMetricFamily, "prompt_tokens", "Prompt tokens received (per sequence).", i,
                stats.num_prompt_tokens)
            add(CounterMetricFamily, "generation_tokens", "Tokens generated.", i, stats.num_generation_tokens)
            add(CounterMetricFamily, "engine_steps", "Engine steps run.", i, stats.num_steps)
            if core.spec_config is not None:
                spec = core.scheduler.spec_stats
                add(CounterMetricFamily, "spec_decode_num_drafts", "Proposals verified (one per request per step).",
                    i, spec.num_drafts)
                add(CounterMetricFamily, "spec_decode_num_draft_tokens", "Draft tokens verified.", i,
                    spec.num_draft_tokens)
                add(CounterMetricFamily, "spec_decode_num_accepted_tokens", "Draft tokens accepted.", i,
                    spec.num_accepted_tokens)
                for position, count in enumerate(spec.accepted_per_position):
                    add(CounterMetricFamily, "spec_decode_num_accepted_tokens_per_pos",
                        "Draft tokens accepted at each draft position.", i, count, {"position": str(position)})
        yield from families.values()


class ServerMetrics:
    """The app's metric registry and the latency histograms handlers observe.

    Args:
        engine: the engine whose state the gauges and counters report.
        model_name: the `model_name` label (the served model name).
    """

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.model_name = model_name
        self._ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to the first generated token.",
                               ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry)
        self._itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between generated tokens.",
                              ["model_name"], buckets=ITL_BUCKETS, registry=self.registry)
        self._e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
                              ["model_name"], buckets=E2E_BUCKETS, registry=self.registry)
        self._success = Counter(PREFIX + "request_success", "Finished sequences by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        for reason in FINISHED_REASONS:
            self._success.labels(model_name, reason)
        self.ttft = self._ttft.labels(model_name)
        self.itl = self._itl.labels(model_name)
        self.e2e = self._e2e.labels(model_name)

    def finished(self, reason: str, count: int = 1) -> None:
        self._success.labels(self.model_name, reason).inc(count)

    def finishes(self, n: int) -> FinishTracker:
        """The finish bookkeeping of one engine request of `n` sequences (see `FinishTracker`)."""
        return FinishTracker(self, n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class FinishTracker:
    """How each sequence of one engine request ended, for `request_success`.

    An aborted sequence never reports a finish reason: the engine aborts a request when
    its stream is closed (client gone, server error), and nobody reads the stream after
    that. So `close`, called however the stream ended, counts each sequence that did not
    finish as "abort"; without it that label would never count.

    Args:
        metrics: the app's metrics.
        n: the request's number of sequences (`SamplingParams.n`).
    """

    def __init__(self, metrics: ServerMetrics, n: int) -> None:
        self.metrics = metrics
        self.n = n
        self.finished: set[int] = set()  # indexes of the sequences counted so far
        self.closed = False

    def observe(self, out: RequestOutput) -> None:
        """Count the finish reasons of the sequences that `out` shows finished for the first time."""
        for c in out.outputs:
            if c.finish_reason is not None and c.index not in self.finished:
                self.finished.add(c.index)
                self.metrics.finished(c.finish_reason)

    def close(self) -> None:
        """The stream has ended: its sequences that never finished were aborted."""
        if not self.closed:
            self.closed = True
            if self.n > len(self.finished):
                self.metrics.finished("abort", self.n - len(self.finished))
