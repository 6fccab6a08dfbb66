"""compressed-tensors checkpoints (llm-compressor's output), `quant_method: "compressed-tensors"`.

`config_groups` give schemes (weights, input activations) and the layers they target
(`"Linear"`, module names, or `re:` patterns); `ignore` lists layers left in float. A
fused layer of ours (qkv_proj) must get one scheme for all its parts.

Formats read here:
* `pack-quantized` (W4A16 / W8A16): per linear layer
    weight_packed      int32 [out, in * bits / 32]  codes + 2^(bits-1), packed along the input
    weight_scale       [out, in / group] (group), [out, 1] (channel)
    weight_zero_point  int32 [out * bits / 32, groups], packed along the output (asymmetric only)
    weight_g_idx       int32 [in] (actorder; optional)
    weight_shape       [2]
  and w = scale * (q - zero); they run on the shared integer kernels (int_weights.py).
* `int-quantized` (INT8 W8A8: int8 `weight`, `weight_scale` per channel [out, 1] or per
  tensor, activations per token or with a static `input_scale`): `Int8LinearMethod`,
  int8 GEMMs through `torch._int_mm`.
* `float-quantized` (FP8 W8A8): the fp8 plugin's method, with per-channel or per-tensor
  scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.core.contracts import LinearMethod, QuantConfig, skip_matches
from pagedllm.plugins.quant.fp8 import (
    Fp8Config,
    Fp8LinearMethod,
    register_tensor_scales,
    row_scale_param,
)
from pagedllm.plugins.quant.int_weights import (
    GroupedIntMethod,
    IntGroups,
    group_index_param,
    log_kernel_once,
    output_param,
    split_by_order,
    unpack_int32,
)

LINEAR_TARGETS = {"Linear", "torch.nn.Linear", "nn.Linear"}


@dataclass(frozen=True)
class Scheme:
    """One config group: what its weights (and activations) are."""

    name: str
    targets: tuple[str, ...]
    format: str
    weights: dict[str, Any]
    activations: dict[str, Any] | None

    def targets_layer(self, checkpoint_name: str) -> bool:
        return any(t in LINEAR_TARGETS or skip_matches(checkpoint_name, t) for t in self.targets)


class PackQuantizedMethod(GroupedIntMethod):
    format_name = "compressed-tensors pack-quantized"
    checkpoint_tensors = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")

    def __init__(self, bits: int, group_size: int | None, symmetric: bool) -> None:
        self.bits = bits
        self.group_size = group_size  # None: one group per output row (channel)
        self.symmetric = symmetric

    def create_checkpoint_tensors(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        per_word = 32 // self.bits
        group = self.group_size or input_size
        bad = [s for s in output_sizes if s % per_word]
        if input_size % group or input_size % per_word or (bad and not self.symmetric):
            raise ValueError(f"compressed-tensors {layer.prefix}: input size {input_size} must be a multiple of "
                             f"group_size {group} and of {per_word}"
                             + ("" if self.symmetric else f", every output size of {per_word} (got {output_sizes})"))
        n, groups = sum(output_sizes), input_size // group
        output_param(layer, "weight_packed", (n, input_size // per_word), torch.int32, output_sizes, 0)
        output_param(layer, "weight_scale", (n, groups), torch.float32, output_sizes, 0)
        if not self.symmetric:
            output_param(layer, "weight_zero_point", (n // per_word, groups), torch.int32, output_sizes, 0, per_word)
        shape = nn.Parameter(torch.zeros(len(output_sizes), 2, dtype=torch.int64), requires_grad=False)
        shape.per_shard = True  # type: ignore[attr-defined]
        layer.register_parameter("weight_shape", shape)
        group_index_param(layer, "weight_g_idx", input_size, group, len(output_sizes))  # actorder only
        layer.int_group = group

    def unpack(self, layer: nn.Module) -> list[IntGroups]:
        bits, group, k = self.bits, layer.int_group, layer.int_input_size
        for shard, size in enumerate(layer.int_output_sizes):
            if layer.weight_shape.data[shard].tolist() != [size, k]:
                raise ValueError(f"compressed-tensors {layer.prefix}: weight_shape of shard {shard} is "
                                 f"{layer.weight_shape.data[shard].tolist()}, expected {[size, k]}")
        codes = unpack_int32(layer.weight_packed.data, bits, 1)  # [out, in], unsigned (q + 2^(bits-1))
        scales = layer.weight_scale.data.float()
        if self.symmetric:
            zeros = torch.full_like(scales, float(1 << (bits - 1)))
        else:
            zeros = unpack_int32(layer.weight_zero_point.data, bits, 0).float()
        return split_by_order(codes, scales, zeros, layer.weight_g_idx.data, layer.int_output_sizes, group, bits,
                              f"compressed-tensors {layer.prefix}")


class CompressedTensorsConfig(QuantConfig):
    name = "compressed-tensors"
    aliases = ("compressed_tensors",)

    def __init__(self, schemes: list[Scheme], ignore: list[str]) -> None:
        self.schemes = schemes
        self.ignore = ignore

    @classmethod
    def from_config(cls, config: dict[str, Any], options: dict[str, Any]) -> "CompressedTensorsConfig":
        if config.get("sparsity_config") and config["sparsity_config"].get("format", "dense") != "dense":
            raise ValueError("compressed-tensors: sparse checkpoints (sparsity_config) are not supported yet")
        top_format = config.get("format")
        schemes = []
        for name, group in (config.get("config_groups") or {}).items():
            schemes.append(Scheme(name, tuple(group.get("targets") or ()), group.get("format") or top_format or "",
                                  dict(group.get("weights") or {}), group.get("input_activations")))
        if not schemes:
            raise ValueError("compressed-tensors: the quantization_config has no config_groups")
        return cls(schemes, list(config.get("ignore") or []))

    def _scheme(self, prefix: str) -> Scheme | None:
        names = self.checkpoint_names(prefix)
        picked = {n: next((s for s in self.schemes if s.targets_layer(n)), None) for n in names}
        chosen = set(s.name if s else None for s in picked.values())
        if len(chosen) > 1:
            raise ValueError(f"compressed-tensors: {prefix} runs as one fused layer but its parts have different "
                             f"schemes ({ {n: s.name if s else None for n, s in picked.items()} })")
        return picked[names[0]]

    def linear_method(self, prefix: str) -> LinearMethod | None:
        if self.is_skipped(prefix, self.ignore):
            return None
        scheme = self._scheme(prefix)
        if scheme is None:
            return None
        w = scheme.weights
        if scheme.format == "pack-quantized" and scheme.activations is None:
            if w.get("type", "int") != "int" or int(w.get("num_bits", 4)) not in (4, 8):
                raise ValueError(f"compressed-tensors: pack-quantized {w.get('type')} {w.get('num_bits')}-bit "
                                 "weights are not supported (int 4 and 8 bits are)")
            strategy = w.get("strategy", "group")
            if strategy not in ("group", "channel"):
                raise ValueError(f"compressed-tensors: pack-quantized strategy {strategy!r} is not supported "
                                 "(group, channel)")
            group = int(w["group_size"]) if strategy == "group" else None
            return PackQuantizedMethod(int(w.get("num_bits", 4)), group, bool(w.get("symmetric", True)))
        a = scheme.activations or {}
        if scheme.format in ("int-quantized", "float-quantized") and int(w.get("num_bits", 8)) == 8 and a:
            strategy, act = w.get("strategy", "channel"), a.get("strategy", "token")
            dynamic = bool(a.get("dynamic", True))
            if strategy not in ("channel", "tensor") or (dynamic and act != "token") or \
                    (not dynamic and act != "tensor") or not w.get("symmetric", True) or \
                    not a.get("symmetric", True) or a.get("type", w.get("type")) != w.get("type"):
                raise ValueError(f"compressed-tensors: W8A8 with {strategy} {'symmetric' if w.get('symmetric', True) else 'asymmetric'} "
                                 f"weights and {'dynamic' if dynamic else 'static'} {act} activations is not supported "
                                 "(channel or tensor symmetric weights, dynamic per-token or static per-tensor "
                                 "symmetric activations are)")
            if scheme.format == "float-quantized":
                return Fp8LinearMethod(Fp8Config(True, not dynamic, None, []), channel_scales=strategy == "channel")
            return Int8LinearMethod(strategy == "channel", static=not dynamic)
        raise NotImplementedError(
            f"compressed-tensors: format {scheme.format!r} with weights {w.get('type')}{w.get('num_bits')} and "
            f"input activations {a.get('type')}{a.get('num_bits', '')} is not supported yet (pack-quantized "
            "W4A16/W8A16 and int-/float-quantized W8A8 are)")


class Int8LinearMethod(LinearMethod):
    """INT8 W8A8 (compressed-tensors `int-quantized`): int8 weights with one scale per
    output row (or per tensor), activations quantized per token (or with a static scale),
    int8 x int8 products summed in int32 by `torch._int_mm` (oneDNN on the CPU: AMX-INT8
    or VNNI where the CPU has them), then scaled.

    Tensor parallel as the FP8 method's per-tensor / per-channel layouts (fp8.py): codes
    narrow like a weight, per-tensor and input scales stay whole, channel scales follow
    the rows; under row parallel each rank quantizes its slice of the activations."""

    supports_tensor_parallel = True

    def __init__(self, channel_scales: bool, static: bool) -> None:
        self.channel_scales = channel_scales
        self.static = static

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        n = sum(output_sizes)
        layer.int8_sizes, layer.int8_in = list(output_sizes), input_size
        output_param(layer, "weight", (n, input_size), torch.int8, list(output_sizes), 0)
        if self.channel_scales:
            row_scale_param(layer, "weight_scale", list(output_sizes))
        scalars = (() if self.channel_scales else ("weight_scale",)) + (("input_scale",) if self.static else ())
        register_tensor_scales(layer, scalars, len(output_sizes))

    def process_after_loading(self, layer):
        codes = layer.weight.data
        sizes = torch.tensor(layer.int8_sizes, device=codes.device)
        scale = layer.weight_scale.data
        layer.int8_row_scale = (scale.view(-1) if self.channel_scales else scale.repeat_interleave(sizes)).float()
        layer.int8_input_scale = float(layer.input_scale.data.max()) if self.static else None
        del layer.weight, layer.weight_scale
        if hasattr(layer, "input_scale"):
            del layer.input_scale
        layer.register_parameter("weight_t", nn.Parameter(codes.t().contiguous(), requires_grad=False))
        log_kernel_once("compressed-tensors int8 W8A8", "torch._int_mm (oneDNN int8 on the CPU)"
                        if codes.device.type == "cpu" else "torch._int_mm (cuBLAS int8)")

    def apply(self, layer, x, bias):
        x2 = x.reshape(-1, layer.int8_in).float()
        if layer.int8_input_scale is not None:
            x_scale = torch.full((x2.shape[0], 1), layer.int8_input_scale, device=x.device)
        else:
            x_scale = (x2.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-12)
        xq = (x2 / x_scale).round().clamp(-128, 127).to(torch.int8)
        rows = xq.shape[0]
        if x.device.type == "cuda" and rows <= 16:  # cuBLAS int8 GEMMs take more than 16 rows
            xq = torch.cat([xq, xq.new_zeros(17 - rows, xq.shape[1])])
        out = torch._int_mm(xq, layer.weight_t)[:rows].float() * x_scale * layer.int8_row_scale
        if bias is not None:
            out = out + bias
        return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])
