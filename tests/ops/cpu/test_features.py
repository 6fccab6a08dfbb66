"""CPU feature detection (pagedllm/ops/cpu/features.py) on /proc/cpuinfo texts of the
machines this project has run on, and on this machine."""

from __future__ import annotations

from pagedllm.ops.cpu import features

ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7R13 Processor
flags\t\t: fpu sse2 avx avx2 fma bmi2
processor\t: 1
model name\t: AMD EPYC 7R13 Processor
flags\t\t: fpu sse2 avx avx2 fma bmi2
"""
XEON_AMX = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx avx2 fma avx512f avx512_bf16 avx512_vnni avx_vnni avx512_fp16 amx_bf16 amx_tile amx_int8
"""


def test_zen3_has_avx2_and_no_native_bf16():
    cpu = features.parse_cpuinfo(ZEN3)
    assert cpu.model == "AMD EPYC 7R13 Processor"
    assert cpu.named() == ["AVX2", "FMA"]
    assert not cpu.native_bf16 and not cpu.int8_dot


def test_xeon_with_amx_has_native_bf16_and_int8_dot():
    cpu = features.parse_cpuinfo(XEON_AMX)
    assert cpu.native_bf16 and cpu.int8_dot
    assert {"AMX-BF16", "AMX-INT8", "AVX512-BF16"} <= set(cpu.named())
    assert "Intel(R) Xeon(R) Processor" in cpu.summary() and "AMX-BF16" in cpu.summary()
    assert cpu.to_dict()["native_bf16"] is True


def test_unreadable_or_empty_cpuinfo_gives_no_flags():
    cpu = features.parse_cpuinfo("")
    assert cpu.flags == frozenset() and not cpu.native_bf16


def test_this_machine_is_detected_once():
    assert features.detect() is features.detect()
    assert features.detect().model


def test_max_isa_levels_read_the_cpu_as_a_lesser_one():
    """PAGEDLLM_CPU_MAX_ISA=avx512_bf16 reads an AMX Xeon as a Zen 4 (no AMX); avx2 as a Zen 3
    (no AVX-512, AMX or AVX-VNNI); the model name says it is limited."""
    xeon = features.parse_cpuinfo(XEON_AMX)
    zen4 = features.limited(xeon, "avx512_bf16")
    assert zen4.native_bf16 and zen4.has("avx512_vnni") and not zen4.has("amx_bf16") and not zen4.has("amx_tile")
    assert "PAGEDLLM_CPU_MAX_ISA=avx512_bf16" in zen4.model
    zen3 = features.limited(xeon, "avx2")
    assert zen3.named() == ["AVX2", "FMA"] and not zen3.native_bf16 and not zen3.int8_dot
    assert features.limited(xeon, "native") is xeon


def test_max_isa_setting_is_checked(monkeypatch):
    import pytest

    monkeypatch.setenv("PAGEDLLM_CPU_MAX_ISA", "AVX2")
    assert features.max_isa() == "avx2"
    monkeypatch.setenv("PAGEDLLM_CPU_MAX_ISA", "sse4")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_MAX_ISA must be one of native, avx512_bf16, avx2"):
        features.max_isa()


def test_max_isa_limits_what_pagedllm_sees_not_the_machine(monkeypatch):
    """detect() (what kernels and choices read) drops the flags above the level; machine() (what
    `bench compare` reports, and what its peers run on) keeps them."""
    monkeypatch.setenv("PAGEDLLM_CPU_MAX_ISA", "avx2")
    features.detect.cache_clear()
    try:
        seen, real = features.detect(), features.machine()
        assert not any(f.startswith(("avx512", "amx")) for f in seen.flags)
        assert seen.flags <= real.flags and "PAGEDLLM_CPU_MAX_ISA=avx2" in seen.model
        assert "PAGEDLLM_CPU_MAX_ISA" not in real.model
    finally:
        monkeypatch.delenv("PAGEDLLM_CPU_MAX_ISA")
        features.detect.cache_clear()


def test_every_max_isa_level_has_its_compiler_flags_and_is_accepted():
    """features.ISA_LEVELS, native.ISA_FLAGS and the variable's value check name the same levels."""
    from pagedllm.core import envs
    from pagedllm.ops.cpu import native

    assert set(native.ISA_FLAGS) == set(features.ISA_LEVELS)
    for level in features.ISA_LEVELS:
        assert envs.VALUE_CHECKS["PAGEDLLM_CPU_MAX_ISA"](level) is None, level
    assert envs.VALUE_CHECKS["PAGEDLLM_CPU_MAX_ISA"]("sse4") is not None
