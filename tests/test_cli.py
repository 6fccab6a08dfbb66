"""`pagedllm serve | chat | bench`: flags from the config dataclasses, plugin flags, clean errors."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import socket
import subprocess
import sys
from typing import Any

import httpx
import pytest

import pagedllm
from pagedllm import bench, chat_cli, cli
from pagedllm.core.config import CONCERNS
from pagedllm.core.engine import AsyncLLMEngine
from pagedllm.core.plugins import get_registry
from pagedllm.engine_args import engine_config_from_args, engine_flags, engine_kwargs_from_args
from tests._uvicorn import wait_healthy

VLLM_FLAGS = [
    "--host", "--port", "--dtype", "--trust-remote-code", "--max-model-len", "--gpu-memory-utilization",
    "--max-num-seqs", "--max-num-batched-tokens", "--enable-chunked-prefill", "--no-enable-chunked-prefill",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--block-size", "--kv-cache-dtype", "--quantization",
    "--load-format", "--enforce-eager", "--seed", "--served-model-name", "--api-key", "--chat-template",
    "--tokenizer", "--enable-reasoning", "--reasoning-parser", "--attention-backend", "--kv-cache-memory",
    "--device", "--tensor-parallel-size", "--pipeline-parallel-size", "--speculative-config",
]


def serve_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_vllm_flag_grouped_with_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    text = serve_help(capsys)
    for flag in VLLM_FLAGS:
        assert flag in text, flag
    for title in ["model:", "KV cache:", "scheduler:", "server:", "device and kernels:"]:
        assert f"\n{title}\n" in text, title
    assert re.search(r"--max-num-seqs MAX_NUM_SEQS\s+Most sequences in one step. \(default: 256\)", text)
    assert re.search(r"--port PORT\s+Port to listen on. \(default: 8000\)", text)


def test_every_config_field_has_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    text = serve_help(capsys)
    for cls in CONCERNS.values():
        for f in dataclasses.fields(cls):
            assert f"--{f.name.replace('_', '-')}" in text, f.name


def parse(*argv: str) -> Any:
    return cli.build_parser(list(argv)).parse_args(list(argv))


def test_flags_map_to_engine_arguments_and_only_given_ones() -> None:
    args = parse("serve", "my-model", "--max-model-len", "1024", "--no-enable-prefix-caching", "--kv-cache-memory",
                 "2GiB", "--dtype", "bfloat16", "-tp", "1", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 2}')
    kwargs = engine_kwargs_from_args(args)
    assert kwargs["model"] == "my-model"
    assert kwargs["max_model_len"] == 1024
    assert kwargs["enable_prefix_caching"] is False
    assert kwargs["kv_cache_memory"] == 2 << 30
    assert kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    assert "max_num_seqs" not in kwargs  # defaults stay with the dataclasses
    config = engine_config_from_args(args)
    assert config.scheduler.max_num_seqs == 256 and config.model.dtype == "bfloat16"


def test_engine_flags_parse_back_to_the_same_engine_arguments(flag_plugin: Any) -> None:
    kwargs = {"model": "m", "max_model_len": 64, "enable_prefix_caching": False, "enforce_eager": True,
              "kv_cache_memory": 8 << 20, "speculative_config": {}, "tokenizer": None,
              "plugin_options": {"toy_level": 5}}
    again = engine_kwargs_from_args(parse("serve", *engine_flags(kwargs)))
    assert again.pop("plugin_options")["toy_level"] == 5  # installed plugins add their own defaults
    assert again == {k: v for k, v in kwargs.items() if v is not None and k != "plugin_options"}


def test_model_given_twice_differently_is_an_error() -> None:
    with pytest.raises(ValueError, match="twice"):
        engine_kwargs_from_args(parse("serve", "a", "--model", "b"))


@pytest.mark.parametrize("argv,message", [
    (["-tp", "0"], "tensor_parallel_size must be an integer >= 1"),
    (["-tp", "2", "--distributed-executor-backend", "uni"], "'uni' runs one rank"),
    (["--nnodes", "2", "-tp", "2"], "--nnodes > 1 needs --master-port"),
    (["--headless"], "--headless is for the nodes other than 0"),
    (["--speculative-config", '{"method": "nope", "num_speculative_tokens": 3}'], "unknown speculative method"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "lookup": 2}'],
     "unknown key(s) lookup"),
    (["--speculative-config", '{"method": "ngram"}'], "needs \"num_speculative_tokens\""),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}'],
     "draft_tensor_parallel_size=2 is not supported"),
    (["--block-size", "3"], "invalid choice"),
    (["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    (["--kv-cache-memory", "lots"], "not a size"),
    (["--speculative-config", "{nope"], "not JSON"),
    (["--enable-reasoning"], "--enable-reasoning needs --reasoning-parser"),
    (["--chat-template", "/no/such/file"], "neither an existing file"),
])
def test_configuration_errors_exit_2_with_one_clean_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                         message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "/some/model", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


@pytest.fixture
def engine_start_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop `serve` where it would load the model: the config was accepted by then."""
    def refuse(cls: type, config: Any) -> Any:
        raise ValueError("stopped before loading the model")

    monkeypatch.setattr(AsyncLLMEngine, "from_config", classmethod(refuse))


