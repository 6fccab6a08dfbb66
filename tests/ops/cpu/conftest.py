"""The builds the native-kernel tests run on.

A test module that asks for the `build` fixture (test_quant_kernels.py, test_sgemm.py,
test_elementwise.py, test_attention_kernel.py, through `pytestmark`) runs every test on
the library `native.kernels()` builds for this machine (-march=native), on a portable
build of the same sources without -march (the scalar fallback on x86-64), and, where this
machine's build has AVX-512, on an AVX2-only build (-march=x86-64-v3: Zen 3's paths).
"""

from __future__ import annotations

import pytest

from pagedllm.ops.cpu import features, native
from tests._native_builds import build_library

pytest.register_assert_rewrite("kernel_checks")


@pytest.fixture(scope="session")
def portable_lib(tmp_path_factory):
    """The same sources built without -march=native (so without AVX2 on x86-64)."""
    return build_library(tmp_path_factory.mktemp("portable-kernels") / "cpu_kernels_portable.so", None)


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
