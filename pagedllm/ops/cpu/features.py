"""What this CPU computes in hardware, read once from /proc/cpuinfo.

The fast path differs from one x86 machine to the next (AVX2-only Zen 3, Zen 4 with
AVX512-BF16, Xeons with AMX), so kernels and dtype choices ask here instead of assuming;
`summary()` is what the start-up log and `pagedllm bench compare` print beside figures.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

from pagedllm.core import envs

# (cpuinfo flag, the name people know it by), in the order the summary lists them
NAMED_FLAGS = (
    ("avx2", "AVX2"), ("fma", "FMA"), ("avx512f", "AVX512F"), ("avx512_bf16", "AVX512-BF16"),
    ("avx512_vnni", "AVX512-VNNI"), ("avx_vnni", "AVX-VNNI"), ("avx512_fp16", "AVX512-FP16"),
    ("amx_bf16", "AMX-BF16"), ("amx_int8", "AMX-INT8"),
)


# PAGEDLLM_CPU_MAX_ISA's levels, highest first, and the cpuinfo flags (by prefix) each reads
# as absent: "avx512_bf16" a Zen 4 without AMX; "avx2_vnni" an Alder Lake or Sierra Forest
# core (AVX2 and AVX-VNNI, no AVX-512); "avx2" a Zen 3
ISA_LEVELS = {"native": (), "avx512_bf16": ("amx",), "avx2_vnni": ("avx512", "amx"),
              "avx2": ("avx512", "amx", "avx_vnni")}


def max_isa() -> str:
    """PAGEDLLM_CPU_MAX_ISA: how much of this CPU's instruction set pagedllm's kernels and
    kernel choices use ("native", the default: all of it)."""
    level = (envs.get("PAGEDLLM_CPU_MAX_ISA") or "native").strip().lower()
    if level not in ISA_LEVELS:
        raise ValueError(f"PAGEDLLM_CPU_MAX_ISA must be one of {', '.join(ISA_LEVELS)}, got {level!r}")
    return level


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's model name and feature flags (as /proc/cpuinfo spells them)."""

    model: str
    flags: frozenset[str]

    def has(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512-BF16 or AMX); elsewhere bf16 is emulated."""
        return self.has("avx512_bf16") or self.has("amx_bf16")

    @property
    def int8_dot(self) -> bool:
        """int8 dot products with 32-bit sums in hardware (VNNI or AMX-INT8)."""
        return self.has("avx512_vnni") or self.has("avx_vnni") or self.has("amx_int8")

    def named(self) -> list[str]:
        """The flags that steer pagedllm's kernels, by their usual names."""
        return [name for flag, name in NAMED_FLAGS if flag in self.flags]

    def summary(self) -> str:
        """e.g. "Intel(R) Xeon(R) Processor (x86_64; AVX2, FMA, AVX512F, AMX-BF16)"."""
        return f"{self.model} ({platform.machine()}; {', '.join(self.named()) or 'no SIMD flags of note'})"

    def to_dict(self) -> dict[str, object]:
        return {"model": self.model, "machine": platform.machine(), "features": self.named(),
                "native_bf16": self.native_bf16, "int8_dot": self.int8_dot}


def parse_cpuinfo(text: str) -> CpuFeatures:
    """The first processor's model name and flags from /proc/cpuinfo's text."""
    model, flags = "", ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = value
        if model and flags:
            break
    return CpuFeatures(model or platform.processor() or "unknown CPU", frozenset(flags.split()))


@functools.lru_cache(maxsize=1)
def machine() -> CpuFeatures:
    """This machine's CPU as /proc/cpuinfo says (an empty flag set where it cannot be read),
    whatever PAGEDLLM_CPU_MAX_ISA says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return CpuFeatures(platform.processor() or "unknown CPU", frozenset())


@functools.lru_cache(maxsize=1)
def detect() -> CpuFeatures:
    """This machine's CPU as pagedllm's kernels and choices see it: without the flags above
    PAGEDLLM_CPU_MAX_ISA (the model name then says so)."""
    return limited(machine(), max_isa())


def limited(cpu: CpuFeatures, level: str) -> CpuFeatures:
    """`cpu` as PAGEDLLM_CPU_MAX_ISA=`level` lets pagedllm see it."""
    dropped = ISA_LEVELS[level]
    if not dropped:
        return cpu
    return CpuFeatures(f"{cpu.model} (PAGEDLLM_CPU_MAX_ISA={level})",
                       frozenset(flag for flag in cpu.flags if not flag.startswith(dropped)))
