"""Dequantizers for ggml's block formats, written as vectorized torch ops (K-quants on the
CPU: the native kernel that computes the same values, see `dequantize`).

One implementation serves both modes: at load time (bytes from the mapped file, on the
CPU) and per forward pass in keep-quantized mode (raw blocks held on the model's
device). Each kernel takes a uint8 tensor [num_blocks, type_size] and returns float32
[num_blocks, block_size]; `dequantize` handles rows and shapes. Block layouts follow
ggml's `ggml-common.h` (struct block_q4_K etc.); the K-quants use super-blocks of 256
values with 6-bit (Q4_K/Q5_K), 4-bit (Q2_K) or int8 (Q6_K) sub-block scales.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from pagedllm.ops.cpu import native

from pagedllm.plugins.quant.gguf_file import (  # noqa: F401  (re-exported type ids)
    BF16, BLOCK_LAYOUTS, F16, F32, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, QK_K,
    check_supported, tensor_nbytes, type_name,
)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 stored at byte `start` of each block, as float32 [num_blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(packed: torch.Tensor, num_bits: int) -> torch.Tensor:
    """[..., n] bytes -> [..., num_bits, n]: bit i of every byte (ggml stores high bits
    of element l of sub-block i at bit i of qh[l])."""
    shifts = torch.arange(num_bits, device=packed.device, dtype=torch.uint8).view(-1, 1)
    return (packed.unsqueeze(-2) >> shifts) & 1


def _crumbs(packed: torch.Tensor) -> torch.Tensor:
    """[..., 1, n] bytes -> [..., 4, n]: the four 2-bit fields of every byte, low first."""
    shifts = torch.tensor([0, 2, 4, 6], device=packed.device, dtype=torch.uint8).view(-1, 1)
    return (packed >> shifts) & 3


# Kernels below use in-place arithmetic on the one float buffer they allocate: at load
# time and, more so, per call in keep-quantized mode, memory traffic is the cost.

def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:34].contiguous().view(torch.int8).float().mul_(_f16(b, 0))


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 2:18]).float().sub_(8).mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(_f16(b, 2), _nibbles(b[:, 4:20]).float(), _f16(b, 0))


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    # 32 high bits as a little-endian u32: element e uses bit e.
    return _bits(qh, 8).transpose(-1, -2).reshape(-1, 32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:22]) | (_q5_high(b[:, 2:6]) << 4)
    return q.float().sub_(16).mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:24]) | (_q5_high(b[:, 4:8]) << 4)
    return torch.addcmul(_f16(b, 2), q.float(), _f16(b, 0))


def k_scales_mins(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: d, dmin and 12 bytes of 6-bit fields -> (d * scale, dmin * min) as
    float32 [n, 8, 1], one per 32-value sub-block."""
    s = b[:, 4:16]
    s0, s1, s2 = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat((s0 & 63, (s2 & 0x0F) | ((s0 >> 6) << 4)), dim=1).float().mul_(_f16(b, 0))
    mins = torch.cat((s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)), dim=1).float().mul_(_f16(b, 2))
    return scales.unsqueeze(-1), mins.unsqueeze(-1)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc = b[:, 0:16].reshape(n, 2, 4, 2, 1)  # (half of 128, shift, 16-group, ·)
    q = _crumbs(b[:, 16:80].reshape(n, 2, 1, 32)).reshape(n, 2, 4, 2, 16).float()
    d, dmin = _f16(b, 80).view(n, 1, 1, 1, 1), _f16(b, 82).view(n, 1, 1, 1, 1)
    y = q.mul_((sc & 0x0F).float().mul_(d)).sub_((sc >> 4).float().mul_(dmin))
    return y.reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, s = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    idx = torch.arange(16, device=b.device)
    low = (s[:, idx % 8] >> (4 * (idx // 8)).to(torch.uint8)) & 0x0F
    high = (s[:, 8 + idx % 4] >> (2 * (idx // 4)).to(torch.uint8)) & 3
    scales = (low | (high << 4)).float().sub_(32).mul_(_f16(b, 108)).reshape(n, 2, 4, 2, 1)
    hbit_pos = torch.arange(8, device=b.device, dtype=torch.uint8).view(1, 2, 4, 1)
    missing_high = 1 - ((hmask.reshape(n, 1, 1, 32) >> hbit_pos) & 1)  # subtract 4 when the bit is clear
    q = _crumbs(qs.reshape(n, 2, 1, 32)).float().sub_(missing_high.float().mul_(4))
    return q.reshape(n, 2, 4, 2, 16).mul_(scales).reshape(n, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, mins = k_scales_mins(b)
    q = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return q.mul_(scales).sub_(mins).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, mins = k_scales_mins(b)
    q = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32) | (_bits(b[:, 16:48], 8) << 4)
    return q.float().mul_(scales).sub_(mins).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # (half of 256, first/second 32 bytes, l)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2)  # (half, group g = 0..3, l)
    high = _crumbs(b[:, 128:192].reshape(n, 2, 1, 32))
    sc = b[:, 192:208].contiguous().view(torch.int8).float().mul_(_f16(b, 208)).reshape(n, 2, 4, 2, 1)
    q = (low | (high << 4)).float().sub_(32).reshape(n, 2, 4, 2, 16)
    return q.mul_(sc).reshape(n, QK_K)


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def _f16_type(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


KERNELS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    F32: _f32, F16: _f16_type, BF16: _bf16, Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0,
    Q5_1: _q5_1, Q2_K: _q2_k, Q3_K: _q3_k, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k,
}
if set(KERNELS) != set(BLOCK_LAYOUTS):  # a layout without a kernel would fail late, at load
    raise ImportError("gguf_dequant: KERNELS and gguf_file.BLOCK_LAYOUTS list different types")


def runs_natively(t: torch.Tensor) -> bool:
    """Whether a load-time conversion of `t` runs in the native kernels (csrc/blocks.c: the
    same values as this module's and gguf_blocks32.py's torch ops, without their full-size
    temporaries): a CPU tensor, where the kernels are built."""
    return t.device.type == "cpu" and native.available()


def dequantize(raw: torch.Tensor, qtype: int, shape: Sequence[int]) -> torch.Tensor:
    """Raw ggml bytes (uint8, any shape, rows contiguous) -> float32 tensor of `shape`.

    K-quants on the CPU go through the native kernel (`native.dequantize_k`: the same
    values, computed without this module's full-size temporaries; ~10x faster, what a
    Q4_K_M file's load spent most of its time on)."""
    _, type_size = check_supported(qtype, "tensor")
    if qtype in native.K_QUANT_BYTES and runs_natively(raw):
        return native.dequantize_k(raw, qtype).reshape(tuple(shape))
    out = KERNELS[qtype](raw.reshape(-1, type_size))
    return out.reshape(tuple(shape))


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    # Load-time dequantization is a few memory-bound elementwise ops per tensor. With
    # intra-op threads on a busy machine, OpenMP barriers spin: measured 10x the CPU
    # time and wall time of one thread on 2 shared cores, for no gain when idle.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def dequantize_numpy(data: np.ndarray, qtype: int, shape: Sequence[int]) -> torch.Tensor:
    """Like `dequantize`, for bytes from the mapped file at load time (copied first: the
    map is read-only), on one thread."""
    with _one_thread():
        return dequantize(torch.from_numpy(np.array(data, dtype=np.uint8, copy=True)), qtype, shape)
