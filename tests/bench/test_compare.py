"""`bench compare`: missing peers are reported, never faked; the table's ratios."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from pagedllm.bench import build_parser, main
from pagedllm.bench.compare import EngineResult, table
from pagedllm.bench.peers import NOT_INSTALLED


def test_missing_peers_are_reported_not_installed(tiny_model_dir: Callable[..., Any], tmp_path: Path,
                                                  capsys: Any, monkeypatch: Any) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # llama_cpp may be in this venv: hide it
                        lambda name, *a: None if name in ("llama_cpp", "vllm") else real_find_spec(name, *a))
    out = tmp_path / "cmp.json"
    main(build_parser().parse_args([
        "bench", "compare", "--engines", "vllm,llamacpp", "--peers-dir", str(tmp_path / "no-peers"),
        "--hf-model", str(tiny_model_dir("llama")),
        "--num-prompts", "2", "--input-len", "4", "--output-len", "2", "--output-json", str(out),
        "--log-dir", str(tmp_path / "logs")]))
    printed = capsys.readouterr().out
    assert printed.count("not installed (run scripts/setup_peers.sh)") == 2
    result = json.loads(out.read_text())
    assert [(e["name"], e["status"]) for e in result["engines"]] == [("vllm", NOT_INSTALLED),
                                                                      ("llamacpp", NOT_INSTALLED)]
    assert all(e["offline"] == {} for e in result["engines"])  # nothing measured, nothing invented


def _result(name: str, batched: float, single: float) -> EngineResult:
    return EngineResult(name, offline={"info": {"dtype": "float32", "mode": "m"},
                                       "batched": {"output_tok_s": batched, "output_tokens": 8,
                                                   "expected_output_tokens": 8},
                                       "single_stream": {"output_tok_s": single},
                                       "startup_to_first_token_s": 1.5})


def test_table_ratios_are_pagedllm_over_peer() -> None:
    text = table([_result("pagedllm", 100.0, 20.0), _result("peer", 400.0, 10.0),
                  EngineResult("gone", status=NOT_INSTALLED)])
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()[2:]}
    assert rows["pagedllm"][2:6] == ["100.0", "1.00x", "20.0", "1.00x"]
    assert rows["peer"][2:6] == ["400.0", "0.25x", "10.0", "2.00x"]
    assert rows["gone"][2] == "-" and rows["gone"][-1] == NOT_INSTALLED
    assert rows["pagedllm"][-2] == "- / -", "no probe ran: no machine speed shown"


def test_table_shows_the_machine_speed_before_each_phase() -> None:
    r = _result("pagedllm", 100.0, 20.0)
    r.probe = {"offline": {"gflops": 151.24, "read_gbs": 20.0}, "serve": {"gflops": 88.0, "read_gbs": 12.0}}
    row = table([r]).splitlines()[2].split("|")[1:-1]
    assert row[-2].strip() == "151.2 / 88.0"


def test_table_flags_engines_that_stop_short() -> None:
    """A server that ignores ignore_eos/min_tokens (or interrupts streams) is called out,
    since its tokens/s then counts less work."""
    r = _result("pagedllm", 100.0, 20.0)
    r.serve = {"output_throughput": 50.0, "total_output_tokens": 11, "expected_output_tokens": 32}
    r.serve_status = "ok"
    assert "serve generated 11 of 32 tokens" in table([r])


def test_compare_runs_pagedllm_and_transformers_in_subprocesses(tiny_model_dir: Callable[..., Any],
                                                                 tmp_path: Path) -> None:
    """The whole offline flow: same prompt ids to two engines, each in its own process,
    every phase measured (start-up to first token, batched, single stream)."""
    model = str(tiny_model_dir("llama"))
    out = tmp_path / "cmp.json"
    main(build_parser().parse_args([
        "bench", "compare", model, "--hf-model", model, "--engines", "pagedllm,transformers-fp32", "--no-serve",
        "--num-prompts", "3", "--input-len", "5", "--output-len", "4", "--single-stream-prompts", "1",
        "--kv-cache-memory", str(8 << 20), "--timeout", "120", "--output-json", str(out),
        "--log-dir", str(tmp_path / "logs")]))
    engines = {e["name"]: e for e in json.loads(out.read_text())["engines"]}
    for name in ("pagedllm", "transformers-fp32"):
        offline = engines[name]["offline"]
        assert engines[name]["status"] == "ok", engines[name]
        assert offline["batched"]["output_tokens"] == offline["batched"]["expected_output_tokens"] == 12
        assert offline["single_stream"]["output_tokens"] == 4
        assert offline["startup_to_first_token_s"] >= offline["load_s"] > 0
        probe = engines[name]["machine_probe"]["offline"]  # the machine's speed just before the run
        assert probe["gflops"] > 0 and probe["read_gbs"] > 0
    job = json.loads((tmp_path / "logs" / "pagedllm.job.json").read_text())
    other = json.loads((tmp_path / "logs" / "transformers-fp32.job.json").read_text())
    for key in ("warmup_prompt", "batched_sets", "single_sets"):
        assert job[key] == other[key]  # the same ids for every engine
    seen = [tuple(job["warmup_prompt"])] + [tuple(p) for key in ("batched_sets", "single_sets")
                                            for s in job[key] for p in s]
    assert len(seen) == len(set(seen)) == 1 + 3 + 1  # no phase reuses a prompt (no free prefix-cache hits)


def test_workload_never_reuses_a_prompt() -> None:
    import argparse

    from pagedllm.bench.compare import Workload

    args = argparse.Namespace(num_prompts=4, single_stream_prompts=2, repeat=3, input_len=6, output_len=2)
    w = Workload.build(args, vocab_size=1000, seed=0, exclude=[])
    assert (len(w.batched_sets), len(w.single_sets), len(w.serve)) == (3, 3, 4)
    everything = [w.warmup] + [r for s in w.batched_sets + w.single_sets for r in s] + w.serve
    assert len({tuple(r.prompt_token_ids) for r in everything}) == len(everything) == 1 + 12 + 6 + 4


def test_prompts_come_from_an_hf_directory_or_a_gguf_files_own_tokenizer(tiny_model_dir: Callable[..., Any],
                                                                          smollm2_path: str, tmp_path: Path) -> None:
    """pagedllm against llama.cpp on a GGUF needs no Hugging Face directory: the file's own
    tokenizer draws the prompts; anything else is refused with what to give."""
    from pagedllm.bench.compare import prompt_tokenizer

    assert len(prompt_tokenizer(smollm2_path)) == 49152
    assert 256 < len(prompt_tokenizer(str(tiny_model_dir("llama")))) <= 384  # its trained byte-level BPE
    for bad in (None, str(tmp_path / "missing.gguf")):
        with pytest.raises(ValueError, match="give --hf-model"):
            prompt_tokenizer(bad)
