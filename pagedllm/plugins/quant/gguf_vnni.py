"""Q4_0 / Q4_1 / Q8_0 (and Q4_K as stored) blocks in csrc/vnni.c's panels, for the few-row
calls of decode and speculative verify steps: on AVX512-VNNI, or in the kernel's AVX2 form
(u8 x s8 pair products, `maddubs`) on CPUs without it, such as Zen 3.

The native float32-exact kernel (quant.c) splits every activation into two int16 terms
and costs nearly as much per extra row as for the first; VNNI's u8 x s8 dot products on
block integers in [-8191, 8191] make one row 3-4x cheaper on a Zen 4 and each more row cheaper
still (SmolLM2's 3072 x 576 Q4_1 layer, 2 threads, weights from memory: ~100 us at 1 row
against ~145, ~190 at 8 rows against ~385). The activations are rounded, so this serves
only under "medium" float32 matmul precision (where bf16 products are allowed too), and
only where the crossover measured it faster at load, like every other kernel choice. The
AVX2 form reads the same panels with the same numerics (2.0-2.2x the native kernel's speed
on SmolLM2's Q4_1 layers at 1-64 rows on a 2-vCPU Xeon under PAGEDLLM_CPU_MAX_ISA=avx2).
"""

from __future__ import annotations

from typing import Sequence

import torch

from pagedllm.core import envs
from pagedllm.ops.cpu import native


def available() -> bool:
    return native.vnni_available()


def int8_activations() -> bool:
    """Whether the VNNI kernel rounds activations to int8 per 32-value block, llama.cpp's
    numerics (PAGEDLLM_INT8_ACTIVATIONS=int8), rather than to 14-bit block integers (float,
    the default). int8 takes one u8 x s8 product per weight where 14 bits take two: on a
    2-vCPU Xeon SmolLM2's four layer GEMMs ran 1.1x faster at 1 row, 1.6-1.9x at 8-1,024
    rows; but with it in every layer SmolLM2's logprobs moved up to 0.80 from transformers'
    float32 ones (0.05 with 14 bits), and 11 of 242 teacher-forced tokens were not
    transformers' argmax. So it is asked for, never chosen."""
    setting = (envs.get("PAGEDLLM_INT8_ACTIVATIONS") or "float").strip().lower()
    if setting not in ("float", "int8"):
        raise ValueError(f"PAGEDLLM_INT8_ACTIVATIONS must be float or int8, got {setting!r}")
    return setting == "int8"


def form() -> str:
    """The kernel's form here: "avx512" where the CPU has AVX512-VNNI, else "avx-vnni" or "avx2"."""
    return native.vnni_form() or "avx512"


# the kind's suffix per form of the kernel
_FORM_SUFFIX = {"avx512": "", "avx2": "-avx2", "avx-vnni": "-avxvnni"}


def kind(int8: bool | None = None, form_: str | None = None) -> str:
    """The kernel's name in crossover keys and the log: "vnni", or "vnni8" rounding to int8
    (`int8`; None: as `int8_activations()` says now), with "-avx2" for the AVX2 form and
    "-avxvnni" for it on AVX-VNNI (`form_`; None: this CPU's `form()`)."""
    name = "vnni8" if (int8_activations() if int8 is None else int8) else "vnni"
    return name + _FORM_SUFFIX[form_ or form()]


class VnniLinear:
    """One layer's block groups (a fused qkv / gate_up may hold several types) in output
    order; called on x [..., K], returns float32 [rows, N]. `int8`: activations rounded to
    int8 per block (`native.vnni_linear`'s `int8`), kind "vnni8"; `form`: the build's
    (`form()`), for the kind's name."""

    def __init__(self, groups: Sequence[tuple[int, torch.Tensor]], k: int, int8: bool = False) -> None:
        self.k = k
        self.int8 = int8
        self.form = form()
        self.weights: list[tuple[native.VnniWeight, int, int]] = []
        row = 0
        for qtype, raw in groups:
            w = native.pack_vnni(raw, qtype, k)
            self.weights.append((w, row, row + w.n))
            row += w.n
        self.n = row

    @property
    def kind(self) -> str:
        return kind(self.int8, self.form)

    def tensors(self) -> list[torch.Tensor]:
        """What it holds, for the layer to register (memory accounting)."""
        return [w.panels for w, _, _ in self.weights]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.k).float().contiguous()
        return native.linear_groups(x2, self.weights, self.n,
                                    lambda x, w, out: native.vnni_linear(x, w, out, int8=self.int8))
