"""bitsandbytes (`quant_method: "bitsandbytes"`, `--quantization bitsandbytes`).

Checkpoints as transformers saves them. 4-bit (NF4 / FP4) linear weights arrive as
several tensors per layer:
  X.weight                                 uint8 [N * K / 2, 1]: two codes per byte, the
                                           first in the high nibble
  X.weight.absmax                          float32 per block of `blocksize` values, or
                                           uint8 codes of it with double quantization:
  X.weight.nested_absmax, .nested_quant_map  absmax = nested_quant_map[code] *
                                           nested_absmax[block / nested_blocksize] + offset
  X.weight.quant_map                       float32 [16]: the value of each code
  X.weight.quant_state.bitsandbytes__nf4   uint8 bytes of a JSON dict (blocksize, shape,
                                           dtype, nested_blocksize, nested_offset, quant_type)
and w = quant_map[code] * absmax[block]. 8-bit (LLM.int8) weights are int8 `X.weight`
with `X.SCB` (each row's absmax): w = weight * SCB / 127.

`weights()` folds each layer's tensors into its weight, tagged for the layer's loader, as
they stream past. 4-bit codes run on the native codebook kernel (pd_linear_lut4: 16
values per code, times the block's absmax); 8-bit on the shared integer kernels (native
8-bit). `--quantization bitsandbytes` on a float checkpoint quantizes each weight to NF4
(blocks of 64, nearest codebook value) as it loads. `--load-format bitsandbytes` is
accepted (it means the default loader). On CUDA the 4-bit codes run on triton_int.py's
dequant-GEMM in its codebook mode (w = quant_map[code] * absmax, tile by tile).
"""

from __future__ import annotations

import functools
import json
from typing import Any, Iterator

import torch
from torch import nn

from pagedllm import ops
from pagedllm.core.contracts import LinearMethod, QuantConfig
from pagedllm.core.loader import HFDirectory
from pagedllm.ops.cpu import native
from pagedllm.plugins.quant.int_weights import GroupedIntMethod, IntGroups, log_kernel_once, triton_installed

STATE_KEY = "quant_state.bitsandbytes__"  # + nf4 / fp4
PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


# bitsandbytes' NF4 codebook (QLoRA): the 16 values a code stands for, before the block's absmax
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
       1.0]
IN_FLIGHT_BLOCK = 64  # bitsandbytes' default blocksize


