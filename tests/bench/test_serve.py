"""`bench serve` against the fake streaming server (127.0.0.1 only)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedllm.bench import build_parser, main
from pagedllm.bench.serve import benchmark, completions_url
from pagedllm.bench.workload import BenchRequest



def test_completions_url_tolerates_v1_suffix() -> None:
    assert completions_url("http://h:1") == "http://h:1/v1/completions"
    assert completions_url("http://h:1/v1/") == "http://h:1/v1/completions"


def test_serve_cli_measures_the_stream(fake_server: Any, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "serve.json"
    fake_server.received.clear()
    main(build_parser().parse_args(["bench", "serve", "--base-url", fake_server.url, "--model", "fake-model",
                                    "--num-prompts", "6", "--input-len", "5", "--output-len", "4",
                                    "--max-concurrency", "3", "--output-json", str(out)]))
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Median TTFT" in printed
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 6 * 4
    assert result["total_input_tokens"] == 6 * 5
    # the fake waits fake_server.chunk_delay_s before every chunk
    assert result["mean_ttft_ms"] >= fake_server.chunk_delay_s * 1000 * 0.9
    assert result["p50_itl_ms"] >= fake_server.chunk_delay_s * 1000 * 0.9
    assert result["mean_tpot_ms"] > 0 and result["output_throughput"] > 0
    sent = fake_server.received[-1]  # no tokenizer: prompts go out as token ids
    assert isinstance(sent["prompt"], list) and len(sent["prompt"]) == 5
    assert sent["stream"] is True and sent["ignore_eos"] is True and sent["max_tokens"] == 4
    assert len(fake_server.received) == 1 + 6  # the test request, then the load


def test_failed_requests_are_counted(fake_server: Any) -> None:
    reqs = [BenchRequest([7, 8], 3), BenchRequest([fake_server.fail_token, 8], 3), BenchRequest([9], 3)]
    result = asyncio.run(benchmark(fake_server.url, "fake-model", reqs, request_rate=50.0, seed=1))
    assert result["completed"] == 2 and result["failed"] == 1
    assert "HTTP 500" in result["errors"][0]


def test_a_wrong_url_fails_fast_with_the_reason(fake_server: Any) -> None:
    with pytest.raises(RuntimeError, match="test request .* failed: HTTP 404"):
        asyncio.run(benchmark(fake_server.url, "fake-model", [BenchRequest([1], 2)], endpoint="/v1/nope"))


def test_plot_without_matplotlib_is_a_clear_error(fake_server: Any, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    args = build_parser().parse_args(["bench", "serve", "--base-url", fake_server.url, "--model", "fake-model",
                                      "--num-prompts", "2", "--plot", str(tmp_path / "p.png")])
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        main(args)
