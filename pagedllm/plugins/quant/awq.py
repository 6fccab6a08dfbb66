"""AWQ checkpoints (AutoAWQ's GEMM layout), `quant_method: "awq"` (vLLM's `awq_marlin` too).

Per linear layer, with g = group_size:
  qweight int32 [in, out / 8]   eight 4-bit codes per word, along the output dim, in
                                 AutoAWQ's interleaved order: the j-th column of a word
                                 sits at nibble AWQ_ORDER[j]
  qzeros  int32 [in / g, out / 8] the zero points, packed the same way
  scales  fp16  [in / g, out]
and w[out, in] = scales * (q - zero). Layers named in `modules_to_not_convert` are plain
float layers. The codes feed the shared integer kernels (int_weights.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.core.contracts import LinearMethod, QuantConfig
from pagedllm.plugins.quant.int_weights import GroupedIntMethod, IntGroups, output_param, unpack_int32

# nibble of the j-th output column inside a word (AutoAWQ packs column order_map[i] at
# nibble i with order_map = [0, 2, 4, 6, 1, 3, 5, 7]; this is its inverse)
AWQ_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
PACK = 8


class AWQLinearMethod(GroupedIntMethod):
    format_name = "awq"
    checkpoint_tensors = ("qweight", "qzeros", "scales")

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create_checkpoint_tensors(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        group = input_size if self.group_size == -1 else self.group_size
        bad = [s for s in output_sizes if s % PACK]
        if input_size % group or bad:
            raise ValueError(f"awq {layer.prefix}: input size {input_size} must be a multiple of group_size "
                             f"{group} and every output size a multiple of {PACK} (got {output_sizes})")
        n, groups = sum(output_sizes), input_size // group
        output_param(layer, "qweight", (input_size, n // PACK), torch.int32, output_sizes, 1, PACK)
        output_param(layer, "qzeros", (groups, n // PACK), torch.int32, output_sizes, 1, PACK)
        output_param(layer, "scales", (groups, n), torch.float32, output_sizes, 1)
        layer.int_group = group

    def unpack(self, layer: nn.Module) -> list[IntGroups]:
        codes = unpack_int32(layer.qweight.data, 4, 1, AWQ_ORDER).t().contiguous()  # [out, in]
        zeros = unpack_int32(layer.qzeros.data, 4, 1, AWQ_ORDER).t().float().contiguous()
        scales = layer.scales.data.t().float().contiguous()
        return [IntGroups(codes, scales, zeros, layer.int_group, 4)]


class AWQConfig(QuantConfig):
    """4-bit AWQ with zero points (GEMM layout)."""

    name = "awq"
    aliases = ("awq_marlin",)

    def __init__(self, group_size: int, skip: list[str]) -> None:
        self.group_size = group_size
        self.skip = skip

    @classmethod
    def from_config(cls, config: dict[str, Any], options: dict[str, Any]) -> "AWQConfig":
        bits = config.get("bits", config.get("w_bit", 4))
        version = str(config.get("version", "gemm")).lower()
        if bits != 4:
            raise ValueError(f"awq: {bits}-bit checkpoints are not supported (AWQ is 4-bit)")
        if version != "gemm":
            raise ValueError(f"awq: version {version!r} is not supported; only AutoAWQ's 'gemm' layout loads "
                             "(re-export the model with version='gemm')")
        if not config.get("zero_point", True):
            raise ValueError("awq: checkpoints without zero points (zero_point: false) are not supported yet")
        group = int(config.get("group_size", config.get("q_group_size", 128)))
        return cls(group, list(config.get("modules_to_not_convert") or []))

    def linear_method(self, prefix: str) -> LinearMethod | None:
        if self.is_skipped(prefix, self.skip):
            return None
        return AWQLinearMethod(self.group_size)
