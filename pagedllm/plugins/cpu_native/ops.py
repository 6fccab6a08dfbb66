"""The layer ops of `pagedllm.ops` on the native CPU kernels (float32 CPU tensors).

Each function keeps its op's contract (see the reference's docstring in pagedllm.ops)
and hands contiguous rows to `pagedllm.ops.cpu.native`; tensors the kernels cannot
take are made contiguous first. A step made of these calls alone is what step replay
(replay.py) can record.
"""

from __future__ import annotations

import functools

import torch

from pagedllm.core.contracts import OpImpl
from pagedllm import ops
from pagedllm.ops import moe
from pagedllm.ops.cpu import crossover, dense, native


def float32_cpu(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Why the native kernels cannot take tensors of this device and dtype."""
    reasons = []
    if device.type != "cpu":
        reasons.append("CPU tensors only")
    if dtype != torch.float32:
        reasons.append(f"float32 only, not {dtype}")
    if not reasons and not native.available():
        reasons.append("native CPU kernels unavailable (no C compiler, or PAGEDLLM_CPU_KERNELS=0)")
    return reasons


def bf16_cpu(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Why the bf16 wrappers (float32 kernels between two conversions) cannot run here."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return ["bfloat16 CPU tensors only"]
    return float32_cpu(device, torch.float32)


def _packed_dense_here(device: torch.device, dtype: torch.dtype) -> list[str]:
    if device.type != "cpu" or dtype != torch.float32:
        return ["float32 CPU weights only"]
    return [] if dense.available() else ["no packed float32 kernel here (PAGEDLLM_CPU_KERNELS=0?)"]


def _packed_bf16_here(device: torch.device, dtype: torch.dtype) -> list[str]:
    if device.type != "cpu" or dtype != torch.bfloat16:
        return ["bfloat16 CPU weights only"]
    return [] if dense.bf16_available() else ["no packed bf16 linear here (neither AMX nor oneDNN; PAGEDLLM_CPU_KERNELS=0?)"]


def bf16_products_pay() -> bool:
    """Whether float32 weights get a bf16 copy: bf16 products are allowed here and a bf16
    kernel (AMX tiles or oneDNN, dense.bf16_kernel) can pack one."""
    return dense.bf16_products_allowed() and dense.bf16_available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if residual is None:
        return native.rms_norm(rows, weight, eps).view(x.shape)
    summed = residual.reshape(rows.shape).contiguous()  # updated in place by the kernel
    return native.rms_norm(rows, weight, eps, summed).view(x.shape), summed.view(residual.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out = native.silu_mul(x.reshape(-1, x.shape[-1]).contiguous())
    return out.view(*x.shape[:-1], out.shape[-1])


def rotary_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qkv = qkv.contiguous()
    t = qkv.shape[0]
    native.rope_neox_(qkv, num_heads + num_kv_heads, head_dim, cos, sin)  # q and k heads, in place
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    return (qkv[:, :q_size].view(t, num_heads, head_dim),
            qkv[:, q_size:q_size + kv_size].view(t, num_kv_heads, head_dim),
            qkv[:, q_size + kv_size:].view(t, num_kv_heads, head_dim))


def gather_rows(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    rows = native.gather_rows(table.contiguous(), ids)
    return rows if dtype in (None, torch.float32) else rows.to(dtype)


def gather_rows_bf16(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A bf16 table's rows widened to float32 in one kernel where float32 is asked for (a
    16-bit checkpoint's embedding under float32 compute); bf16 rows as the reference else."""
    if dtype == torch.float32:
        return native.gather_rows(table.contiguous(), ids)
    rows = table[ids]
    return rows if dtype is None else rows.to(dtype)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    return native.argmax_rows(x if x.dim() == 2 and (x.shape[1] <= 1 or x.stride(1) == 1) else x.contiguous())


# bf16 models (`--dtype bfloat16`): the float32 kernels between two conversions. Each op's
# reference computes in float32 too, so only the final bf16 rounding is shared.

def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if residual is not None:
        residual = x + residual  # the sum stays in the model dtype, as the reference keeps it
        x = residual
    out = native.rms_norm(x.reshape(-1, x.shape[-1]).float(), weight, eps).to(x.dtype).view(x.shape)
    return out if residual is None else (out, residual)


def silu_and_mul_bf16(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(x.float()).to(x.dtype)


def rotary_qkv_bf16(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    wide = qkv.float()
    native.rope_neox_(wide, num_heads + num_kv_heads, head_dim, cos, sin)
    t, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    out = wide.to(qkv.dtype)
    return (out[:, :q_size].view(t, num_heads, head_dim),
            out[:, q_size:q_size + kv_size].view(t, num_kv_heads, head_dim),
            out[:, q_size + kv_size:].view(t, num_kv_heads, head_dim))


class PackedDense:
    """A float32 weight in the native GEMM's panels (else oneDNN's layout), see dense.py.

    Under "medium" float32 matmul precision on a CPU with native bf16 it also packs a bf16
    copy and measures (crossover.py) from how many rows that is faster; the float32 panels
    are dropped when bf16 wins from one row, as it does on AMX and AVX512-BF16. Where this
    machine measured the shape before, only the layouts that serve are packed (packing the
    loser cost a 1.5B model's start-up ~2.5 s).
    """

    owns_copy = True

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        self.packed: native.DenseWeight | torch.Tensor | None = None  # dense.prepack's layout
        self.bf16: native.Bf16Tiles | torch.Tensor | None = None  # dense.prepack_bf16's layout
        self.bf16_from = crossover.NEVER  # rows from which the bf16 copy serves
        self.kind = "f32"
        if not bf16_products_pay():
            self.packed = dense.prepack(weight)
            return
        kernel = dense.bf16_kernel()
        what = f"dense-f32|{kernel}|{n}x{k}"
        measured = crossover.known(what)
        if measured is not None:
            self.packed = dense.prepack(weight) if measured > 1 else None
            self.bf16 = dense.prepack_bf16(weight) if measured != crossover.NEVER else None
            self.bf16_from = measured
        else:
            self.packed, self.bf16 = dense.prepack(weight), dense.prepack_bf16(weight)
            self.bf16_from = crossover.rows_from(
                what,
                crossover.Contender(_f32_kernel(self.packed), lambda: _f32_kernel(dense.prepack(weight)), 4 * n * k),
                crossover.Contender(_bf16_kernel(self.bf16), lambda: _bf16_kernel(dense.prepack_bf16(weight)),
                                    2 * n * k), k)
        if self.bf16_from <= 1:
            self.packed = None
            self.kind = kernel
        elif self.bf16_from == crossover.NEVER:
            self.bf16 = None
        else:
            self.kind = f"f32<{self.bf16_from}<={kernel}"

    @property
    def nbytes(self) -> int:
        return min(_nbytes(t) for t in (self.packed, self.bf16) if t is not None)

    def _bf16_serves(self, x: torch.Tensor) -> bool:
        return self.bf16 is not None and (self.packed is None or x.numel() >= self.bf16_from * x.shape[-1])

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._bf16_serves(x):
            return dense.linear_bf16(x, self.bf16, bias)
        return dense.linear(x, self.packed, bias)

    def silu_and_mul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        return dense.linear_bf16_silu_and_mul(x, self.bf16, bias) if self._bf16_serves(x) else None


def _f32_kernel(packed: native.DenseWeight | torch.Tensor) -> crossover.Kernel:
    return lambda x: dense.linear(x, packed, None)


def _bf16_kernel(packed: native.Bf16Tiles | torch.Tensor) -> crossover.Kernel:
    return lambda x: dense.linear_bf16(x, packed, None)


def _nbytes(packed: native.DenseWeight | native.Bf16Tiles | torch.Tensor) -> int:
    return packed.numel() * packed.element_size() if isinstance(packed, torch.Tensor) else packed.nbytes


class PackedBF16:
    """A bf16 weight packed once for dense.bf16_kernel() (`--dtype bfloat16`): F.linear
    would hand oneDNN the plain weight and repack it on every call."""

    owns_copy = True

    def __init__(self, weight: torch.Tensor) -> None:
        self.bf16 = dense.prepack_bf16(weight)
        self.kind = dense.bf16_kernel()
        self.nbytes = _nbytes(self.bf16)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense.linear_bf16(x, self.bf16, bias)

    def silu_and_mul(self, x: torch.Tensor, bias: torch.Tensor | None) -> None:
        return None  # bf16 activations: the product is rounded to bf16 before the activation


def pack_bf16_linear(weight: torch.Tensor) -> PackedDense | PackedBF16:
    """`pack_linear` of a bf16 weight: packed as bf16, except where a 16-bit checkpoint's
    weights meet float32 activations (`ops.dense_weight_dtype()`) on a CPU that should not
    multiply in bf16 (no native bf16 products, or "highest" precision asked for): float32
    panels then hold it exactly, as a float32 checkpoint's would be."""
    if _widens_bf16_weights():
        return PackedDense(weight.float())
    return PackedBF16(weight)


def _widens_bf16_weights() -> bool:
    """Whether bf16 weights being packed are a 16-bit checkpoint's under float32 compute
    that this CPU should not multiply in bf16 (`pack_bf16_linear`)."""
    return ops.dense_weight_dtype() is not None and not bf16_products_pay()


class PackedExperts:
    """A MoE layer's float32 experts packed for the native GEMM and run by one kernel call
    (csrc/moe.c: routing sort, gathers, both GEMMs, activation and the weighted sum), so a
    MoE step has no host sync and replays like the rest of the layer. Products are float32
    whatever the matmul precision (bf16 expert products are not implemented)."""

    owns_copy = True
    kind = "cpu-f32"

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13, self.w2 = native.pack_experts(w13), native.pack_experts(w2)

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 activation: str) -> torch.Tensor:
        return native.moe_f32(x, self.w13, self.w2, topk_weights, topk_ids, activation)


class PackedExpertsBF16:
    """A MoE layer's bf16 experts (`--dtype bfloat16`), each packed once for
    dense.bf16_kernel(), run one expert at a time through ops.moe.expert_rows (F.linear
    would hand oneDNN each plain expert and repack it on every call)."""

    owns_copy = True

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13 = [dense.prepack_bf16(w) for w in w13]
        self.w2 = [dense.prepack_bf16(w) for w in w2]
        self.kind = f"{dense.bf16_kernel()} per expert"

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 activation: str) -> torch.Tensor:
        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            h = moe.activation_and_mul(dense.linear_bf16(rows, self.w13[e], None), activation)
            return dense.linear_bf16(h, self.w2[e], None)

        return moe.expert_rows(x, topk_weights, topk_ids, len(self.w13), expert)


def pack_bf16_experts(w13: torch.Tensor, w2: torch.Tensor) -> PackedExperts | PackedExpertsBF16:
    """`pack_moe` of bf16 experts: as bf16, or widened for the float32 MoE kernel where
    `pack_bf16_linear` would widen a dense weight."""
    if _widens_bf16_weights() and native.available():
        return PackedExperts(w13.float(), w2.float())
    return PackedExpertsBF16(w13, w2)


# every implementation here runs on the one native library, built (or found) at start-up in
# the background (OpImpl.prepare)
_native_impl = functools.partial(OpImpl, prepare=native.prepare)
OP_IMPLS = [
    _native_impl("pack_moe", "cpu_packed_bf16_moe", pack_bf16_experts, _packed_bf16_here),
    _native_impl("pack_moe", "cpu_native_moe", PackedExperts, float32_cpu),
    _native_impl("rms_norm", "cpu_native", rms_norm, float32_cpu),
    _native_impl("silu_and_mul", "cpu_native", silu_and_mul, float32_cpu),
    _native_impl("rotary_qkv", "cpu_native", rotary_qkv, float32_cpu),
    _native_impl("gather_rows", "cpu_native", gather_rows, float32_cpu),
    _native_impl("gather_rows", "cpu_native_bf16", gather_rows_bf16, bf16_cpu),
    _native_impl("argmax_rows", "cpu_native", argmax_rows, float32_cpu),
    _native_impl("pack_linear", "cpu_packed", PackedDense, _packed_dense_here),
    _native_impl("pack_linear", "cpu_packed_bf16", pack_bf16_linear, _packed_bf16_here),
    _native_impl("rms_norm", "cpu_native_bf16", rms_norm_bf16, bf16_cpu),
    _native_impl("silu_and_mul", "cpu_native_bf16", silu_and_mul_bf16, bf16_cpu),
    _native_impl("rotary_qkv", "cpu_native_bf16", rotary_qkv_bf16, bf16_cpu),
]
