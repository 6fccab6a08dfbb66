"""`bench throughput` and `bench latency` on a tiny random model, through the CLI parser."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from pagedllm.bench import build_parser, main


def _run(argv: list[str]) -> None:
    main(build_parser().parse_args(["bench", *argv]))


def test_throughput_reports_rates_and_writes_json(tiny_model_dir: Callable[..., Any], tmp_path: Path,
                                                  capsys: Any) -> None:
    out = tmp_path / "tp.json"
    _run(["throughput", "--model", str(tiny_model_dir("llama")), "--num-prompts", "4", "--input-len", "12",
          "--output-len", "6", "--max-num-seqs", "4", "--kv-cache-memory", str(8 << 20),
          "--output-json", str(out), "--disable-tqdm"])
    printed = capsys.readouterr().out
    assert "requests/s" in printed and "output tokens/s" in printed and "total tokens/s" in printed
    result = json.loads(out.read_text())
    assert result["num_requests"] == 4
    assert result["total_prompt_tokens"] == 4 * 12
    assert result["total_output_tokens"] == 4 * 6  # ignore_eos: every request runs to --output-len
    assert result["output_tokens_per_second"] > 0
    assert result["engine_args"]["max_num_seqs"] == 4
    assert "Decode:" in printed and result["mean_decode_tokens_per_second"] > 0


def test_decode_rate_leaves_the_prefill_out() -> None:
    """A request's decode rate counts its tokens after the first over the time after the
    first: a slow prefill (first token at 10 s) does not lower it."""
    from types import SimpleNamespace

    from pagedllm.bench.offline import report_decode_rate
    from pagedllm.core.request import RequestMetrics

    def output(first: float, finished: float, tokens: int):
        return SimpleNamespace(metrics=RequestMetrics(arrival_time=0.0, first_token_time=first, finished_time=finished),
                               outputs=[SimpleNamespace(token_ids=list(range(tokens)))])

    result: dict[str, Any] = {}
    report_decode_rate([output(10.0, 12.0, 21), output(1.0, 1.5, 11), output(2.0, 2.0, 1)], result)
    assert result["mean_decode_tokens_per_second"] == (20 / 2.0 + 10 / 0.5) / 2, "a 1-token request has no rate"


def test_throughput_reads_a_dataset(tiny_model_dir: Callable[..., Any], tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "Hello world"}) + "\n" +
                    json.dumps({"prompt_token_ids": [5, 6, 7], "output_len": 2}) + "\n")
    out = tmp_path / "tp.json"
    _run(["throughput", "--model", str(tiny_model_dir("llama")), "--num-prompts", "4", "--output-len", "3",
          "--dataset", str(data), "--kv-cache-memory", str(8 << 20), "--output-json", str(out), "--disable-tqdm"])
    result = json.loads(out.read_text())
    assert result["num_requests"] == 2 and result["total_output_tokens"] == 3 + 2


def test_latency_reports_percentiles(tiny_model_dir: Callable[..., Any], tmp_path: Path) -> None:
    out = tmp_path / "lat.json"
    _run(["latency", "--model", str(tiny_model_dir("llama")), "--batch-size", "2", "--input-len", "8",
          "--output-len", "4", "--num-iters-warmup", "1", "--num-iters", "3", "--kv-cache-memory", str(8 << 20),
          "--output-json", str(out), "--disable-tqdm"])
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 3
    assert set(result["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert min(result["latencies"]) <= result["percentiles"]["50"] <= max(result["latencies"])


def test_bench_takes_the_engine_flags_without_importing_the_cli() -> None:
    """`pagedllm.bench` builds and reads its engine flags with `pagedllm.engine_args` alone."""
    code = ("import sys, pagedllm.bench as b; "
            "b.build_parser().parse_args(['bench', 'throughput', '-tp', '1', '--max-model-len', '64']); "
            "sys.exit('pagedllm.cli' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
