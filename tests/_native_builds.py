"""Other builds of the native CPU kernels than the one `native.kernels()` makes for this
machine, so one machine's tests also run the paths other CPUs take: a portable build (no
-march: the scalar fallbacks) and an AVX2-only build (-march=x86-64-v3: what a Zen 3 runs,
without AVX-512, AMX or AVX512-VNNI)."""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import pytest

from pagedllm.ops.cpu import features, native

# cpuinfo flags an x86-64-v3 build may use (beside the SSE family)
AVX2_BUILD_NEEDS = frozenset({"avx2", "fma", "f16c", "bmi2"})


def build_library(target: Path, march: str | None) -> ctypes.CDLL:
    """csrc/*.c built into `target` with -march=`march` (None: no -march at all), loaded with
    native's signatures; fails the test where the build fails."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    mp = pytest.MonkeyPatch()
    flags = [f for f in native.FLAGS if not f.startswith("-march")] + ([f"-march={march}"] if march else [])
    mp.setattr(native, "FLAGS", flags)
    try:
        native._build(compiler, target)
    except RuntimeError as exc:
        pytest.fail(f"the {march or 'portable'} build of csrc/*.c failed: {exc}")
    finally:
        mp.undo()
    lib = ctypes.CDLL(str(target))
    for name, (restype, argtypes) in native._SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def avx2_only_features() -> features.CpuFeatures:
    """This CPU's flags without those an x86-64-v3 build leaves unused (AVX-512, AMX, AVX-VNNI),
    so choices made from the flags match the AVX2-only library."""
    cpu = features.detect()
    dropped = ("avx512", "amx", "avx_vnni")
    return features.CpuFeatures(f"{cpu.model} (as AVX2 only)",
                                frozenset(f for f in cpu.flags if not f.startswith(dropped)))
