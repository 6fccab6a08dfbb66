"""Helpers shared by the native-kernel tests (test_build.py, test_quant_kernels.py,
test_sgemm.py, test_elementwise.py, test_attention_kernel.py); the two builds every
kernel test runs on are in conftest.py."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops.cpu import native


def require_native() -> None:
    """Skip the calling test module (call it at module level) where the kernels are not built."""
    if not native.available():
        pytest.skip("native CPU kernels unavailable here (no C compiler, the build failed, or PAGEDLLM_CPU_KERNELS=0)",
                    allow_module_level=True)


def assert_close_to(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor | float, what: str) -> None:
    err = (got.double() - expected.double()).abs()
    bad = err > bound
    assert torch.isfinite(got).all(), f"{what}: non-finite values at {(~torch.isfinite(got)).nonzero()[:5].tolist()}"
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        pytest.fail(f"{what}: {int(bad.sum())} of {bad.numel()} elements off; first at {idx}: "
                    f"got {got[tuple(idx)].item()!r}, expected {expected[tuple(idx)].item()!r}, "
                    f"max error {err.max().item():.3g}")
