"""Statistics the benchmarks report: percentiles and per-request serving latencies.

Pure functions over plain numbers, so the definitions (the ones `vllm bench serve`
uses) can be tested on synthetic timestamps without a model or a server:

- TTFT (time to first token): first streamed chunk minus the request's send time.
- ITL (inter-token latency): the gaps between consecutive streamed chunks.
- TPOT (time per output token): (end-to-end latency - TTFT) / (output tokens - 1),
  defined only for requests with more than one output token.
- E2EL: end-to-end latency of the request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

DEFAULT_PERCENTILES = (10, 25, 50, 75, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics.

    The same definition as numpy's default ("linear"), written out so the standalone
    runners and the statistics need no numpy. An empty input gives NaN rather than an
    exception: a benchmark where every request failed still prints its table.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    data = sorted(values)
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float:
    """Arithmetic mean; NaN for no values (see `percentile`)."""
    return sum(values) / len(values) if values else math.nan


def summarize(values: Sequence[float], percentiles: Iterable[float] = (50, 99)) -> dict[str, float]:
    """{"mean": .., "p50": .., "p99": ..} for one latency series, in the series' unit."""
    out = {"mean": mean(values)}
    for q in percentiles:
        out[f"p{q:g}"] = percentile(values, q)
    return out


@dataclass
class RequestTiming:
    """What the load generator saw of one streamed request (times in seconds, one clock).

    `chunk_times` holds the arrival time of every streamed chunk that carried text;
    `output_tokens` is the server's own count when it reported usage, else the number
    of chunks (servers stream one token per chunk, so this is the usual fallback).
    """

    start: float
    chunk_times: list[float] = field(default_factory=list)
    end: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    success: bool = False
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def latency(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1 or self.ttft is None or self.latency is None:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def serving_metrics(timings: Sequence[RequestTiming], duration: float,
                    percentiles: Iterable[float] = (50, 99)) -> dict[str, float | int]:
    """Aggregate a load test: throughputs over the wall-clock `duration` and latency
    summaries in milliseconds over the successful requests (failed ones only count)."""
    ok = [t for t in timings if t.success]
    qs = tuple(percentiles)
    out: dict[str, float | int] = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "total_input_tokens": sum(t.prompt_tokens for t in ok),
        "total_output_tokens": sum(t.output_tokens for t in ok),
    }
    out["request_throughput"] = len(ok) / duration if duration > 0 else math.nan
    out["output_throughput"] = out["total_output_tokens"] / duration if duration > 0 else math.nan
    out["total_token_throughput"] = ((out["total_input_tokens"] + out["total_output_tokens"]) / duration
                                     if duration > 0 else math.nan)
    series = {
        "ttft": [t.ttft for t in ok if t.ttft is not None],
        "tpot": [t.tpot for t in ok if t.tpot is not None],
        "itl": [gap for t in ok for gap in t.itls],
        "e2el": [t.latency for t in ok if t.latency is not None],
    }
    for name, values in series.items():
        for key, value in summarize([v * 1000.0 for v in values], qs).items():
            out[f"{key}_{name}_ms"] = value
    return out
