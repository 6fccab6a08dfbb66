"""The statistics helpers: percentiles and serving latencies from synthetic timestamps."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedllm.bench.stats import RequestTiming, percentile, serving_metrics, summarize


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0], list(range(100)), [0.5] * 7,
                                    [9.1, -2.0, 3.3, 3.3, 100.0, 0.0]])
@pytest.mark.parametrize("q", [0, 10, 25, 50, 75, 90, 99, 100])
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edge_cases() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="percentile"):
        percentile([1.0], 101)
    assert summarize([1.0, 2.0, 3.0, 4.0], (50, 99)) == pytest.approx({"mean": 2.5, "p50": 2.5, "p99": 3.97})


def test_request_timing_derives_ttft_itl_tpot() -> None:
    t = RequestTiming(start=10.0, chunk_times=[10.5, 10.6, 10.8, 11.1], end=11.2, output_tokens=4, success=True)
    assert t.ttft == pytest.approx(0.5)
    assert t.itls == pytest.approx([0.1, 0.2, 0.3])
    assert t.latency == pytest.approx(1.2)
    assert t.tpot == pytest.approx((1.2 - 0.5) / 3)
    single = RequestTiming(start=0.0, chunk_times=[0.2], end=0.3, output_tokens=1, success=True)
    assert single.tpot is None and single.itls == []
    assert RequestTiming(start=0.0).ttft is None


def test_serving_metrics_aggregates_successes_and_counts_failures() -> None:
    ok1 = RequestTiming(start=0.0, chunk_times=[0.1, 0.2, 0.3], end=0.3, output_tokens=3, prompt_tokens=5,
                        success=True)
    ok2 = RequestTiming(start=0.0, chunk_times=[0.3, 0.5], end=0.5, output_tokens=2, prompt_tokens=5,
                        success=True)
    bad = RequestTiming(start=0.0, error="HTTP 500", prompt_tokens=5)
    m = serving_metrics([ok1, ok2, bad], duration=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_output_tokens"] == 5 and m["total_input_tokens"] == 10
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["p50_itl_ms"] == pytest.approx(100.0)  # gaps 0.1, 0.1, 0.2
    assert m["mean_tpot_ms"] == pytest.approx((100.0 + 200.0) / 2)
    assert m["p99_e2el_ms"] == pytest.approx(300 + 200 * 0.99)


def test_serving_metrics_all_failed_is_nan_not_an_error() -> None:
    m = serving_metrics([RequestTiming(start=0.0, error="x")], duration=1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert math.isnan(m["mean_ttft_ms"]) and math.isnan(m["p99_itl_ms"])
