"""GGUF routed experts (`GGUFConfig.moe_method`).

llama.cpp stacks each layer's experts into one tensor per projection
(`blk.N.ffn_{gate,up,down}_exps`, numpy shape [E, rows, cols]), quantized like the dense
linears; `GGUFFormat.weights()` yields them as raw uint8 blocks [E, rows, bytes_per_row]
tagged with their ggml type (float types arrive as float tensors). The GGUF linear
kernels take 2-D matrices, so the experts get their own method, following
`GGUFConfig.keep_dense`:

* default: each stacked tensor is dequantized once, as it loads, into the dense layout of
  the unquantized method (w13_weight [E, 2I, H], w2_weight [E, H, I], compute dtype) and
  the experts run as the unquantized ones do (`ops.pack_moe`: the native CPU MoE kernel,
  else `ops.fused_moe`, so a grouped-GEMM kernel serves them too);
* `--gguf-keep-quantized`: the blocks stay (memory near the file's size) and each expert
  that receives tokens multiplies from them: the native CPU kernels where they read the
  type (one repacked matrix per projection, viewed per expert), else a per-call
  dequantization of that expert's rows. Gate and up of one type are joined, so one call
  per expert serves both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.core.contracts import MoEMethod
from pagedllm.ops.cpu import native
from pagedllm.ops.moe import activation_and_mul, expert_rows
from pagedllm.plugins.models.moe import expert_loader, expert_parameter, pack_dense_experts, run_dense_experts
from pagedllm.plugins.quant.gguf_dequant import dequantize, dequantize_numpy
from pagedllm.plugins.quant.gguf_file import type_name
from pagedllm.plugins.quant.gguf_linear import group_by_type, num_cols


def _dequantizing_loader(param: torch.Tensor, loaded: torch.Tensor, where: tuple[int | None, int | None]) -> None:
    """Default mode: a stacked expert tensor, dequantized (one thread, as every GGUF
    load-time dequantization) and copied into the dense parameter."""
    qtype = getattr(loaded, "gguf_qtype", None)
    if qtype is not None:
        shape = (*loaded.shape[:-1], num_cols(loaded, qtype))
        loaded = dequantize_numpy(loaded.cpu().numpy(), qtype, shape)
    expert_loader(param, loaded, where)


@dataclass
class _Part:
    """Consecutive output rows of every expert's w13 or w2, in one ggml type (None: float).

    `name` is the layer parameter holding them: raw blocks or float rows [E, rows, *]
    (dequantized per call), or, with `packed`, the native kernel's codes, whose views
    per expert are `packed[e]`."""

    qtype: int | None
    rows: int
    cols: int
    name: str
    packed: list[native.PackedWeight] = field(default_factory=list)


class GGUFMoEMethod(MoEMethod):
    """Experts from GGUF stacked tensors: dense at load, or kept as blocks (module docstring)."""

    def __init__(self, keep_dense: bool) -> None:
        self.keep_dense = keep_dense

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, params_dtype):
        e, h, i = num_experts, hidden_size, intermediate_size
        if self.keep_dense:
            for name, shape, shards in (("w13_weight", (e, 2 * i, h), (i, i)), ("w2_weight", (e, h, i), None)):
                param = expert_parameter(layer, name, shape, params_dtype, shards)
                param.weight_loader = _dequantizing_loader  # type: ignore[attr-defined]
            return
        layer.gguf_params_dtype = params_dtype
        layer.gguf_expert_shards = {}  # "w13" / "w2" -> [(qtype | None, tensor [E, rows, *]) per shard]
        layer.gguf_expert_parts = {}  # "w13" / "w2" -> [_Part], after loading
        layer.gguf_expert_cols = {"w13": h, "w2": i}
        for fused, cols, shards in (("w13", h, (i, i)), ("w2", i, (h,))):
            param = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            param.weight_loader = functools.partial(self._keep_blocks, layer, fused, cols)  # type: ignore[attr-defined]
            param.shard_sizes = shards  # type: ignore[attr-defined]  # read by FusedMoE.check_loaded
            param.loaded_parts = set()  # type: ignore[attr-defined]
            layer.register_parameter(f"{fused}_weight", param)
            layer.gguf_expert_shards[fused] = [None] * len(shards)

    @staticmethod
    def _keep_blocks(layer: nn.Module, fused: str, cols: int, param: torch.Tensor, loaded: torch.Tensor,
                     where: tuple[int | None, int | None]) -> None:
        """Keep-quantized mode: hold one stacked tensor (every expert's shard) until
        `process_after_loading` joins the shards."""
        expert, shard = where
        if expert is not None:
            raise ValueError(f"{layer.prefix}: GGUF experts arrive stacked [E, ...], not one expert at a time")
        qtype = getattr(loaded, "gguf_qtype", None)
        sizes = param.shard_sizes  # type: ignore[attr-defined]
        rows = sum(sizes) if shard is None else sizes[shard]
        got = (*loaded.shape[:2], num_cols(loaded, qtype)) if loaded.dim() == 3 else tuple(loaded.shape)
        if got != (layer.num_experts, rows, cols):
            kind = "float" if qtype is None else type_name(qtype)
            raise ValueError(f"{layer.prefix}: {kind} {fused} tensor has shape {got}, expected "
                             f"{(layer.num_experts, rows, cols)}")
        if qtype is None:
            loaded = loaded.to(layer.gguf_params_dtype)
        entry = (qtype, loaded.to(param.device))
        if shard is None:
            layer.gguf_expert_shards[fused] = [entry]
        else:
            layer.gguf_expert_shards[fused][shard] = entry
        param.loaded_parts.add(where)  # type: ignore[attr-defined]

    def process_after_loading(self, layer):
        if self.keep_dense:
            pack_dense_experts(layer)
            return
        for fused, shards in layer.gguf_expert_shards.items():
            cols = layer.gguf_expert_cols[fused]
            delattr(layer, f"{fused}_weight")
            parts = []  # gate and up of one type: one call per expert
            for j, (qtype, tensors) in enumerate(group_by_type(shards)):
                data = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=1)
                parts.append(_make_part(layer, f"{fused}_qweight_{j}", qtype, data, cols))
            layer.gguf_expert_parts[fused] = parts
        layer.gguf_expert_shards = {}

    def apply(self, layer, x, topk_weights, topk_ids):
        if self.keep_dense:
            return run_dense_experts(layer, x, topk_weights, topk_ids)

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            h = _expert_linear(layer.gguf_expert_parts["w13"], layer, e, rows)
            return _expert_linear(layer.gguf_expert_parts["w2"], layer, e, activation_and_mul(h, layer.activation))

        return expert_rows(x, topk_weights, topk_ids, layer.num_experts, expert)


def _make_part(layer: nn.Module, name: str, qtype: int | None, data: torch.Tensor, cols: int) -> _Part:
    """Register one part's tensors on `layer` (parameters, so memory accounting sees them)."""
    experts, rows = data.shape[:2]
    part = _Part(qtype, rows, cols, name)
    if (qtype in native.SUPPORTED_QTYPES and data.device.type == "cpu" and cols % 32 == 0
            and native.available()):
        whole = native.pack(data.reshape(experts * rows, -1), qtype, cols)
        layer.register_parameter(name, nn.Parameter(whole.codes, requires_grad=False))
        layer.register_parameter(f"{name}_scale", nn.Parameter(whole.d, requires_grad=False))
        if whole.m.numel():
            layer.register_parameter(f"{name}_offset", nn.Parameter(whole.m, requires_grad=False))
        for e in range(experts):  # row slices of contiguous tensors: views the kernel can read
            span = slice(e * rows, (e + 1) * rows)
            part.packed.append(native.PackedWeight(qtype, rows, cols, whole.codes[span], whole.d[span],
                                                   whole.m[span] if whole.m.numel() else whole.m))
        return part
    layer.register_parameter(name, nn.Parameter(data, requires_grad=False))
    return part


def _expert_linear(parts: list[_Part], layer: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """x [n, cols] @ expert e's weight^T over every part, concatenated along the outputs."""
    outs = []
    for part in parts:
        if part.packed and x.dtype == torch.float32:
            outs.append(native.linear(x.contiguous(), part.packed[e]))
            continue
        if part.packed:
            weight = native.dequantize_rows(part.packed[e], torch.arange(part.rows))
        else:
            weight = getattr(layer, part.name)[e]
            if part.qtype is not None:
                weight = dequantize(weight, part.qtype, (part.rows, part.cols))
        outs.append(F.linear(x, weight.to(x.dtype)))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