def quantize_nf4(w: torch.Tensor, block: int = IN_FLIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> NF4 codes [N, K] and absmax [N, K / block] (the nearest
    codebook value to w / absmax, as bitsandbytes quantizes)."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // block, block)
    absmax = blocks.abs().amax(dim=-1).clamp(min=1e-12)
    normed = (blocks / absmax[..., None]).reshape(n, k)
    table = torch.tensor(NF4, device=w.device)
    mids = (table[1:] + table[:-1]) / 2
    codes = torch.bucketize(normed, mids).to(torch.uint8)
    return codes, absmax


def _unpack_codes(packed: torch.Tensor, shape: list[int]) -> torch.Tensor:
    flat = packed.reshape(-1)
    return torch.stack(((flat >> 4) & 0xF, flat & 0xF), dim=1).reshape(-1)[:shape[0] * shape[1]].view(shape)


def codebook_kernel(device: torch.device, block: int, input_size: int) -> str:
    """Which kernel multiplies 4-bit codebook weights here: "native" (pd_linear_lut4 on
    the CPU), "triton" (the codebook variant of triton_int's dequant-GEMM, CUDA with triton
    installed), else "dense" (one dequantized copy made at load)."""
    if device.type == "cpu" and native.available() and block % 16 == 0:
        return "native"
    if device.type == "cuda" and block % 16 == 0 and input_size % 8 == 0 and triton_installed():
        return "triton"
    return "dense"


class BnB4bitMethod(LinearMethod):
    """4-bit codebook weights (NF4 / FP4) per shard: from a checkpoint (folded by
    `BitsAndBytesConfig.weights`) or quantized to NF4 as a float weight loads. The codes
    stay 4-bit: the native codebook kernel (pd_linear_lut4) reads them on the CPU, a Triton
    dequant-GEMM on CUDA (`codebook_kernel`); elsewhere a dense copy is made once at load."""

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        weight = nn.Parameter(torch.empty(0), requires_grad=False)
        weight.weight_loader = functools.partial(self._load, layer)  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)
        layer.bnb_sizes, layer.bnb_in, layer.bnb_dtype = list(output_sizes), input_size, params_dtype
        layer.bnb_shards = [None] * len(output_sizes)  # (codes [rows, K], lut [16], absmax [rows, K / block])

    @staticmethod
    def _load(layer, param, loaded, shard):
        rows = sum(layer.bnb_sizes) if shard is None else layer.bnb_sizes[shard]
        parts = getattr(loaded, "bnb_4bit", None)
        if parts is None:  # a float weight: quantize it now (in-flight)
            if tuple(loaded.shape) != (rows, layer.bnb_in) or layer.bnb_in % IN_FLIGHT_BLOCK:
                raise ValueError(f"shape {tuple(loaded.shape)} does not match {(rows, layer.bnb_in)} (in-flight NF4 "
                                 f"needs the input size to be a multiple of {IN_FLIGHT_BLOCK})")
            codes, absmax = quantize_nf4(loaded)
            entry = (codes, torch.tensor(NF4), absmax)
        else:
            codes, lut, absmax = parts
            if tuple(codes.shape) != (rows, layer.bnb_in):
                raise ValueError(f"shape {tuple(codes.shape)} does not match {(rows, layer.bnb_in)}")
            entry = (codes, lut, absmax.reshape(rows, -1))
        # checkpoint tensors arrive on the CPU; the kernel is chosen by where the shards are
        layer.bnb_shards[shard or 0] = tuple(t.to(param.device) for t in entry)

    def process_after_loading(self, layer):
        if any(s is None for s in layer.bnb_shards):
            raise ValueError(f"bitsandbytes {layer.prefix}: a shard's weight was never loaded")
        device = layer.bnb_shards[0][0].device
        del layer.weight
        layer.bnb_kernels, layer.bnb_dense = [], None
        block = layer.bnb_in // layer.bnb_shards[0][2].shape[1]
        layer.bnb_triton = []
        kernel = codebook_kernel(device, block, layer.bnb_in)
        if kernel == "triton":
            from pagedllm.plugins.quant import triton_int

            row = 0
            for i, (codes, lut, absmax) in enumerate(layer.bnb_shards):
                words = triton_int.pack(codes, 4)
                scales = absmax.float().t().contiguous()
                layer.register_parameter(f"qweight_{i}", nn.Parameter(words, requires_grad=False))
                layer.register_parameter(f"qweight_absmax_{i}", nn.Parameter(scales, requires_grad=False))
                layer.bnb_triton.append((words, scales, lut.float().contiguous().to(device), block, row,
                                         row + codes.shape[0]))
                row += codes.shape[0]
            log_kernel_once("bitsandbytes 4-bit", "Triton codebook dequant-GEMM (triton_int.py)")
        elif kernel == "native":
            row = 0
            for i, (codes, lut, absmax) in enumerate(layer.bnb_shards):
                w = native.pack_lut4(codes, lut, absmax)
                layer.register_parameter(f"qweight_{i}", nn.Parameter(w.codes, requires_grad=False))
                layer.register_parameter(f"qweight_absmax_{i}", nn.Parameter(w.absmax, requires_grad=False))
                layer.bnb_kernels.append((w, row, row + w.n))
                row += w.n
            log_kernel_once("bitsandbytes 4-bit", "native codebook (pd_linear_lut4)")
        else:
            dense = torch.cat([lut.float()[codes.long()] * absmax.repeat_interleave(block, 1)
                               for codes, lut, absmax in layer.bnb_shards]).to(layer.bnb_dtype)
            layer.bnb_dense = ops.pack_linear(dense)
            if not layer.bnb_dense.owns_copy:
                layer.register_parameter("weight", nn.Parameter(dense, requires_grad=False))
            log_kernel_once("bitsandbytes 4-bit", f"dense copy made at load (no codebook kernel on {device.type})")
        layer.bnb_shards = []

    def apply(self, layer, x, bias):
        if layer.bnb_dense is not None:
            return layer.bnb_dense(x, bias)
        k, n = layer.bnb_in, sum(layer.bnb_sizes)
        x2 = x.reshape(-1, k)
        if layer.bnb_triton:
            from pagedllm.plugins.quant import triton_int

            xt = triton_int.operand(x2)
            out = torch.empty(x2.shape[0], n, dtype=torch.float32, device=x.device)
            for words, scales, lut, block, start, end in layer.bnb_triton:
                out[:, start:end] = triton_int.linear(xt, words, scales, lut, block, 4, codebook=True)
        elif len(layer.bnb_kernels) == 1:
            out = native.lut4_linear(x2.float().contiguous(), layer.bnb_kernels[0][0])
        else:
            x2 = x2.float().contiguous()
            out = torch.empty(x2.shape[0], n, dtype=torch.float32)
            for w, start, end in layer.bnb_kernels:
                native.lut4_linear(x2, w, out[:, start:end])
        if bias is not None:
            out += bias
        return out.to(x.dtype).view(*x.shape[:-1], n)


