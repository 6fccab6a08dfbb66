"""Every environment variable pagedllm reads, in one place (README mirrors this table).

Each PAGEDLLM_* name has a VLLM_* alias so that existing vLLM deployments keep working;
when both are set the PAGEDLLM_* value wins.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

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
        EnvVar("PAGEDLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_OMP_THREADS_BIND",
               "CPU engines: auto (default: a thread per available CPU), nobind (keep the environment's "
               "threads and affinity), or a CPU list such as 0-3 to pin the process there."),
        EnvVar("PAGEDLLM_LOGGING_LEVEL", "VLLM_LOGGING_LEVEL", "Log level (default INFO)."),
        EnvVar("PAGEDLLM_API_KEY", "VLLM_API_KEY", "API key the server requires (same as --api-key)."),
        EnvVar("PAGEDLLM_CPU_KERNELS", None,
               "1 (default) builds and uses the native CPU kernels when a C compiler is found (packed dense "
               "float32 weights, step replay); 0 keeps plain torch ops."),
        EnvVar("PAGEDLLM_CACHE_DIR", None,
               "Where built native kernels and measured kernel crossovers are cached (default ~/.cache/pagedllm)."),
        EnvVar("PAGEDLLM_FLOAT32_MATMUL_PRECISION", None,
               "auto (default), highest or medium: whether float32 models may multiply with bf16 products "
               "where the hardware makes that faster; auto allows it only for --dtype auto on quantized "
               "checkpoints that name no float dtype (GGUF)."),
        EnvVar("PAGEDLLM_FUSED_MOE_CHUNK_SIZE", "VLLM_FUSED_MOE_CHUNK_SIZE",
               "Tokens per chunk of a mixture-of-experts layer's grouped GEMMs (default 32768, as vLLM): "
               "bounds the intermediate buffers of long prefills."),
        EnvVar("PAGEDLLM_USE_V1", "VLLM_USE_V1",
               "Accepted for compatibility and ignored with a warning: there is one engine."),
    ]
}


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


def warn_deprecated() -> None:
    """Warn about variables vLLM users still set from older guides."""
    used = source("PAGEDLLM_USE_V1")
    if used:
        logger.warning("%s is ignored: pagedllm has a single engine; unset it.", used)
