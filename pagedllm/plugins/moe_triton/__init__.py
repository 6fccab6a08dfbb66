"""The routed experts' grouped GEMM in Triton (kernels.py) as the CUDA implementation of
`ops.fused_moe`. Triton is imported only when the op first runs on a GPU; on the CPU the
check refuses (the kernel runs there only interpreted, in tests), so serving on the CPU
keeps the torch reference."""

from __future__ import annotations

import importlib.util

import torch

from pagedllm import hookimpl
from pagedllm.core.contracts import OpImpl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(device: torch.device, dtype: torch.dtype) -> list[str]:
    reasons = []
    if device.type != "cuda":
        reasons.append("CUDA tensors only (on the CPU Triton only runs interpreted)")
    if dtype not in _DTYPES:
        reasons.append(f"float32, float16 or bfloat16 only, not {dtype}")
    if importlib.util.find_spec("triton") is None:
        reasons.append("triton is not installed")
    return reasons


def _fused_moe(*args, **kwargs):
    from pagedllm.plugins.moe_triton.kernels import fused_moe

    return fused_moe(*args, **kwargs)


@hookimpl
def pagedllm_op_impls():
    return [OpImpl(op="fused_moe", name="moe_triton", fn=_fused_moe, check=_check)]