class BnB8bitMethod(GroupedIntMethod):
    """LLM.int8 weights (int8 codes, each row's absmax `SCB`): w = q * SCB / 127, one
    group per row; the shared integer kernels run them (native 8-bit on the CPU)."""

    format_name = "bitsandbytes 8-bit"

    def create_checkpoint_tensors(self, layer, input_size, output_sizes):
        weight = nn.Parameter(torch.empty(0), requires_grad=False)
        weight.weight_loader = functools.partial(self._load, layer)  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)
        layer.bnb_shards = [None] * len(output_sizes)
        layer.int_group = input_size
        self.checkpoint_tensors = ("weight",)

    @staticmethod
    def _load(layer, param, loaded, shard):
        scb = getattr(loaded, "bnb_scb", None)
        rows = sum(layer.int_output_sizes) if shard is None else layer.int_output_sizes[shard]
        if scb is None or tuple(loaded.shape) != (rows, layer.int_input_size):
            raise ValueError(f"expected int8 codes {(rows, layer.int_input_size)} with their SCB, got "
                             f"{tuple(loaded.shape)}")
        layer.bnb_shards[shard or 0] = (loaded.to(param.device), scb.to(param.device))

    def unpack(self, layer):
        codes = torch.cat([c for c, _ in layer.bnb_shards])
        scales = torch.cat([s for _, s in layer.bnb_shards]).float()[:, None] / 127.0
        layer.bnb_shards = []
        unsigned = (codes.to(torch.int16) + 128).to(torch.uint8)
        return [IntGroups(unsigned, scales, torch.full_like(scales, 128.0), layer.int_group, 8)]


