"""How exact float32 matmuls must be while a model's weights are packed.

torch's `set_float32_matmul_precision` idea, scoped to model loading: "highest" means
float32 products everywhere; "medium" lets a `pack_linear` implementation multiply
float32 activations by a bf16 copy of the weight (bf16 products, float32 sums, the
result rounded to bf16 before it returns as float32) where that measures faster on the
hardware. Activations, norms, attention and the KV cache stay float32 either way.

A bf16 (or float16) checkpoint run with `--dtype auto` on the CPU computes in float32
too, but its dense weights keep their 16 bits (`dense_weight_dtype()` is bf16 while it
loads): bf16 products of bf16 weights lose nothing on the weight side, and float32
activations round less than the checkpoint's dtype would everywhere else, while every op of
a step stays on the float32 kernels (one native step) and the weights take the checkpoint's
bytes, not twice as many.

The worker picks it (`resolve`) and holds it with `matmul_precision()` while it builds and
loads the model; implementations read `float32_matmul_precision()` and
`dense_weight_dtype()` when they create and pack weights.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

PRECISIONS = ("highest", "medium")
_current = ["highest"]
_dense_weights: list[torch.dtype | None] = [None]


def float32_matmul_precision() -> str:
    """The precision in force: "highest" outside `matmul_precision()`."""
    return _current[-1]


def dense_weight_dtype() -> torch.dtype | None:
    """The dtype an unquantized checkpoint's dense weights (linear layers, experts) are
    created in under this load, whatever the compute dtype; None: the compute dtype."""
    return _dense_weights[-1]


@contextlib.contextmanager
def matmul_precision(precision: str, dense_weights: torch.dtype | None = None) -> Iterator[None]:
    """Hold `precision` (and the dense weights' dtype) for the weights created and packed
    inside the block (nestable)."""
    if precision not in PRECISIONS:
        raise ValueError(f"float32 matmul precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    _current.append(precision)
    _dense_weights.append(dense_weights)
    try:
        yield
    finally:
        _current.pop()
        _dense_weights.pop()


def resolve(setting: str | None, requested_dtype: str, quantized: bool,
            half_weights: bool = False) -> tuple[str, str]:
    """(precision, why) for a model load.

    `setting`: PAGEDLLM_FLOAT32_MATMUL_PRECISION ("auto", "highest", "medium" or None).
    Under "auto", "medium" is chosen only where nothing asked for float32 products:
    `--dtype auto` on a quantized checkpoint that runs in float32 (GGUF: its weights are
    4-8-bit blocks, whose quantization error is ~30x bf16's rounding, and llama.cpp itself
    rounds activations to int8 for them), or on a bf16 / float16 checkpoint run in float32
    (`half_weights`: its weights are 16-bit already). A float32 checkpoint or `--dtype
    float32` keeps "highest".
    """
    if setting not in (None, "", "auto"):
        if setting not in PRECISIONS:
            raise ValueError(f"PAGEDLLM_FLOAT32_MATMUL_PRECISION must be auto, highest or medium, got {setting!r}")
        return setting, "PAGEDLLM_FLOAT32_MATMUL_PRECISION"
    if requested_dtype != "auto":
        return "highest", f"--dtype {requested_dtype}"
    if half_weights:
        return "medium", "--dtype auto on a 16-bit checkpoint: its weights stay bf16, activations float32"
    if not quantized:
        return "highest", "--dtype auto on a float32 checkpoint"
    return "medium", "--dtype auto on quantized weights"
