"""FP8 routed experts (`Fp8Config.moe_method`): the experts keep their fp8 codes and
scales, and each expert's weights are dequantized inside its GEMM pair (one expert at a
time), so memory stays near the checkpoint's size.

Layouts, as the checkpoint's per-expert tensors arrive (`<prefix>.experts.{e}.gate_proj.*`):
* per-tensor (`weight_scale` per expert and projection): w13_weight_scale [E, 2] (gate,
  up), w2_weight_scale [E, 1]; static `input_scale`s are read and kept but unused;
* blocks (`weight_block_size`, DeepSeek-V3 / Qwen3-MoE-FP8): w13_weight_scale_inv
  [E, 2I / bn, H / bk], w2_weight_scale_inv [E, H / bn, I / bk];
* `--quantization fp8` on a float checkpoint: each expert's rows quantized as they load,
  one scale per output row.

Parallelism (moe.py's ExpertSplit): every tensor is an `expert_parameter`, so expert
parallelism loads only this rank's experts; under tensor parallelism the codes, the
per-row scales of w13 and the block scales are sliced along the intermediate dim (block
scales by whole blocks: this rank's intermediate size must be a multiple of the block),
while per-tensor scales hold for every slice and w2's per-row scales (rows of the hidden
size) stay whole.

Activations are not quantized here (the experts run fp8 weights with float activations,
W8A16, unlike the dense FP8 layers' W8A8): the dequantized GEMM is then exact up to float
rounding, on every device (a CUDA fp8 grouped GEMM is still to come).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagedllm.core.contracts import MoEMethod
from pagedllm.ops.moe import activation_and_mul, expert_rows
from pagedllm.plugins.models.moe import expert_loader, expert_parameter

FP8 = torch.float8_e4m3fn


def _scalar_loader(param: torch.Tensor, loaded: torch.Tensor, where: tuple[int | None, int | None]) -> None:
    """One per-tensor scale of one expert's projection."""
    if loaded.numel() != 1:
        raise ValueError(f"expected one scale per expert tensor, got shape {tuple(loaded.shape)}")
    expert_loader(param, loaded.reshape(1).float(), where)


class Fp8MoEMethod(MoEMethod):
    supports_tensor_parallel = True  # see the module docstring

    def __init__(self, cfg) -> None:  # cfg: fp8.Fp8Config
        self.cfg = cfg

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, params_dtype):
        cfg, e, h, i = self.cfg, num_experts, hidden_size, intermediate_size
        w13 = expert_parameter(layer, "w13_weight", (e, 2 * i, h), FP8, (i, i), intermediate_dim=0)
        w2 = expert_parameter(layer, "w2_weight", (e, h, i), FP8, intermediate_dim=1)
        if not cfg.serialized:  # float checkpoint: quantize each expert's rows as they arrive
            # w13's rows are the intermediate dim (sliced with them); w2's are the hidden size,
            # each quantized over its whole row, then sliced: one rank's scales and codes exactly
            for name, param, rows, shards, dim in (("w13", w13, 2 * i, (i, i), 0), ("w2", w2, h, None, None)):
                scale = expert_parameter(layer, f"{name}_row_scale", (e, rows), torch.float32, shards,
                                         intermediate_dim=dim)
                scale.optional = True  # type: ignore[attr-defined]  # filled with the weight, never named
                param.weight_loader = functools.partial(self._quantize_rows, scale)  # type: ignore[attr-defined]
            return
        if cfg.block is not None:
            bn, bk = cfg.block
            tp = getattr(getattr(layer, "expert_split", None), "tp_size", 1)
            if i % bn:
                raise ValueError(f"fp8 {layer.prefix}: moe_intermediate_size {i}"
                                 f"{f' (per rank, over tensor_parallel_size={tp})' if tp > 1 else ''} is not a "
                                 f"multiple of the weight block size {bn} (gate and up would share a scale block)")
            if tp > 1 and i % bk:
                raise ValueError(f"fp8 {layer.prefix}: tensor_parallel_size={tp} gives each rank {i} intermediate "
                                 f"columns of down_proj, not whole weight blocks of {bk}; use a tensor_parallel_size "
                                 "that splits the experts into whole blocks, or --enable-expert-parallel")
            expert_parameter(layer, "w13_weight_scale_inv", (e, 2 * i // bn, -(-h // bk)), torch.float32,
                             (i // bn, i // bn), intermediate_dim=0)
            expert_parameter(layer, "w2_weight_scale_inv", (e, -(-h // bn), -(-i // bk)), torch.float32,
                             intermediate_dim=1)
            return
        names = ("weight_scale", "input_scale") if cfg.static else ("weight_scale",)
        for suffix in names:
            for fused, shards in (("w13", (1, 1)), ("w2", (1,))):
                p = expert_parameter(layer, f"{fused}_{suffix}", (e, len(shards)), torch.float32, shards)
                p.weight_loader = _scalar_loader  # type: ignore[attr-defined]
                p.optional = suffix == "input_scale"  # type: ignore[attr-defined]  # read, unused

    @staticmethod
    def _quantize_rows(scale: torch.Tensor, param: torch.Tensor, loaded: torch.Tensor,
                       where: tuple[int | None, int | None]) -> None:
        from pagedllm.plugins.quant.fp8 import quantize_rows

        split = getattr(param, "expert_split", None)
        if split is not None and where[0] is not None and split.local_expert(where[0]) is None:
            return  # another rank's expert: not quantized here
        codes, row_scale = quantize_rows(loaded)
        expert_loader(param, codes.view(loaded.shape), where)
        expert_loader(scale, row_scale.view(loaded.shape[:-1]), where)

    def process_after_loading(self, layer):
        """Per-output-row scales [E, rows] for the per-tensor and row layouts (cheap; the
        block layout keeps its block scales)."""
        cfg = self.cfg
        layer.fp8_row_scales = {}
        if cfg.serialized and cfg.block is not None:
            return
        for fused in ("w13", "w2"):
            if not cfg.serialized:
                rows = getattr(layer, f"{fused}_row_scale").data
            else:
                per_shard = getattr(layer, f"{fused}_weight_scale").data  # [E, shards]
                sizes = torch.tensor(getattr(layer, f"{fused}_weight").shard_sizes, device=per_shard.device)
                rows = per_shard.repeat_interleave(sizes, dim=1)
            layer.fp8_row_scales[fused] = rows.float().contiguous()

    def dequantize(self, layer, fused: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s `fused` ("w13" / "w2") weight in `dtype`."""
        codes = getattr(layer, f"{fused}_weight")[expert].float()
        if fused in layer.fp8_row_scales:
            return (codes * layer.fp8_row_scales[fused][expert][:, None]).to(dtype)
        bn, bk = self.cfg.block
        s = getattr(layer, f"{fused}_weight_scale_inv")[expert]
        expanded = s.repeat_interleave(bn, 0)[:codes.shape[0]].repeat_interleave(bk, 1)[:, :codes.shape[1]]
        return (codes * expanded).to(dtype)

    def apply(self, layer, x, topk_weights, topk_ids):
        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            h = F.linear(rows, self.dequantize(layer, "w13", e, rows.dtype))
            return F.linear(activation_and_mul(h, layer.activation), self.dequantize(layer, "w2", e, rows.dtype))

        return expert_rows(x, topk_weights, topk_ids, layer.num_experts, expert)