class BitsAndBytesConfig(QuantConfig):
    name = "bitsandbytes"
    aliases = ("bnb",)
    quantizes_dense = True  # --quantization bitsandbytes on a float checkpoint: NF4 as it loads

    def __init__(self, bits: int, skip: list[str]) -> None:
        self.bits = bits
        self.skip = skip

    @classmethod
    def from_config(cls, config: dict[str, Any], options: dict[str, Any]) -> "BitsAndBytesConfig":
        skip = list(config.get("llm_int8_skip_modules") or [])
        if not config or config.get("load_in_4bit"):
            return cls(4, skip)
        if config.get("load_in_8bit"):
            return cls(8, skip)
        raise ValueError("bitsandbytes: the quantization_config sets neither load_in_4bit nor load_in_8bit")

    def linear_method(self, prefix: str) -> LinearMethod | None:
        if self.is_skipped(prefix, self.skip):
            return None
        return BnB4bitMethod() if self.bits == 4 else BnB8bitMethod()

    def weights(self, stream: Iterator[tuple[str, torch.Tensor]], model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Fold each layer's bitsandbytes tensors into its weight (tagged for the layer's
        loader) as they stream past; float tensors pass unchanged."""
        pending: dict[str, dict[str, Any]] = {}  # layer weight name -> the parts seen so far
        for name, tensor in stream:
            owner, part = _bnb_part(name)
            if owner is None:
                if name in pending or (name.endswith(".weight") and tensor.dtype in (torch.uint8, torch.int8)):
                    pending.setdefault(name, {})["weight"] = tensor
                else:
                    yield name, tensor
                    continue
                owner = name
            elif part == "state":
                pending.setdefault(owner, {})["state"] = json.loads(bytes(tensor.reshape(-1).tolist()).decode())
            else:
                pending.setdefault(owner, {})[part] = tensor
            folded = _fold(pending[owner])
            if folded is not None:
                del pending[owner]
                yield owner, folded
        if pending:
            owner, parts = next(iter(pending.items()))
            raise ValueError(f"bitsandbytes: {owner} is incomplete in the checkpoint (has {sorted(parts)}; 4-bit "
                             f"needs weight, absmax, quant_map and the {STATE_KEY}* state, 8-bit weight and SCB)")


def _fold(parts: dict[str, Any]) -> torch.Tensor | None:
    """The layer's weight tagged with what its method loads, once every part is in."""
    if "weight" not in parts:
        return None
    if "SCB" in parts:
        codes = parts["weight"]
        codes.bnb_scb = parts["SCB"]  # type: ignore[attr-defined]
        return codes
    state = parts.get("state")
    if state is None or "absmax" not in parts or "quant_map" not in parts:
        return None
    if "nested_blocksize" in state and ("nested_absmax" not in parts or "nested_quant_map" not in parts):
        return None
    shape = [int(v) for v in state["shape"]]
    codes = _unpack_codes(parts["weight"], shape)
    codes.bnb_4bit = (codes, parts["quant_map"].float(), absmax_of(parts, state))  # type: ignore[attr-defined]
    return codes


def absmax_of(parts: dict[str, torch.Tensor], state: dict[str, Any]) -> torch.Tensor:
    """Each block's absmax in float32 (undoing double quantization where it was applied)."""
    absmax = parts["absmax"]
    if "nested_absmax" not in parts:
        return absmax.float()
    idx = torch.arange(absmax.numel()) // int(state["nested_blocksize"])
    return parts["nested_quant_map"].float()[absmax.long()] * parts["nested_absmax"].float()[idx] \
        + float(state["nested_offset"])


def _bnb_part(name: str) -> tuple[str | None, str | None]:
    """("X.weight", part) for the extra tensors bitsandbytes saves beside X.weight."""
    if name.endswith(".SCB"):
        return name[:-len("SCB")] + "weight", "SCB"
    if name.endswith(".weight_format"):
        return name[:-len("_format")], "format"
    head, _, tail = name.rpartition(".weight.")
    if not head:
        return None, None
    if tail.startswith(STATE_KEY):
        return f"{head}.weight", "state"
    if tail in PARTS:
        return f"{head}.weight", tail
    return None, None


class BitsAndBytesFormat(HFDirectory):
    """`--load-format bitsandbytes` (vLLM's spelling): a Hugging Face directory read as
    usual; the quantizer folds the bitsandbytes tensors. Never picked by `auto`."""

    name = "bitsandbytes"

    @classmethod
    def detect(cls, path: str) -> bool:
        return False
