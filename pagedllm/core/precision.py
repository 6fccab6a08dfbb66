"""How exact float32 matmuls must be while a model's weights are packed.

torch's `set_float32_matmul_precision` idea, scoped to model loading: "highest" means
float32 products everywhere; "medium" lets a `pack_linear` implementation multiply
float32 activations by a bf16 copy of the weight (bf16 products, float32 sums, the
result rounded to bf16 before it returns as float32) where that measures faster on the
hardware. Activations, norms, attention and the KV cache stay float32 either way.

The worker picks it (`resolve`) and holds it with `matmul_precision()` while it builds and
loads the model; implementations read `float32_matmul_precision()` when they pack.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

PRECISIONS = ("highest", "medium")
_current = ["highest"]


def float32_matmul_precision() -> str:
    """The precision in force: "highest" outside `matmul_precision()`."""
    return _current[-1]


@contextlib.contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """Hold `precision` for the packs made inside the block (nestable)."""
    if precision not in PRECISIONS:
        raise ValueError(f"float32 matmul precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    _current.append(precision)
    try:
        yield
    finally:
        _current.pop()


def resolve(setting: str | None, requested_dtype: str, quantized: bool) -> tuple[str, str]:
    """(precision, why) for a model load.

    `setting`: PAGEDLLM_FLOAT32_MATMUL_PRECISION ("auto", "highest", "medium" or None).
    Under "auto", "medium" is chosen only where nothing asked for float32 products:
    `--dtype auto` on a quantized checkpoint that runs in float32 (GGUF: its weights are
    4-8-bit blocks, whose quantization error is ~30x bf16's rounding, and llama.cpp itself
    rounds activations to int8 for them). A float32 checkpoint or `--dtype float32` keeps
    "highest".
    """
    if setting not in (None, "", "auto"):
        if setting not in PRECISIONS:
            raise ValueError(f"PAGEDLLM_FLOAT32_MATMUL_PRECISION must be auto, highest or medium, got {setting!r}")
        return setting, "PAGEDLLM_FLOAT32_MATMUL_PRECISION"
    if requested_dtype != "auto":
        return "highest", f"--dtype {requested_dtype}"
    if not quantized:
        return "highest", "--dtype auto on a float32 checkpoint"
    return "medium", "--dtype auto on quantized weights"
