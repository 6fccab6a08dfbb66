"""The builds the native-kernel tests run on.

A test module that asks for the `build` fixture (test_quant_kernels.py, test_sgemm.py,
test_elementwise.py, test_attention_kernel.py, through `pytestmark`) runs every test on
the library `native.kernels()` builds for this machine (-march=native), on a portable
build of the same sources without -march (the scalar fallback on x86-64), and, where this
machine's build has AVX-512, on the AVX2-only build of PAGEDLLM_CPU_MAX_ISA=avx2 (Zen 3's paths).
"""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest

from pagedllm.ops.cpu import features, native

pytest.register_assert_rewrite("kernel_checks")


@pytest.fixture(scope="session")
def portable_lib(tmp_path_factory):
    """The same sources built without -march=native (so without AVX2 on x86-64)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    target = tmp_path_factory.mktemp("portable-kernels") / "cpu_kernels_portable.so"
    mp = pytest.MonkeyPatch()
    mp.setattr(native, "FLAGS", [f for f in native.FLAGS if not f.startswith("-march")])
    try:
        native._build(compiler, target)
    except RuntimeError as exc:
        pytest.fail(f"the portable build of csrc/*.c failed: {exc}")
    finally:
        mp.undo()
    lib = ctypes.CDLL(str(target))
    for name, (restype, argtypes) in native._SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def pytest_generate_tests(metafunc):
    if "build" in metafunc.fixturenames:
        metafunc.parametrize("build", ["built", "portable", "avx2"], indirect=True)


@pytest.fixture
def build(request, monkeypatch):
    """Route every wrapper in `native` through one of the two libraries."""
    variant = getattr(request, "param", "built")
    if variant == "portable":
        lib = request.getfixturevalue("portable_lib")
        if lib.pd_has_avx2():
            pytest.skip("this compiler targets AVX2 by default: the portable build is the built one")
        monkeypatch.setattr(native, "kernels", lambda: lib)
    elif variant == "avx2":
        if "avx512f" not in features.detect().flags:
            pytest.skip("this machine's build is AVX2 at most: the AVX2 build is the built one")
        request.getfixturevalue("avx2_build")
    return variant
