"""Dequantizers for ggml's block formats, written as vectorized torch ops.

One implementation serves both modes: at load time (bytes from the mapped file, on the
CPU) and per forward pass in keep-quantized mode (raw blocks held on the model's
device). Each kernel takes a uint8 tensor [num_blocks, type_size] and returns float32
[num_blocks, block_size]; `dequantize` handles rows and shapes. Block layouts follow
ggml's `ggml-common.h` (struct block_q4_K etc.); the K-quants use super-blocks of 256
values with 6-bit (Q4_K/Q5_K), 4-bit (Q2_K) or int8 (Q6_K) sub-block scales.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

QK_K = 256

# ggml type ids (the `type` field of a GGUF tensor info).
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30

TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
    34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 stored at byte `start` of each block, as float32 [num_blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2, n]: low nibbles first, then high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _bits(packed: torch.Tensor, num_bits: int) -> torch.Tensor:
    """[..., n] bytes -> [..., num_bits, n]: bit i of every byte (ggml stores high bits
    of element l of sub-block i at bit i of qh[l])."""
    shifts = torch.arange(num_bits, device=packed.device, dtype=torch.uint8).view(-1, 1)
    return (packed.unsqueeze(-2) >> shifts) & 1


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[:, 2:34].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:18]).reshape(-1, 32).float() - 8
    return _f16(b, 0) * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:20]).reshape(-1, 32).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    # 32 high bits as a little-endian u32: element e uses bit e.
    return _bits(qh, 8).transpose(-1, -2).reshape(-1, 32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:22]).reshape(-1, 32) | (_q5_high(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:24]).reshape(-1, 32) | (_q5_high(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (float32 [n, 8])."""
    s0, s1, s2 = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat((s0 & 63, (s2 & 0x0F) | ((s0 >> 6) << 4)), dim=1)
    mins = torch.cat((s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)), dim=1)
    return scales.float(), mins.float()


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc = b[:, 0:16].reshape(n, 2, 4, 2, 1)  # (half of 128, shift, 16-group, ·)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(1, 1, 4, 1)
    q = ((b[:, 16:80].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 2, 4, 2, 16)
    d, dmin = _f16(b, 80).view(n, 1, 1, 1, 1), _f16(b, 82).view(n, 1, 1, 1, 1)
    y = d * (sc & 0x0F).float() * q.float() - dmin * (sc >> 4).float()
    return y.reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, s = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    idx = torch.arange(16, device=b.device)
    low = (s[:, idx % 8] >> (4 * (idx // 8)).to(torch.uint8)) & 0x0F
    high = (s[:, 8 + idx % 4] >> (2 * (idx // 4)).to(torch.uint8)) & 3
    scales = ((low | (high << 4)).float() - 32).reshape(n, 2, 4, 2, 1)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(1, 1, 4, 1)
    q = (qs.reshape(n, 2, 1, 32) >> shifts) & 3
    hbit_pos = torch.arange(8, device=b.device, dtype=torch.uint8).view(1, 2, 4, 1)
    hbit = (hmask.reshape(n, 1, 1, 32) >> hbit_pos) & 1
    q = q.float() - 4 * (1 - hbit.float())
    return (_f16(b, 108).view(n, 1, 1, 1, 1) * scales * q.reshape(n, 2, 4, 2, 16)).reshape(n, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, mins = _k_scales_mins(b[:, 4:16])
    q = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    y = _f16(b, 0).view(n, 1, 1) * scales.unsqueeze(-1) * q - _f16(b, 2).view(n, 1, 1) * mins.unsqueeze(-1)
    return y.reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, mins = _k_scales_mins(b[:, 4:16])
    q = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32) | (_bits(b[:, 16:48], 8) << 4)
    y = _f16(b, 0).view(n, 1, 1) * scales.unsqueeze(-1) * q.float() - _f16(b, 2).view(n, 1, 1) * mins.unsqueeze(-1)
    return y.reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # (half of 256, first/second 32 bytes, l)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2)  # (half, group g = 0..3, l)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(1, 1, 4, 1)
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3
    q = ((low | (high << 4)).float() - 32).reshape(n, 2, 4, 2, 16)
    sc = b[:, 192:208].contiguous().view(torch.int8).float().reshape(n, 2, 4, 2, 1)
    return (_f16(b, 208).view(n, 1, 1, 1, 1) * sc * q).reshape(n, QK_K)


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def _f16_type(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


# type id -> (values per block, bytes per block, kernel)
KERNELS: dict[int, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    F32: (1, 4, _f32), F16: (1, 2, _f16_type), BF16: (1, 2, _bf16),
    Q8_0: (32, 34, _q8_0), Q4_0: (32, 18, _q4_0), Q4_1: (32, 20, _q4_1),
    Q5_0: (32, 22, _q5_0), Q5_1: (32, 24, _q5_1),
    Q2_K: (QK_K, 84, _q2_k), Q3_K: (QK_K, 110, _q3_k), Q4_K: (QK_K, 144, _q4_k),
    Q5_K: (QK_K, 176, _q5_k), Q6_K: (QK_K, 210, _q6_k),
}
FLOAT_TYPES = frozenset({F32, F16, BF16})


def type_name(qtype: int) -> str:
    return TYPE_NAMES.get(qtype, f"unknown type {qtype}")


def check_supported(qtype: int, where: str) -> tuple[int, int]:
    """(block size, type size) of a supported type; otherwise a ValueError naming `where`."""
    if qtype not in KERNELS:
        supported = ", ".join(type_name(t) for t in KERNELS)
        raise ValueError(f"{where} has tensor type {type_name(qtype)}, which pagedllm cannot dequantize "
                         f"(supported: {supported})")
    block_size, type_size, _ = KERNELS[qtype]
    return block_size, type_size


def tensor_nbytes(qtype: int, shape: Sequence[int], where: str) -> int:
    """Bytes of a tensor of numpy `shape`; its last dim must be a whole number of blocks."""
    block_size, type_size = check_supported(qtype, where)
    if shape and shape[-1] % block_size:
        raise ValueError(f"{where}: row length {shape[-1]} is not a multiple of the "
                         f"{type_name(qtype)} block size {block_size} (corrupt file?)")
    return int(np.prod(shape, dtype=np.int64)) // block_size * type_size


def dequantize(raw: torch.Tensor, qtype: int, shape: Sequence[int]) -> torch.Tensor:
    """Raw ggml bytes (uint8, any shape, rows contiguous) -> float32 tensor of `shape`."""
    block_size, type_size = check_supported(qtype, "tensor")
    blocks = raw.reshape(-1, type_size)
    out = KERNELS[qtype][2](blocks)
    return out.reshape(tuple(shape))


def dequantize_numpy(data: np.ndarray, qtype: int, shape: Sequence[int]) -> torch.Tensor:
    """Like `dequantize` for bytes from the mapped file (copied first: the map is read-only)."""
    return dequantize(torch.from_numpy(np.array(data, dtype=np.uint8, copy=True)), qtype, shape)
