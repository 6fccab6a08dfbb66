"""FP8 (float8_e4m3fn) weights, `quant_method: "fp8"` and `--quantization fp8`.

Checkpoints (vLLM's / llm-compressor's layout):
* per-tensor: `weight` fp8 [out, in] and a float32 `weight_scale` per checkpoint tensor
  (a fused layer gets one per shard); `activation_scheme: "static"` adds `input_scale`.
* blocks (`weight_block_size: [bn, bk]`, DeepSeek-V3): `weight_scale_inv` float32
  [ceil(out / bn), ceil(in / bk)], activations scaled per token and group of bk.
`--quantization fp8` on a float checkpoint quantizes each weight as it loads (one scale
per output row), so a full-precision copy of the model is never held.

Activations: W8A8 quantizes them per token (dynamic), with the static input scale, or per
token and group of bk (blocks), so that FP8 tensor cores can multiply them. Only a device
that multiplies fp8 gains from it: on CUDA 8.9+ (`torch._scaled_mm`) they are quantized as
the checkpoint says; elsewhere, every CPU included (none has FP8 arithmetic), the layer runs
weight-only, W8A16, as vLLM runs FP8 checkpoints on GPUs without fp8 (its Marlin path):
rounding activations to a 3-bit mantissa would cost accuracy (+1-3% perplexity on SmolLM2)
and buy no speed, since the GEMM is the same. `PAGEDLLM_FP8_ACTIVATIONS=fp8` quantizes them
everywhere (a GPU's numerics on the CPU), `float` never. On the CPU the codes are widened to
bf16 (exact: every e4m3 value is a bf16 value) where the CPU multiplies bf16 natively with
float32 sums (the activations are then rounded to bf16), else to float32 (exact), and one
GEMM gives the products; the scales are applied to its output. Block-scaled weights (their
scales vary along the input, so they do not factor out of one GEMM) run on CUDA through
triton_fp8.py's GEMM, which applies the block scales tile by tile on the 1-byte codes;
elsewhere they are dequantized once at load.

Tensor parallelism (layers.Linear's column / row split): the fp8 codes narrow like any
weight; a per-tensor scale (one per fused shard) and a static input scale hold for every
part of their tensor, so each rank keeps them whole; per-row scales follow their rows
(split under column parallel, whole under row parallel); block scales are split by whole
blocks, so a rank's rows (column) or input columns (row) must be a multiple of the block;
`--quantization fp8` quantizes the rank's part as it arrives. Under row parallel each rank
quantizes its slice of the activations per token (vLLM does the same), so the sum is close
to one rank's result, not bitwise equal (static scales and blocks, elementwise or aligned
with the split, round as one rank does).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import ops
from pagedllm.core import envs
from pagedllm.core.contracts import LinearMethod, QuantConfig
from pagedllm.ops.cpu import dense
from pagedllm.plugins.models.layers import split_parameter
from pagedllm.plugins.quant.int_weights import log_kernel_once, triton_installed

logger = logging.getLogger("pagedllm")

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
EPS = 1e-12


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (or per row and group of `group` columns): fp8 codes and float32 scales with
    x ~ codes * scale."""
    rows = x.float().reshape(-1, x.shape[-1])
    shaped = rows if group is None else rows.view(rows.shape[0], -1, group)
    scale = (shaped.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=EPS)
    codes = (shaped / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes.view_as(rows), scale.squeeze(-1)


@functools.lru_cache(maxsize=None)
def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1.0 on `device`, made once rather than at every layer's call."""
    return torch.ones((), dtype=torch.float32, device=device)


def scaled_mm(xq: torch.Tensor, wt: torch.Tensor, x_scale: torch.Tensor, row_scale: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
    """fp8 codes xq [M, K] @ wt [K, N] on the FP8 tensor cores, scaled per token (x_scale
    [M, 1]) and per output row (row_scale [N]). Row-wise scales applied in the GEMM give a
    bf16 result only, which a float32 model must not take (on an H200 it moved a tiny
    model's log-likelihoods by 0.1-0.2 nats against the same fp8 rounding in float32): there
    the GEMM runs with unit scales and a float32 result (fp8 products are exact in float32),
    and both scales are applied after it, in float32; so does a float16 model, whose result
    would otherwise pass through bf16."""
    if dtype != torch.bfloat16:
        one = _unit_scale(xq.device)
        out = torch._scaled_mm(xq, wt, scale_a=one, scale_b=one, out_dtype=torch.float32)
        return out * x_scale * row_scale[None, :]
    return torch._scaled_mm(xq, wt, scale_a=x_scale.contiguous(), scale_b=row_scale[None, :].contiguous(),
                            out_dtype=torch.bfloat16)


def quantizes_activations(device: torch.device) -> bool:
    """Whether FP8 layers on `device` quantize their inputs to fp8 (W8A8) or run weight-only
    (W8A16): PAGEDLLM_FP8_ACTIVATIONS, by default only where fp8 products exist."""
    setting = (envs.get("PAGEDLLM_FP8_ACTIVATIONS") or "auto").strip().lower()
    if setting not in ("auto", "fp8", "float"):
        raise ValueError(f"PAGEDLLM_FP8_ACTIVATIONS must be auto, fp8 or float, got {setting!r}")
    if setting != "auto":
        return setting == "fp8"
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _scalar_loader(param: torch.Tensor, loaded: torch.Tensor, shard: int | None) -> None:
    if loaded.numel() != 1:
        raise ValueError(f"expected one scale per tensor, got shape {tuple(loaded.shape)}")
    param.data[shard or 0] = loaded.reshape(()).float()


def register_tensor_scales(layer: nn.Module, names: tuple[str, ...], shards: int) -> None:
    """One float32 scale per checkpoint tensor (per fused shard) for each of `names`
    (weight_scale, input_scale of per-tensor W8A8 checkpoints, stored as shape [] or [1]).
    A scale holds for every part of its tensor: whole on every tensor-parallel rank."""
    for name in names:
        p = nn.Parameter(torch.ones(shards, dtype=torch.float32), requires_grad=False)
        p.weight_loader = _scalar_loader  # type: ignore[attr-defined]
        split_parameter(p, None, [])
        layer.register_parameter(name, p)


def row_scale_param(layer: nn.Module, name: str, output_sizes: list[int]) -> nn.Parameter:
    """One float32 scale per output row [out, 1] (compressed-tensors' channel strategy):
    split with the rows under column parallel, whole under row parallel (`input_dim`
    None: its one column is not the layer's input)."""
    offsets = [0]
    for size in output_sizes:
        offsets.append(offsets[-1] + size)
    scale = nn.Parameter(torch.empty(offsets[-1], 1, dtype=torch.float32), requires_grad=False)
    scale.output_offsets = offsets  # type: ignore[attr-defined]
    scale.input_dim = None  # type: ignore[attr-defined]
    layer.register_parameter(name, scale)
    return scale


def block_kernel(device: torch.device, block: tuple[int, int], input_size: int) -> str:
    """Which kernel multiplies block-scaled FP8 weights here: "triton" (triton_fp8.py: the
    codes stay 1 byte, CUDA with triton installed, block widths a multiple of 16), else
    "dense" (dequantized once at load to the compute dtype)."""
    return "triton" if device.type == "cuda" and block[1] % 16 == 0 and triton_installed() else "dense"


def check_block_split(layer: nn.Module, output_sizes: list[int], input_size: int, block: tuple[int, int]) -> None:
    """Refuse a tensor-parallel part that cuts a scale block: block scales are split by
    whole blocks, so this rank's rows of each shard (column parallel) or its input
    columns (row parallel) must be multiples of the block."""
    bn, bk = block
    parallel = getattr(layer, "parallel", None)
    tp = getattr(getattr(layer, "tp", None), "size", 1)
    if parallel == "column" and any(s % bn for s in output_sizes):
        raise ValueError(f"fp8 {layer.prefix}: tensor_parallel_size={tp} gives this rank {output_sizes} output rows, "
                         f"not whole weight blocks of {bn} rows; use a tensor_parallel_size that splits the layer "
                         "into whole blocks")
    if parallel == "row" and input_size % bk:
        raise ValueError(f"fp8 {layer.prefix}: tensor_parallel_size={tp} gives this rank {input_size} input columns, "
                         f"not whole weight blocks of {bk} columns; use a tensor_parallel_size that splits the layer "
                         "into whole blocks")


class Fp8LinearMethod(LinearMethod):
    """`channel_scales`: the checkpoint has one weight scale per output row ([out, 1], as
    compressed-tensors' channel strategy writes) instead of one per tensor."""

    supports_tensor_parallel = True  # every layout splits (see the module docstring)

    def __init__(self, cfg: "Fp8Config", channel_scales: bool = False) -> None:
        self.cfg = cfg
        self.channel_scales = channel_scales

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        cfg = self.cfg
        n, shards = sum(output_sizes), len(output_sizes)
        layer.fp8_sizes, layer.fp8_in, layer.fp8_dtype = list(output_sizes), input_size, params_dtype
        offsets = [0]
        for size in output_sizes:
            offsets.append(offsets[-1] + size)
        weight = nn.Parameter(torch.empty(n, input_size, dtype=FP8), requires_grad=False)
        weight.output_offsets = offsets  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)
        if not cfg.serialized:  # float checkpoint: quantize each shard as it arrives
            layer.fp8_row_scale = torch.empty(n, dtype=torch.float32)
            weight.weight_loader = functools.partial(self._quantize_shard, layer)  # type: ignore[attr-defined]
            return
        if cfg.block is not None:
            bn, bk = cfg.block
            check_block_split(layer, list(output_sizes), input_size, cfg.block)
            bad = [s for s in output_sizes if s % bn] if shards > 1 else []
            if bad:
                raise ValueError(f"fp8 {layer.prefix}: fused shards {output_sizes} are not multiples of the "
                                 f"weight block size {bn}")
            scale = nn.Parameter(torch.empty(-(-n // bn), -(-input_size // bk), dtype=torch.float32),
                                 requires_grad=False)
            # one scale per block: bn rows along the output, bk columns along the input
            scale.output_offsets, scale.pack_factor = offsets, bn  # type: ignore[attr-defined]
            scale.input_pack_factor = bk  # type: ignore[attr-defined]
            layer.register_parameter("weight_scale_inv", scale)
            return
        scalars = ("input_scale",) if cfg.static else ()
        if self.channel_scales:
            row_scale_param(layer, "weight_scale", list(output_sizes))
        else:
            scalars = ("weight_scale",) + scalars
        register_tensor_scales(layer, scalars, shards)

    @staticmethod
    def _quantize_shard(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard: int | None) -> None:
        start = 0 if shard is None else param.output_offsets[shard]
        rows = param.shape[0] if shard is None else layer.fp8_sizes[shard]
        if tuple(loaded.shape) != (rows, layer.fp8_in):
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected {(rows, layer.fp8_in)}")
        codes, scale = quantize_rows(loaded)
        param.data[start:start + rows] = codes
        layer.fp8_row_scale[start:start + rows] = scale

    def process_after_loading(self, layer):
        cfg, codes = self.cfg, layer.weight.data
        device = codes.device
        layer.fp8_input_scale = None
        layer.fp8_block = None
        layer.fp8_w8a8 = quantizes_activations(device)
        acts = "W8A8" if layer.fp8_w8a8 else "W8A16"
        layer.fp8_triton = None
        if cfg.serialized and cfg.block is not None and block_kernel(device, cfg.block, codes.shape[1]) == "triton":
            layer.fp8_triton = (codes.view(torch.uint8), layer.weight_scale_inv.data.float().contiguous())
            layer.fp8_block = cfg.block[1]
            layer.fp8_kind = f"block-fp8 Triton GEMM {acts}"
            log_kernel_once("fp8", layer.fp8_kind)
            return
        if cfg.serialized and cfg.block is not None:
            bn, bk = cfg.block
            s = layer.weight_scale_inv.data
            expanded = s.repeat_interleave(bn, 0)[:codes.shape[0]].repeat_interleave(bk, 1)[:, :codes.shape[1]]
            dense_w = (codes.float() * expanded).to(layer.fp8_dtype)
            del layer.weight, layer.weight_scale_inv
            layer.fp8_dense = ops.pack_linear(dense_w)
            if not layer.fp8_dense.owns_copy:
                layer.register_parameter("weight", nn.Parameter(dense_w, requires_grad=False))
            layer.fp8_block = bk
            layer.fp8_kind = f"block-dequantized {acts}"
            log_kernel_once("fp8", f"{layer.fp8_kind} ({getattr(layer.fp8_dense, 'kind', 'dense')})")
            return
        if cfg.serialized:
            sizes = torch.tensor(layer.fp8_sizes, device=device)
            row_scale = (layer.weight_scale.data.view(-1) if self.channel_scales
                         else layer.weight_scale.data.repeat_interleave(sizes))
            if cfg.static:
                layer.fp8_input_scale = float(layer.input_scale.data.max())  # one scale for the fused input
            del layer.weight_scale
            if hasattr(layer, "input_scale"):
                del layer.input_scale
        else:
            row_scale = layer.fp8_row_scale
        layer.fp8_row_scale = row_scale.float().contiguous()
        del layer.weight
        if layer.fp8_w8a8 and device.type == "cuda" and codes.shape[0] % 16 == 0 and codes.shape[1] % 16 == 0:
            layer.register_parameter("weight", nn.Parameter(codes, requires_grad=False))
            layer.fp8_kind = "scaled_mm"
            layer.fp8_gemm = None
        elif device.type == "cuda":  # W8A16, or shapes _scaled_mm does not take: one GEMM on the widened codes
            # e4m3 values are exact in every float dtype: widen to the model's, so a float32 model keeps
            # float32 products and a float16 one its activations' mantissa
            wide = codes.to(layer.fp8_dtype if layer.fp8_dtype in (torch.float16, torch.bfloat16) else torch.float32)
            layer.fp8_gemm = lambda xq, w=wide: F.linear(xq.to(w.dtype), w)
            layer.fp8_kind = f"fp8-as-{str(wide.dtype).replace('torch.', '')} {acts} (cuda)"
        elif dense.bf16_products_allowed() and dense.bf16_available() and dense.bf16_sums_in_float32():
            # FP8 codes are exact in bf16, so only the activations' rounding to bf16 is lost,
            # which "medium" precision allows (--dtype float32 keeps float32 activations);
            # bf16-rounded sums (oneDNN) would lose more, so those take float32 below
            packed = dense.prepack_bf16(codes.to(torch.bfloat16))
            cpu_gemm = functools.partial(dense.linear_bf16, packed=packed, bias=None)
            layer.fp8_kind = f"fp8-as-bf16 {acts} ({dense.bf16_kernel()})"
        else:
            wide = codes.float()
            packed = dense.prepack(wide) if dense.available() else None
            cpu_gemm = (functools.partial(dense.linear, packed=packed, bias=None) if packed is not None
                        else functools.partial(F.linear, weight=wide))
            layer.fp8_kind = f"fp8-as-f32 {acts}"
        if device.type != "cuda":  # the CPU GEMMs take float32 activations
            layer.fp8_gemm = lambda xq, gemm=cpu_gemm: gemm(xq.float())
        log_kernel_once("fp8", layer.fp8_kind)

    def apply(self, layer, x, bias):  # the kind chosen at load is logged once (see process_after_loading)
        k = layer.fp8_in
        x2 = x.reshape(-1, k)
        if layer.fp8_block is not None:  # activations per token and group, weight dequantized
            bk = layer.fp8_block
            if k % bk:
                raise NotImplementedError(f"fp8 {layer.prefix}: block activations need the input size {k} to be a "
                                          f"multiple of {bk}")
            if layer.fp8_w8a8:
                codes, scale = quantize_rows(x2, bk)
                x2 = (codes.float().view(x2.shape[0], -1, bk) * scale[..., None]).view_as(x2).to(x.dtype)
            if layer.fp8_triton is not None:
                from pagedllm.plugins.quant import triton_fp8, triton_int

                out = triton_fp8.linear(triton_int.operand(x2), *layer.fp8_triton, self.cfg.block)
                if bias is not None:
                    out = out + bias
                out = out.to(x.dtype)
            else:
                out = layer.fp8_dense(x2, bias)
            return out.view(*x.shape[:-1], out.shape[-1])
        if not layer.fp8_w8a8:  # weight-only: the widened codes times the activations as they are
            xq, x_scale = x2, None
        elif layer.fp8_input_scale is not None:
            x_scale = torch.full((x2.shape[0], 1), layer.fp8_input_scale, dtype=torch.float32, device=x.device)
            xq = (x2.float() / layer.fp8_input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        else:
            xq, x_scale = quantize_rows(x2)
            x_scale = x_scale[:, None]
        if layer.fp8_gemm is None:  # CUDA: FP8 tensor cores (W8A8 only)
            out = scaled_mm(xq, layer.weight.t(), x_scale, layer.fp8_row_scale, x.dtype)
        else:
            out = layer.fp8_gemm(xq).float()  # each GEMM widens the activations to what it multiplies in
            out = (out if x_scale is None else out * x_scale) * layer.fp8_row_scale
        if bias is not None:
            out = out + bias
        return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


class Fp8Config(QuantConfig):
    """FP8 W8A8: per-tensor or block-scaled checkpoints, or a float checkpoint quantized
    while it loads (`--quantization fp8`)."""

    name = "fp8"
    quantizes_dense = True

    def __init__(self, serialized: bool, static: bool, block: tuple[int, int] | None, skip: list[str]) -> None:
        self.serialized, self.static, self.block, self.skip = serialized, static, block, skip

    @classmethod
    def from_config(cls, config: dict[str, Any], options: dict[str, Any]) -> "Fp8Config":
        serialized = config.get("quant_method") == "fp8"
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8: activation_scheme {scheme!r} is not one of dynamic, static")
        block = config.get("weight_block_size")
        if block is not None:
            if len(block) != 2:
                raise ValueError(f"fp8: weight_block_size must be [rows, cols], got {block}")
            if scheme == "static":
                raise ValueError("fp8: block-scaled weights take dynamic activations only")
            block = (int(block[0]), int(block[1]))
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8: {fmt} weights are not supported (e4m3 is)")
        skip = list(config.get("ignored_layers") or config.get("modules_to_not_convert") or [])
        return cls(serialized, scheme == "static", block, skip)

    def linear_method(self, prefix: str) -> LinearMethod | None:
        if self.is_skipped(prefix, self.skip):
            return None
        return Fp8LinearMethod(self)

    def moe_method(self, prefix: str):
        """FP8 experts, dequantized per expert GEMM (fp8_moe.py); None where skipped."""
        if self.is_skipped(prefix, self.skip):
            return None
        from pagedllm.plugins.quant.fp8_moe import Fp8MoEMethod

        return Fp8MoEMethod(self)

    def check(self, device: torch.device, dtype: torch.dtype) -> list[str]:
        quantizes_activations(device)  # a bad PAGEDLLM_FP8_ACTIVATIONS fails before any weight loads
        if device.type == "cuda" and self.block is None:
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):
                return [f"FP8 matmuls need compute capability 8.9+ (Ada, Hopper); this GPU is {major}.{minor}: "
                        "use a bf16 checkpoint, or --quantization awq/gptq checkpoints"]
        return []
