"""Other ggml block types rewritten as the 32-value blocks the native CPU kernels read.

Why: the native kernels (csrc/quant.c, vnni.c; `native.SUPPORTED_QTYPES`) read Q4_0, Q4_1
and Q8_0 only, while most GGUF files people download are K-quants (Q4_K_M: Q4_K with
Q6_K for v, half of ffn_down and the output head). Without a kernel, their decode steps
multiplied the dense copy: on a 2-core Zen 4, Qwen2.5-Coder-1.5B Q4_K_M streamed at half of
llama.cpp's rate, reading ~3 GB of bf16 per token instead of ~1 GB of blocks.

Numerics (a rounding, so only where float32 matmuls may round: `--dtype auto` on quantized
weights, i.e. "medium" precision; `--dtype float32` keeps the exact dense path):

* Q4_K -> Q4_1: a Q4_K sub-block of 32 values is already d * sc * q - dmin * m with 4-bit q;
  the codes are kept, and d * sc and -dmin * m (exact in float32) are rounded to the f16
  fields of Q4_1 (relative error 2^-11, or 2^-25 absolute where they fall below f16's
  normal range). The blocks stay 4-bit: 5 bits per weight against the file's 4.5.
* every other type the kernels do not read (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, Q6_K) -> Q8_0:
  the exact values are re-quantized per 32 values with the scale (the block's largest
  magnitude / 127) rounded up to f16, so each value moves by at most half that step. Q6_K's
  own step is about a quarter of it (1/31 of its 16-value sub-block's largest magnitude), so
  its RMS rounding noise grows by ~3%, ~12% where the block's two halves differ 2x in range.
  8.5 bits per weight against Q6_K's 6.56.

The dense copy, where there is one, is still dequantized from the file's own blocks, so
large batches are unaffected.
"""

from __future__ import annotations

import torch

from pagedllm.ops.cpu import native
from pagedllm.plugins.quant.gguf_dequant import dequantize, k_scales_mins, runs_natively
from pagedllm.plugins.quant.gguf_file import BLOCK_LAYOUTS, FLOAT_TYPES, Q4_1, Q4_K, Q8_0, QK_K


def target_type(qtype: int) -> int | None:
    """The 32-value type `as_native_blocks` turns `qtype` into (itself when the kernels read
    it), or None for float tensors and types without a conversion."""
    if qtype in native.SUPPORTED_QTYPES:
        return qtype
    if qtype == Q4_K:
        return Q4_1
    if qtype in BLOCK_LAYOUTS and qtype not in FLOAT_TYPES:
        return Q8_0
    return None


def as_native_blocks(raw: torch.Tensor, qtype: int, cols: int,
                     values: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
    """uint8 rows [N, bytes per row] of `qtype` -> (type, rows) of a type the native kernels
    read, converted as the module docstring says (unchanged when they read `qtype`).
    `values`: the rows' exact float32 values [N, cols], where the caller has them already
    (the dense copy), so a re-quantization need not dequantize again."""
    target = target_type(qtype)
    if target is None:
        raise ValueError(f"ggml type {qtype} has no 32-value block form for the native kernels")
    if target == qtype:
        return qtype, raw
    if cols % 32 != 0:
        raise ValueError(f"rows of {cols} values are not whole 32-value blocks")
    if target == Q4_1:
        return Q4_1, q4_k_as_q4_1(raw, cols)
    if values is None or values.dtype != torch.float32:
        values = dequantize(raw, qtype, (raw.shape[0], cols))
    return Q8_0, as_q8_0(values)


def _round_up_f16(x: torch.Tensor) -> torch.Tensor:
    """The smallest f16 >= x, for x >= 0 (a scale that never makes a code overflow)."""
    h = x.half()
    low = h.float() < x
    if low.any():
        h[low] = torch.nextafter(h[low], torch.tensor(float("inf"), dtype=torch.float16))
    return h


def as_q8_0(values: torch.Tensor) -> torch.Tensor:
    """float32 rows [N, K] (K a multiple of 32) -> Q8_0 rows [N, K / 32 * 34]: per block, d
    = max |x| / 127 rounded up to f16 and codes round(x / d) in [-127, 127]."""
    if runs_natively(values):
        return native.as_q8_0(values)
    return as_q8_0_torch(values)


def as_q8_0_torch(values: torch.Tensor) -> torch.Tensor:
    """`as_q8_0` in torch ops (other devices, and the tests' oracle)."""
    n, k = values.shape
    blocks = values.reshape(-1, 32)
    # max |x| without an |x| copy of the weight (load time is memory-bound)
    amax = torch.maximum(blocks.amax(dim=1, keepdim=True), blocks.amin(dim=1, keepdim=True).neg_())
    if not torch.isfinite(amax).all():
        raise ValueError("cannot re-quantize a weight holding NaN or infinity to Q8_0")
    d = _round_up_f16(amax / 127)
    if torch.isinf(d).any():
        raise ValueError("a weight block's magnitude is beyond f16's range: no Q8_0 scale for it")
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(amax))
    codes = torch.mul(blocks, inv).round_().clamp_(-127, 127).to(torch.int8)
    out = torch.cat((d.view(torch.uint8), codes.view(torch.uint8)), dim=1)
    return out.reshape(n, k // 32 * BLOCK_LAYOUTS[Q8_0][1])


def q4_k_as_q4_1(raw: torch.Tensor, cols: int) -> torch.Tensor:
    """Q4_K rows -> Q4_1 rows (8 blocks of 20 bytes per 144-byte super-block): the codes as
    they are, d * sc and -dmin * m rounded to f16."""
    if runs_natively(raw):
        return native.q4_k_as_q4_1(raw.reshape(raw.shape[0], -1))
    return q4_k_as_q4_1_torch(raw, cols)


def q4_k_as_q4_1_torch(raw: torch.Tensor, cols: int) -> torch.Tensor:
    """`q4_k_as_q4_1` in torch ops (other devices, and the tests' oracle)."""
    n = raw.shape[0]
    b = raw.reshape(-1, BLOCK_LAYOUTS[Q4_K][1])
    scales, mins = k_scales_mins(b)  # float32 [blocks, 8, 1], exact products
    d = scales.squeeze(-1).half().view(torch.uint8).reshape(-1, 8, 2)
    m = mins.squeeze(-1).neg().half().view(torch.uint8).reshape(-1, 8, 2)
    qs = b[:, 16:144].reshape(-1, 4, 32)  # chunk i: values 64i + t (low nibble), 64i + 32 + t (high)
    codes = torch.stack((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 8, 32)  # sub-block j: its 32 codes
    packed = codes[:, :, :16] | (codes[:, :, 16:] << 4)  # Q4_1: value t low, value t + 16 high
    out = torch.cat((d, m, packed), dim=2)
    return out.reshape(n, cols // QK_K * 8 * BLOCK_LAYOUTS[Q4_1][1])
