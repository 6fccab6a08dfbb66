"""Keep-quantized GGUF: linear weights stay as raw ggml blocks and are dequantized per call.

`GGUFFormat.weights()` (with `gguf_keep_quantized`) yields each linear weight as a uint8
tensor [rows, bytes_per_row] tagged with `gguf_qtype` (see `tag_raw`). A fused layer
(qkv, gate_up) receives one GGUF tensor per shard, possibly of different types (Q4_K_M
files store v in Q6_K and q/k in Q4_K), so the loader keeps shards apart until
`process_after_loading` joins neighbours of equal type into one parameter. `apply`
dequantizes the parameters with the torch kernels of `gguf_dequant` and runs one
matmul: memory stays at the file's size, at the cost of dequantizing every call.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.core.contracts import LinearMethod, QuantConfig
from pagedllm.plugins.quant.gguf_dequant import dequantize
from pagedllm.plugins.quant.gguf_file import check_supported, type_name


def tag_raw(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """Mark a uint8 [rows, bytes_per_row] tensor as ggml blocks of type `qtype`.

    The tag is a plain attribute: the worker passes non-float tensors through untouched,
    and `GGUFLinearMethod`'s loader is the only reader.
    """
    raw.gguf_qtype = qtype  # type: ignore[attr-defined]
    return raw


def raw_num_cols(raw: torch.Tensor, qtype: int) -> int:
    block_size, type_size = check_supported(qtype, "tensor")
    return raw.shape[-1] // type_size * block_size


class GGUFLinearMethod(LinearMethod):
    """A linear layer whose weight is one or more groups of raw ggml blocks.

    After loading, `layer.gguf_groups` lists (parameter name, ggml type or None for a
    float weight) in output-row order; the parameters are `weight`, `weight_1`, ...
    """

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: Sequence[int],
                       params_dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        weight.weight_loader = functools.partial(self._load_shard, layer)  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)
        layer.gguf_output_sizes = list(output_sizes)
        layer.gguf_input_size = input_size
        layer.gguf_shards = [None] * len(output_sizes)  # (ggml type | None, tensor) per shard
        layer.gguf_groups = []

    @staticmethod
    def _load_shard(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard: int | None) -> None:
        qtype = getattr(loaded, "gguf_qtype", None)
        rows = sum(layer.gguf_output_sizes) if shard is None else layer.gguf_output_sizes[shard]
        cols = loaded.shape[-1] if qtype is None else raw_num_cols(loaded, qtype)
        if loaded.dim() != 2 or loaded.shape[0] != rows or cols != layer.gguf_input_size:
            kind = "float" if qtype is None else type_name(qtype)
            raise ValueError(f"{layer.prefix}: {kind} weight{'' if shard is None else f' shard {shard}'} has "
                             f"{loaded.shape[0]}x{cols} values, expected {rows}x{layer.gguf_input_size}")
        entry = (qtype, loaded.to(param.device))
        if shard is None:
            layer.gguf_shards = [entry]
        else:
            layer.gguf_shards[shard] = entry

    def process_after_loading(self, layer: nn.Module) -> None:
        shards = layer.gguf_shards
        if any(s is None for s in shards):
            missing = [i for i, s in enumerate(shards) if s is None]
            raise ValueError(f"{layer.prefix}: GGUF weight shards {missing} were never loaded")
        groups: list[tuple[int | None, list[torch.Tensor]]] = []
        for qtype, tensor in shards:  # join neighbours of one type: one dequant call each
            if groups and groups[-1][0] == qtype:
                groups[-1][1].append(tensor)
            else:
                groups.append((qtype, [tensor]))
        del layer.weight
        layer.gguf_groups = []
        for i, (qtype, parts) in enumerate(groups):
            name = "weight" if i == 0 else f"weight_{i}"
            data = parts[0] if len(parts) == 1 else torch.cat(parts)
            layer.register_parameter(name, nn.Parameter(data, requires_grad=False))
            layer.gguf_groups.append((name, qtype))
        layer.gguf_shards = []

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        dense = []
        for name, qtype in layer.gguf_groups:
            data = getattr(layer, name)
            if qtype is not None:
                data = dequantize(data, qtype, (data.shape[0], layer.gguf_input_size))
            dense.append(data.to(x.dtype))
        weight = dense[0] if len(dense) == 1 else torch.cat(dense)
        return F.linear(x, weight, bias)


class GGUFConfig(QuantConfig):
    """`--quantization gguf`: every linear layer keeps its GGUF blocks (see the module doc).

    Chosen by `GGUFFormat.quantization()` when the `gguf_keep_quantized` option is set.
    """

    name = "gguf"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GGUFConfig":
        return cls()

    def linear_method(self, prefix: str) -> LinearMethod | None:
        return GGUFLinearMethod()
