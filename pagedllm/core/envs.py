"""Every environment variable pagedllm reads, in one place (README mirrors this table).

Each PAGEDLLM_* name has a VLLM_* alias so that existing vLLM deployments keep working;
when both are set the PAGEDLLM_* value wins.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("pagedllm")


@dataclass(frozen=True)
class EnvVar:
    name: str
    alias: str | None
    help: str


ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in [
        EnvVar("PAGEDLLM_ATTENTION_BACKEND", "VLLM_ATTENTION_BACKEND",
               "Attention backend name (TORCH, CPU_ATTN, TRITON, FLASH_ATTN, FLASHINFER); the flag wins."),
        EnvVar("PAGEDLLM_PLUGINS", "VLLM_PLUGINS",
               "Comma-separated entry-point names of the plugins to load (default: all)."),
        EnvVar("PAGEDLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE",
               "KV-cache size on the CPU in GiB when kv_cache_memory is not given (default 4)."),
        EnvVar("PAGEDLLM_CPU_KV_PREFAULT_MB", None,
               "MiB of the CPU KV cache (its first blocks, all layers) faulted in at start-up, so the first "
               "requests' steps do not stall on page faults (default 256, and a serving engine faults in the "
               "rest while idle, a few MiB at a time; set: that many MiB and nothing while idle; 0: none, all "
               "faults happen as blocks are first written)."),
        EnvVar("PAGEDLLM_CPU_MALLOC_REUSE_MB", None,
               "CPU engines on glibc: freed memory blocks up to this many MiB stay in the heap for reuse "
               "instead of being unmapped, so large steps do not fault their activations in anew (glibc's mmap "
               "and trim thresholds; default 1024; 0 keeps glibc's defaults)."),
        EnvVar("PAGEDLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_OMP_THREADS_BIND",
               "CPU engines: auto (default: a thread per available CPU), nobind (keep the environment's "
               "threads and affinity), or a CPU list such as 0-3 to pin the process there."),
        EnvVar("PAGEDLLM_LOGGING_LEVEL", "VLLM_LOGGING_LEVEL", "Log level (default INFO)."),
        EnvVar("PAGEDLLM_API_KEY", "VLLM_API_KEY", "API key the server requires (same as --api-key)."),
        EnvVar("PAGEDLLM_CPU_KERNELS", None,
               "1 (default) builds and uses the native CPU kernels when a C compiler is found (packed dense "
               "float32 weights, step replay); 0 keeps plain torch ops."),
        EnvVar("PAGEDLLM_CPU_MAX_ISA", None,
               "native (default), avx512_bf16, avx2_vnni or avx2: the most of this CPU's instruction set "
               "pagedllm's CPU kernels and kernel choices use (avx512_bf16: no AMX, as on a Zen 4; avx2_vnni: no "
               "AVX-512 or AMX, as on an Alder Lake; avx2: nor AVX-VNNI, as on a Zen 3); the kernels are built for "
               "it and the CPU's flags read without the rest. To compare paths on one machine or step around one. "
               "torch's own oneDNN follows ONEDNN_MAX_CPU_ISA."),
        EnvVar("PAGEDLLM_CACHE_DIR", None,
               "Where built native kernels and measured kernel crossovers are cached (default ~/.cache/pagedllm)."),
        EnvVar("PAGEDLLM_FLOAT32_MATMUL_PRECISION", None,
               "auto (default), highest or medium: whether float32 models may multiply with bf16 products "
               "where the hardware makes that faster; auto allows it only for --dtype auto on quantized "
               "checkpoints that name no float dtype (GGUF)."),
        EnvVar("PAGEDLLM_FP8_ACTIVATIONS", None,
               "auto (default): FP8 checkpoints quantize activations to fp8 (W8A8) only where the device "
               "multiplies fp8 (CUDA 8.9+) and run weight-only (W8A16) elsewhere, every CPU included, as vLLM "
               "does on GPUs without fp8; fp8: quantize them everywhere (a GPU's W8A8 numerics); float: never."),
        EnvVar("PAGEDLLM_INT8_ACTIVATIONS", None,
               "float (default) or int8: where GGUF layers run on the VNNI kernel (AVX512-VNNI or its AVX2 form; "
               "--dtype auto, at the batch sizes it measured fastest), it rounds each 32 activations to 14-bit "
               "integers (float) or to int8 as llama.cpp does (int8: up to 1.9x faster products, logprobs further "
               "from float32)."),
        EnvVar("PAGEDLLM_FUSED_MOE_CHUNK_SIZE", "VLLM_FUSED_MOE_CHUNK_SIZE",
               "Tokens per chunk of a mixture-of-experts layer's grouped GEMMs (default 32768, as vLLM): "
               "bounds the intermediate buffers of long prefills."),
        EnvVar("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN",
               "1: allow a --max-model-len longer than the model's context (warned: positions the model was not "
               "trained for may give wrong outputs; a rope scaling through --hf-overrides is the sound way)."),
        EnvVar("PAGEDLLM_HOST_IP", "VLLM_HOST_IP",
               "This machine's address that other ranks reach (node 0: where the ranks meet; default "
               "--master-addr, 127.0.0.1 on one machine)."),
        EnvVar("PAGEDLLM_PORT", "VLLM_PORT",
               "The port where the ranks meet on node 0 when --master-port is not given (default: a free one)."),
        EnvVar("PAGEDLLM_USE_V1", "VLLM_USE_V1",
               "Accepted for compatibility and ignored with a warning: there is one engine."),
    ]
}


# vLLM variables a vLLM user may have set that change nothing here: said once, never silent.
NO_EFFECT: dict[str, str] = {
    "VLLM_MEDIA_LOADING_THREAD_COUNT": "no multimodal inputs are loaded",
    "VLLM_WORKER_MULTIPROC_METHOD": "rank processes are always spawned (never forked)",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "the engine runs in the server's process",
    "VLLM_CONFIGURE_LOGGING": "logging is always configured by pagedllm (PAGEDLLM_LOGGING_LEVEL sets the level)",
    "VLLM_CACHE_ROOT": "pagedllm caches built kernels under PAGEDLLM_CACHE_DIR",
    "VLLM_TARGET_DEVICE": "the device is chosen with --device",
    "VLLM_USE_MODELSCOPE": "models are read from local paths",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "use PAGEDLLM_CPU_OMP_THREADS_BIND to choose the CPUs",
}
# read by the test suite (tests/conftest.py), not the engine: known, so a test run on a GPU
# (PAGEDLLM_TEST_DEVICE=cuda) is not told its own settings are typos
TEST_SUITE_VARS = frozenset({"PAGEDLLM_TEST_DEVICE", "PAGEDLLM_TEST_REPORT"})
_PREFIXES = ("PAGEDLLM_", "VLLM_")
_told = False


def warn_environment(environ: dict[str, str] | None = None) -> list[str]:
    """Warn about every PAGEDLLM_* / VLLM_* variable that is set and either unknown (a typo
    must not pass unnoticed: vLLM's "unknown environment variable") or known to have no
    effect here. Returns the messages."""
    environ = dict(os.environ) if environ is None else environ
    known = set(ENV_VARS) | {v.alias for v in ENV_VARS.values() if v.alias} | TEST_SUITE_VARS
    messages = []
    for name in sorted(environ):
        if not name.startswith(_PREFIXES) or name in known:
            continue
        if name in NO_EFFECT:
            messages.append(f"{name} is set and has no effect here: {NO_EFFECT[name]}")
        else:
            messages.append(f"unknown environment variable {name} (not one pagedllm reads; the ones it reads are "
                            "listed in the README's Environment variables table)")
    for message in messages:
        logger.warning(message)
    return messages


def get(name: str, default: str | None = None) -> str | None:
    """The value of `name` or its VLLM_* alias; logs which one decided."""
    var = ENV_VARS[name]
    if name in os.environ:
        return os.environ[name]
    if var.alias and var.alias in os.environ:
        logger.debug("%s taken from its alias %s", name, var.alias)
        return os.environ[var.alias]
    return default


def source(name: str) -> str | None:
    """Which variable (the name or its alias) is set, for log messages."""
    var = ENV_VARS[name]
    if name in os.environ:
        return name
    if var.alias and var.alias in os.environ:
        return var.alias
    return None


LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


def _positive(kind: str) -> Any:
    def check(value: str) -> str | None:
        try:
            number = (float if kind == "number" else int)(value)
        except ValueError:
            number = 0
        return None if number > 0 else f"expected a positive {kind}"
    return check


def _non_negative_integer(value: str) -> str | None:
    return None if value.strip().isdigit() else "expected an integer >= 0"


def _one_of(*choices: str) -> Any:
    return lambda value: None if value.strip().lower() in choices else f"expected one of {', '.join(choices)}"


def _port(value: str) -> str | None:
    return None if value.isdigit() and 0 < int(value) < 65536 else "expected a port number (1-65535)"


def _cpu_list(value: str) -> str | None:
    if value.strip() in ("auto", "nobind") or re.fullmatch(r"[\d,\-|\s]+", value):
        return None
    return "expected auto, nobind or a CPU list such as 0-3,8 (one per rank: 0-3|4-7)"


# What each value must look like, checked before anything loads (`check_values`).
VALUE_CHECKS = {
    "PAGEDLLM_CPU_KVCACHE_SPACE": _positive("number"),
    "PAGEDLLM_FUSED_MOE_CHUNK_SIZE": _positive("integer"),
    "PAGEDLLM_CPU_KV_PREFAULT_MB": _non_negative_integer,
    "PAGEDLLM_CPU_MALLOC_REUSE_MB": _non_negative_integer,
    "PAGEDLLM_PORT": _port,
    "PAGEDLLM_LOGGING_LEVEL": _one_of(*(level.lower() for level in LOG_LEVELS)),
    "PAGEDLLM_CPU_KERNELS": _one_of("0", "1", "true", "false", "yes", "no", "on", "off"),
    "PAGEDLLM_FLOAT32_MATMUL_PRECISION": lambda v: None if v in ("", "auto", "highest", "medium")
    else "expected auto, highest or medium",
    "PAGEDLLM_CPU_OMP_THREADS_BIND": _cpu_list,
    "PAGEDLLM_INT8_ACTIVATIONS": _one_of("float", "int8"),
    "PAGEDLLM_CPU_MAX_ISA": _one_of("native", "avx512_bf16", "avx2_vnni", "avx2"),
}


def check_values() -> list[str]:
    """One message per variable whose value cannot work, naming the variable as it was
    set (`VLLM_PORT=abc: expected a port number ...; unset it or ...`)."""
    problems = []
    for name, check in VALUE_CHECKS.items():
        value = get(name)
        if value is None:
            continue
        why = check(value)
        if why:
            var = source(name)
            problems.append(f"{var}={value!r}: {why}; unset {var} or give a valid value. {var}: {ENV_VARS[name].help}")
    return problems


def warn_deprecated() -> None:
    """Warn about variables vLLM users still set from older guides, and (once) about
    unknown or ineffective ones."""
    global _told
    if _told:  # once per process: every engine built in it reads the same environment
        return
    _told = True
    warn_environment()
    used = source("PAGEDLLM_USE_V1")
    if used:
        logger.warning("%s is ignored: pagedllm has a single engine; unset it.", used)
