"""GPTQ checkpoints (AutoGPTQ / GPTQModel), `quant_method: "gptq"` (vLLM's `gptq_marlin` too).

Per linear layer, with b bits (4 or 8), p = 32 / b codes per word and g = group_size
(-1: one group over the whole input):
  qweight int32 [in / p, out]   codes packed along the input dim (input row i of a word
                                 at bits [b * i, b * (i + 1)))
  qzeros  int32 [groups, out / p] zero points packed along the output dim; the v1 format
                                 (checkpoint_format "gptq", the default) stores zero - 1
  scales  fp16  [groups, out]
  g_idx   int32 [in]            the group of each input row; with desc_act (act-order)
                                 not in row order
and w[out, in] = scales[g_idx[in], out] * (q - zero[g_idx[in], out]). Act-order layers
are run with their input columns permuted so that each group is contiguous (the
activations are permuted the same way per call). GPTQ exports all-zero biases for
layers that have none; those are dropped from the weight stream.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from pagedllm.core.contracts import LinearMethod, QuantConfig
from pagedllm.plugins.quant.int_weights import (
    GroupedIntMethod,
    IntGroups,
    group_index_param,
    output_param,
    split_by_order,
    unpack_int32,
)


class GPTQLinearMethod(GroupedIntMethod):
    format_name = "gptq"
    checkpoint_tensors = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, bits: int, group_size: int, zero_offset: int) -> None:
        self.bits = bits
        self.group_size = group_size
        self.zero_offset = zero_offset  # 1 for v1 checkpoints (zero - 1 stored)

    def create_checkpoint_tensors(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        per_word = 32 // self.bits
        group = input_size if self.group_size == -1 else self.group_size
        bad = [s for s in output_sizes if s % per_word]
        if input_size % group or input_size % per_word or bad:
            raise ValueError(f"gptq {layer.prefix}: input size {input_size} must be a multiple of group_size "
                             f"{group} and of {per_word}, every output size a multiple of {per_word} "
                             f"(got {output_sizes})")
        n, groups = sum(output_sizes), input_size // group
        output_param(layer, "qweight", (input_size // per_word, n), torch.int32, output_sizes, 1)
        output_param(layer, "qzeros", (groups, n // per_word), torch.int32, output_sizes, 1, per_word)
        output_param(layer, "scales", (groups, n), torch.float32, output_sizes, 1)
        group_index_param(layer, "g_idx", input_size, group, len(output_sizes))
        layer.int_group = group

    def unpack(self, layer: nn.Module) -> list[IntGroups]:
        bits, group = self.bits, layer.int_group
        codes = unpack_int32(layer.qweight.data, bits, 0).t().contiguous()  # [out, in]
        zeros = (unpack_int32(layer.qzeros.data, bits, 1).to(torch.int32) + self.zero_offset).t().float()
        scales = layer.scales.data.t().float()
        return split_by_order(codes, scales, zeros, layer.g_idx.data, layer.int_output_sizes, group, bits,
                              f"gptq {layer.prefix}")


class GPTQConfig(QuantConfig):
    """4- and 8-bit GPTQ, symmetric or not, with or without act-order."""

    name = "gptq"
    aliases = ("gptq_marlin",)

    def __init__(self, bits: int, group_size: int, zero_offset: int, skip: list[str]) -> None:
        self.bits = bits
        self.group_size = group_size
        self.zero_offset = zero_offset
        self.skip = skip

    @classmethod
    def from_config(cls, config: dict[str, Any], options: dict[str, Any]) -> "GPTQConfig":
        bits = int(config.get("bits", 4))
        if bits not in (4, 8):
            raise ValueError(f"gptq: {bits}-bit checkpoints are not supported (4 and 8 bits are)")
        fmt = str(config.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq: checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        if config.get("dynamic"):
            raise ValueError("gptq: per-module 'dynamic' overrides are not supported yet")
        if config.get("lm_head"):
            raise ValueError("gptq: a quantized lm_head (lm_head: true) is not supported yet")
        skip = list(config.get("modules_to_not_convert") or [])
        return cls(bits, int(config.get("group_size", 128)), 1 if fmt == "gptq" else 0, skip)

    def linear_method(self, prefix: str) -> LinearMethod | None:
        if self.is_skipped(prefix, self.skip):
            return None
        return GPTQLinearMethod(self.bits, self.group_size, self.zero_offset)

    def weights(self, stream: Iterator[tuple[str, torch.Tensor]], model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Drop the all-zero `.bias` tensors GPTQ exports write for layers without a bias."""
        has = {name for name, _ in model.named_parameters()}
        fused = {part: f"{target}" for part, (target, _) in getattr(self, "packed_modules", {}).items()}
        for name, tensor in stream:
            if name.endswith(".bias") and not _has_param(name, has, fused) and not bool(tensor.any()):
                continue
            yield name, tensor


def _has_param(name: str, params: set[str], fused: dict[str, str]) -> bool:
    parts = name.split(".")
    return ".".join(fused.get(p, p) for p in parts) in params