def test_enable_reasoning_is_accepted_with_a_warning(engine_start_stopped: None, caplog: pytest.LogCaptureFixture,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedllm"), pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "/some/model", "--enable-reasoning", "--reasoning-parser", "deepseek_r1"])
    assert exit_info.value.code == 1
    assert "stopped before loading the model" in capsys.readouterr().err
    warning = next(r.getMessage() for r in caplog.records if "--enable-reasoning" in r.getMessage())
    assert "--reasoning-parser" in warning and "deprecated" in warning


def test_startup_errors_exit_1_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "/no/such/model"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err


class FlagPlugin:
    @pagedllm.hookimpl
    def pagedllm_add_cli_args(self, parser: Any) -> None:
        parser.add_argument("--toy-level", type=int, default=3, help="A plugin's own flag.")


@pytest.fixture
def flag_plugin() -> Any:
    pm = get_registry().pm
    plugin = FlagPlugin()
    pm.register(plugin, name="toy-flags")
    yield plugin
    pm.unregister(plugin)


def test_plugin_flags_reach_plugin_options(flag_plugin: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_kwargs_from_args(parse("serve", "--toy-level", "7"))["plugin_options"]["toy_level"] == 7
    assert engine_config_from_args(parse("serve")).plugin_options["toy_level"] == 3
    assert "--toy-level" in serve_help(capsys)


def test_chat_dispatches_with_a_validated_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(chat_cli, "run_chat", lambda args: seen.update(vars(args)))
    cli.main(["chat", "m", "--system", "Be brief.", "--max-tokens", "9", "--max-model-len", "64"])
    assert seen["system"] == "Be brief." and seen["max_tokens"] == 9 and seen["temperature"] == 0.7
    assert seen["model"] == "m" and seen["max_model_len"] == 64 and isinstance(seen["plugin_options"], dict)
    assert seen["engine_kwargs"]["model"] == "m" and seen["engine_config"].model.max_model_len == 64


def test_chat_exit_status_is_passed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_cli, "run_chat", lambda args: 3)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["chat"])
    assert exit_info.value.code == 3


def test_chat_cli_reads_engine_arguments_from_a_hand_built_namespace() -> None:
    """`run_chat` outside `pagedllm chat`: engine fields by vLLM name, None left out."""
    args = argparse.Namespace(model="m", dtype="float32", max_model_len=None, temperature=0.0,
                              plugin_options={"toy_level": 2})
    assert engine_kwargs_from_args(args) == {"model": "m", "dtype": "float32", "plugin_options": {"toy_level": 2}}


def test_bench_is_delegated(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: dict[str, Any] = {}

    def add_parser(subparsers: Any) -> None:
        subparsers.add_parser("bench").add_argument("--num-prompts", type=int)

    monkeypatch.setattr(bench, "add_parser", add_parser)
    monkeypatch.setattr(bench, "main", lambda args: ran.update(vars(args)))
    cli.main(["bench", "--num-prompts", "5"])
    assert ran["num_prompts"] == 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_starts_logs_and_answers(tiny_model_dir: Any) -> None:
    """The real command in a subprocess: start-up log (config, KV cache, URL), a request, shutdown."""
    port = free_port()
    env = {**os.environ, "PAGEDLLM_API_KEY": "k"}
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "serve", str(tiny_model_dir("llama")),
                             "--port", str(port), "--kv-cache-memory", "4M", "--served-model-name", "tiny",
                             "--uvicorn-log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            assert http.get("/v1/models").status_code == 401  # the key came from the environment
            models = http.get("/v1/models", headers={"Authorization": "Bearer k"}).json()
            assert models["data"][0]["id"] == "tiny"
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode in (0, -15)
    assert "config scheduler: max_num_seqs=256" in out
    assert re.search(r"KV cache: \d+ blocks x 16 tokens = \d+ tokens", out)
    assert f"http://127.0.0.1:{port}" in out
    assert "API key required (from PAGEDLLM_API_KEY)" in out


def test_serve_defaults_to_a_2048_token_step_budget_like_vllms_server():
    parser = cli.build_parser(["serve"])
    args = parser.parse_args(["serve"])
    cli.apply_serve_defaults(args)
    assert engine_config_from_args(args).scheduler.max_num_batched_tokens == 2048
    args = parser.parse_args(["serve", "--max-num-batched-tokens", "4096"])
    cli.apply_serve_defaults(args)
    assert engine_config_from_args(args).scheduler.max_num_batched_tokens == 4096, "an explicit flag must win"


def test_hf_overrides_flags_reach_the_hf_config(tiny_model_dir: Any) -> None:
    """--hf-overrides and --rope-theta land on the loaded Hugging Face config; a linear
    rope factor 2 doubles the context length the engine allows (512 -> 1024)."""
    from pagedllm.core.engine import LLMEngine

    overrides = '{"rms_norm_eps": 0.001, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}'
    args = parse("serve", str(tiny_model_dir("llama")), "--hf-overrides", overrides, "--rope-theta", "50000",
                 "--kv-cache-memory", "64M", "--device", "cpu", "--dtype", "float32")
    engine = LLMEngine(engine_config_from_args(args))
    assert engine.hf_config.rms_norm_eps == 0.001
    assert engine.hf_config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}
    assert engine.max_model_len == 1024
    kwargs = engine_kwargs_from_args(args)
    assert engine_kwargs_from_args(parse("serve", *engine_flags(kwargs))) == kwargs  # flags round-trip


@pytest.mark.parametrize("argv,message", [
    (["--hf-overrides", "{nope"], "argument --hf-overrides: not JSON"),
    (["--hf-overrides", "[1, 2]"], "argument --hf-overrides: expected a JSON object"),
    (["--rope-scaling", '"yarn"'], "argument --rope-scaling: expected a JSON object"),
    (["--rope-theta", "-1"], "rope_theta must be a number > 0"),
    (["--rope-theta", "1e6", "--hf-overrides", '{"rope_theta": 1e4}'], "rope_theta is given twice"),
    (["--rope-scaling", "{}", "--hf-overrides", '{"rope_scaling": {}}'], "rope_scaling is given twice"),
])
def test_bad_hf_overrides_exit_2_with_one_clean_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                     message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "/some/model", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
