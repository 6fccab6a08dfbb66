"""Writing AWQ and GPTQ checkpoints for tests, independently of the plugins' readers.

The packers follow the formats' own exporters (AutoAWQ's WQLinear_GEMM.from_linear,
AutoGPTQ's QuantLinear.pack) word by word, with numpy's unsigned arithmetic; the
reference weights are dequantized here from the integer codes, never by the code
under test. `quantized_checkpoint` turns a float Hugging Face directory into a
quantized one beside a float directory holding the dequantized weights (what
transformers runs as the reference).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests._checkpoints import split_linears, write_pair

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i holds column order_map[i] of the 8


def quantize(w: torch.Tensor, bits: int, g_idx: torch.Tensor, sym: bool):
    """Round-to-nearest codes q [N, K], fp16 scales s [N, G] and integer zeros z [N, G]
    with w ~ s[:, g_idx] * (q - z[:, g_idx]); asymmetric zeros stay >= 1 (GPTQ v1 stores
    zero - 1)."""
    top = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    n = w.shape[0]
    s = torch.empty(n, groups)
    z = torch.empty(n, groups, dtype=torch.int64)
    for gi in range(groups):
        cols = w[:, g_idx == gi]
        if sym:
            half = 1 << (bits - 1)
            s[:, gi] = cols.abs().amax(1).clamp(min=1e-6) / (half - 1)
            z[:, gi] = half
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s[:, gi] = ((hi - lo) / (top - 1)).clamp(min=1e-6)
            z[:, gi] = (1 - lo / s[:, gi]).round().clamp(1, top).long()
    s = s.half()
    q = (w / s.float()[:, g_idx]).round().long() + z[:, g_idx]
    return q.clamp(0, top), s, z


def dequantize(q, s, z, g_idx) -> torch.Tensor:
    return (q - z[:, g_idx]).float() * s.float()[:, g_idx]


def _words(values: np.ndarray) -> torch.Tensor:
    """uint64 words below 2^32 -> int32 with the same bits."""
    return torch.from_numpy(values.astype(np.uint32).view(np.int32).copy())


def pack_awq(q, s, z) -> dict[str, torch.Tensor]:
    intweight = q.t().numpy().astype(np.uint64)  # [K, N]
    zeros = z.t().numpy().astype(np.uint64)  # [G, N]
    qweight = np.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=np.uint64)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 8), dtype=np.uint64)
    for col in range(qweight.shape[1]):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + AWQ_PACK_ORDER[i]] << np.uint64(4 * i)
            qzeros[:, col] |= zeros[:, col * 8 + AWQ_PACK_ORDER[i]] << np.uint64(4 * i)
    return {"qweight": _words(qweight), "qzeros": _words(qzeros), "scales": s.t().contiguous()}


def pack_gptq(q, s, z, g_idx, bits: int) -> dict[str, torch.Tensor]:
    per_word = 32 // bits
    intweight = q.t().numpy().astype(np.uint64)  # [K, N]
    stored = (z.t().numpy() - 1).astype(np.uint64) & np.uint64((1 << bits) - 1)  # v1: zero - 1
    qweight = np.zeros((intweight.shape[0] // per_word, intweight.shape[1]), dtype=np.uint64)
    for row in range(qweight.shape[0]):
        for j in range(per_word):
            qweight[row] |= intweight[row * per_word + j] << np.uint64(bits * j)
    qzeros = np.zeros((stored.shape[0], stored.shape[1] // per_word), dtype=np.uint64)
    for col in range(qzeros.shape[1]):
        for j in range(per_word):
            qzeros[:, col] |= stored[:, col * per_word + j] << np.uint64(bits * j)
    return {"qweight": _words(qweight), "qzeros": _words(qzeros), "scales": s.t().contiguous(),
            "g_idx": g_idx.to(torch.int32)}


def quantized_checkpoint(src: Path, out: Path, ref: Path, fmt: str, bits: int = 4, group: int = 32,
                         sym: bool = False, act_order: bool = False, skip: tuple[str, ...] = (),
                         seed: int = 0) -> None:
    """`src` (float HF dir) -> `out` in `fmt` ("awq" | "gptq") and `ref` (the dequantized
    weights as a float32 HF dir). Layers whose checkpoint name contains a `skip` entry
    stay float; GPTQ layers get the all-zero biases its exporters write."""
    gen = torch.Generator().manual_seed(seed)
    quant, dense, linears = split_linears(src, skip)
    for name, prefix, w in linears:
        k = w.shape[1]
        g = k if group == -1 else group
        if act_order:
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[torch.randperm(k, generator=gen)] = torch.arange(k) // g
        else:
            g_idx = torch.arange(k) // g
        q, s, z = quantize(w, bits, g_idx, sym)
        dense[name] = dequantize(q, s, z, g_idx)
        packed = pack_awq(q, s, z) if fmt == "awq" else pack_gptq(q, s, z, g_idx, bits)
        for key, value in packed.items():
            quant[f"{prefix}.{key}"] = value
        if fmt == "gptq":
            quant[f"{prefix}.bias"] = torch.zeros(w.shape[0], dtype=torch.float16)
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": list(skip) or None}
    else:
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": sym,
              "checkpoint_format": "gptq", "modules_to_not_convert": list(skip) or None}
    write_pair(src, out, ref, quant, dense, qc)
