"""The ten `vllm serve` command shapes of a vLLM field guide, typed as `pagedllm serve` on
the bundled model: each flag and env var works, warns with a named reason, or is refused
with the next step; none is silently ignored.

Each shape goes through what `pagedllm serve` does before it loads a model
(`cli.serve_setup`: the parser, the server settings, the engine config with its plugin
and environment checks); two of them also run a real engine (`LLM`) on the bundled
model. A shape's expectations name every flag and variable it sets, so a flag the test
forgot is a failure too."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

from pagedllm import LLM, SamplingParams, cli
from pagedllm.core import envs
from pagedllm.core.config import ConfigError, default_model
from pagedllm.ops.moe import chunk_size

Check = Callable[[Any, Any], bool]  # (engine config, server settings) -> the flag took effect


@dataclass
class Works:
    check: Check


@dataclass
class Warns:
    words: str  # the reason, as the warning says it


@dataclass
class Refused:
    words: str  # the reason and the next step, as the error says them


@dataclass
class Shape:
    argv: list[str]
    expect: dict[str, Any]  # flag or env var -> Works / Warns / Refused
    env: dict[str, str] = field(default_factory=dict)


ON_GPU = torch.cuda.is_available()  # where the engine runs when no --device is given


SHAPES = {
    "plain model": Shape([], {}),
    "context and memory": Shape(
        ["--max-model-len", "2048", "--gpu-memory-utilization", "0.85"],
        {"--max-model-len": Works(lambda c, s: c.model.max_model_len == 2048),
         # on a GPU the fraction sizes the cache; on the CPU the warning says what does
         "--gpu-memory-utilization": Works(lambda c, s: c.cache.gpu_memory_utilization == 0.85) if ON_GPU
         else Warns("has no effect on the CPU: the KV cache there is")}),
    "tensor and expert parallel": Shape(
        ["-tp", "2", "--enable-expert-parallel"],
        {"-tp": Works(lambda c, s: c.parallel.tensor_parallel_size == 2 and c.parallel.executor_backend == "mp"),
         "--enable-expert-parallel": Works(lambda c, s: c.parallel.enable_expert_parallel)}),
    "fp8": Shape(
        ["--quantization", "fp8", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"],
        {"--quantization": Refused("is a gguf file, quantized already: drop --quantization"),
         "--kv-cache-dtype": Works(lambda c, s: c.cache.kv_cache_dtype == "fp8"),
         "--calculate-kv-scales": Works(lambda c, s: c.cache.calculate_kv_scales)}),
    "tool calling": Shape(
        ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        {"--enable-auto-tool-choice": Works(lambda c, s: s.enable_auto_tool_choice),
         "--tool-call-parser": Works(lambda c, s: s.tool_call_parser == "hermes")}),
    "reasoning": Shape(
        ["--reasoning-parser", "deepseek_r1"],
        {"--reasoning-parser": Works(lambda c, s: s.reasoning_parser == "deepseek_r1"
                                     and c.structured.options["reasoning_end"] == "</think>")}),
    "speculative decoding": Shape(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'],
        {"--speculative-config": Works(lambda c, s: c.spec.speculative_config["num_speculative_tokens"] == 5)}),
    "long context": Shape(
        ["--rope-scaling", '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}',
         "--max-model-len", "32768"],
        {"--rope-scaling": Works(lambda c, s: c.model.hf_config_overrides()["rope_scaling"]["rope_type"] == "yarn"),
         "--max-model-len": Works(lambda c, s: c.model.max_model_len == 32768)}),
    "throughput": Shape(
        ["--enable-prefix-caching", "--enable-chunked-prefill", "--max-num-batched-tokens", "2048"],
        {"--enable-prefix-caching": Works(lambda c, s: c.cache.enable_prefix_caching),
         "--enable-chunked-prefill": Works(lambda c, s: c.scheduler.enable_chunked_prefill),
         "--max-num-batched-tokens": Works(lambda c, s: c.scheduler.max_num_batched_tokens == 2048)}),
    "network server": Shape(
        ["--host", "0.0.0.0", "--port", "8001", "--api-key", "sk-guide", "--served-model-name", "smol"],
        {"--host": Works(lambda c, s: s.host == "0.0.0.0"), "--port": Works(lambda c, s: s.port == 8001),
         "--api-key": Works(lambda c, s: s.api_key == "sk-guide"),
         "--served-model-name": Works(lambda c, s: c.model.served_model_name == "smol")}),
    "environment": Shape(
        [], {"VLLM_ATTENTION_BACKEND": Works(lambda c, s: envs.get("PAGEDLLM_ATTENTION_BACKEND") == "TORCH"),
             "VLLM_USE_V1": Warns("VLLM_USE_V1 is ignored: pagedllm has a single engine"),
             "VLLM_FUSED_MOE_CHUNK_SIZE": Works(lambda c, s: chunk_size() == 16384),
             # said by the worker when it starts on the CPU: see test_cpu_settings_are_said_by_a_real_engine
             "CUDA_VISIBLE_DEVICES": Works(lambda c, s: True)},
        {"VLLM_ATTENTION_BACKEND": "TORCH", "VLLM_USE_V1": "1", "VLLM_FUSED_MOE_CHUNK_SIZE": "16384",
         "CUDA_VISIBLE_DEVICES": "0"}),
}


def given_flags(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("-") and not a.lstrip("-")[:1].isdigit()]


def run_setup(shape: Shape, monkeypatch: pytest.MonkeyPatch,
              caplog: pytest.LogCaptureFixture) -> tuple[Any, Any, list[str], list[str]]:
    """(config, settings, problem lines, warnings) of `pagedllm serve` up to loading."""
    for name, value in shape.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(envs, "_told", False)  # the environment is said once per process: here, once per shape
    argv = ["serve", default_model(), *shape.argv]
    config = settings = None
    problems: list[str] = []
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        args = cli.build_parser(argv).parse_args(argv)
        try:
            config, settings = cli.serve_setup(args)
        except ConfigError as exc:
            problems = [exc.message("cli")] if len(exc.problems) == 1 else exc.message("cli").splitlines()[1:]
    return config, settings, [p.removeprefix("  - ") for p in problems], [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_guide_command(name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    shape = SHAPES[name]
    assert set(given_flags(shape.argv)) | set(shape.env) == set(shape.expect), "every flag and variable is judged"
    config, settings, problems, warnings = run_setup(shape, monkeypatch, caplog)
    refused = {k for k, v in shape.expect.items() if isinstance(v, Refused)}
    if not refused:
        assert not problems, problems
    assert len(problems) == len(refused), problems
    for key, verdict in shape.expect.items():
        if isinstance(verdict, Refused):
            said = [p for p in problems if p.startswith(key)]
            assert said and verdict.words in said[0], (key, problems)
        elif isinstance(verdict, Warns):
            said = [w for w in warnings if key in w and verdict.words in w]
            assert said, (key, warnings)
    if refused:  # the rest of the command works once the refused flags are dropped
        shape = Shape(without(shape.argv, refused), {k: v for k, v in shape.expect.items() if k not in refused},
                      shape.env)
        config, settings, problems, _ = run_setup(shape, monkeypatch, caplog)
        assert not problems, problems
    for key, verdict in shape.expect.items():
        if isinstance(verdict, Works):
            assert verdict.check(config, settings), key
    assert config.model.model == default_model()


def without(argv: list[str], flags: set[str]) -> list[str]:
    """`argv` less `flags` and their values."""
    out: list[str] = []
    skipping = False
    for arg in argv:
        if arg.startswith("-"):
            skipping = arg in flags
        if not skipping:
            out.append(arg)
    return out


def test_gpu_memory_utilization_works_on_a_gpu_and_is_explained_on_the_cpu(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    shape = Shape(["--gpu-memory-utilization", "0.85", "--device", "cpu"], {})
    config, _, problems, warnings = run_setup(shape, monkeypatch, caplog)
    assert not problems and config.cache.gpu_memory_utilization == 0.85
    said = [w for w in warnings if w.startswith("--gpu-memory-utilization 0.85 has no effect on the CPU")]
    assert len(said) == 1 and "--kv-cache-memory SIZE or PAGEDLLM_CPU_KVCACHE_SPACE" in said[0], warnings
    caplog.clear()
    config, _, problems, warnings = run_setup(Shape(["--device", "cpu"], {}), monkeypatch, caplog)
    assert not any("gpu-memory-utilization" in w for w in warnings), "only when the flag was given"


def test_a_bad_env_value_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    shape = Shape([], {}, {"VLLM_ATTENTION_BACKEND": "DUAL_CHUNK_FLASH_ATTN", "VLLM_FUSED_MOE_CHUNK_SIZE": "0"})
    _, _, problems, _ = run_setup(shape, monkeypatch, caplog)
    assert len(problems) == 2, problems
    assert problems[0].startswith("VLLM_ATTENTION_BACKEND=DUAL_CHUNK_FLASH_ATTN: unknown attention backend; "
                                  "unset VLLM_ATTENTION_BACKEND")
    assert problems[1].startswith("VLLM_FUSED_MOE_CHUNK_SIZE='0': expected a positive integer")


PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def test_cpu_settings_are_said_by_a_real_engine(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """Shape "context and memory" (with the guide's env vars) on a real engine: the context
    is 2048, the KV cache is what PAGEDLLM_CPU_KVCACHE_SPACE says (the warning said so), and
    CUDA_VISIBLE_DEVICES is said to do nothing on the CPU. (0.125 GiB: a CPU without native
    bf16, such as a Zen 3, keeps a float32 cache, 90 MiB for SmolLM2's 2048 tokens.)"""
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "0.125")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        llm = LLM(default_model(), max_model_len=2048, gpu_memory_utilization=0.85, device="cpu", max_num_seqs=4)
    try:
        warnings = [r.getMessage() for r in caplog.records]
        assert any(w.startswith("gpu_memory_utilization=0.85 has no effect on the CPU: the KV cache there is "
                                "0.125 GiB (PAGEDLLM_CPU_KVCACHE_SPACE=0.125 GiB)") for w in warnings), warnings
        assert any(w.startswith("CUDA_VISIBLE_DEVICES=0 has no effect") for w in warnings), warnings
        assert llm.engine.max_model_len == 2048
        assert llm.engine.worker.budget.available_bytes == 128 << 20
        out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_throughput_flags_on_a_real_engine() -> None:
    """Shape "throughput" on a real engine: the step budget is 2048 and a repeated prompt is
    served from the prefix cache, with the same greedy tokens."""
    llm = LLM(default_model(), enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=2048,
              kv_cache_memory=32 << 20, max_model_len=512, max_num_seqs=4)
    try:
        assert llm.engine.scheduler.max_num_batched_tokens == 2048
        params = SamplingParams(max_tokens=4, temperature=0)
        first, again = (llm.generate([PROMPT], params, use_tqdm=False)[0] for _ in range(2))
        assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        llm.shutdown()
