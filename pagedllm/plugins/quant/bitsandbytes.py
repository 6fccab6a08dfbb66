"""bitsandbytes checkpoints (`quant_method: "bitsandbytes"`), as transformers saves them.

4-bit (NF4 / FP4) linear weights arrive as several tensors per layer:
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

`weights()` folds each layer's tensors into its float weight as they stream past (one
layer at a time), so the model loads them as plain dense layers. There is no NF4 / FP4 or
LLM.int8 kernel here yet: the weights take the float model's memory, which the log says.
`--quantization bitsandbytes` on a float checkpoint (in-flight quantization) is refused
for the same reason: it would save nothing until such a kernel exists.
`--load-format bitsandbytes` is accepted (it means the default loader).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterator

import torch
from torch import nn

from pagedllm.core.contracts import LinearMethod, QuantConfig
from pagedllm.core.loader import HFDirectory

logger = logging.getLogger("pagedllm")

STATE_KEY = "quant_state.bitsandbytes__"  # + nf4 / fp4
PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def dequantize_4bit(packed: torch.Tensor, parts: dict[str, torch.Tensor], state: dict[str, Any]) -> torch.Tensor:
    """The float32 weight [N, K] of one serialized 4-bit bitsandbytes tensor."""
    shape = [int(s) for s in state["shape"]]
    numel = shape[0] * shape[1]
    flat = packed.reshape(-1)
    codes = torch.stack(((flat >> 4) & 0xF, flat & 0xF), dim=1).reshape(-1)[:numel].long()
    absmax = parts["absmax"]
    if "nested_absmax" in parts:
        nested_block = int(state["nested_blocksize"])
        idx = torch.arange(absmax.numel()) // nested_block
        absmax = parts["nested_quant_map"].float()[absmax.long()] * parts["nested_absmax"].float()[idx] \
            + float(state["nested_offset"])
    block = int(state["blocksize"])
    values = parts["quant_map"].float()[codes] * absmax.float().repeat_interleave(block)[:numel]
    return values.view(shape)


class BitsAndBytesConfig(QuantConfig):
    name = "bitsandbytes"
    aliases = ("bnb",)
    quantizes_dense = True  # so that the flag on a float checkpoint gets the message below

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.folded = 0

    @classmethod
    def from_config(cls, config: dict[str, Any], options: dict[str, Any]) -> "BitsAndBytesConfig":
        if not config:
            raise NotImplementedError(
                "--quantization bitsandbytes on a float checkpoint (in-flight 4-bit quantization) is not supported "
                "yet: there is no NF4/FP4 kernel here, so it would save no memory. Load an AWQ, GPTQ or "
                "compressed-tensors W4A16 checkpoint for 4-bit weights, or use --quantization fp8")
        if config.get("load_in_4bit"):
            return cls(4)
        if config.get("load_in_8bit"):
            return cls(8)
        raise ValueError("bitsandbytes: the quantization_config sets neither load_in_4bit nor load_in_8bit")

    def linear_method(self, prefix: str) -> LinearMethod | None:
        return None  # the weights arrive folded into float tensors (see `weights`)

    def weights(self, stream: Iterator[tuple[str, torch.Tensor]], model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
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
            folded = self._fold(owner, pending[owner])
            if folded is not None:
                del pending[owner]
                self.folded += 1
                yield owner, folded
        if pending:
            owner, parts = next(iter(pending.items()))
            raise ValueError(f"bitsandbytes: {owner} is incomplete in the checkpoint (has {sorted(parts)}; 4-bit "
                             f"needs weight, absmax, quant_map and the {STATE_KEY}* state, 8-bit weight and SCB)")
        if self.folded:
            logger.warning("bitsandbytes: %d layers' %d-bit weights dequantized once at load (there is no "
                           "NF4/FP4/LLM.int8 kernel here yet: they take the float model's memory)",
                           self.folded, self.bits)

    @staticmethod
    def _fold(owner: str, parts: dict[str, Any]) -> torch.Tensor | None:
        """The float weight once every part of `owner` is in, else None."""
        if "weight" not in parts:
            return None
        if "SCB" in parts:
            return parts["weight"].float() * parts["SCB"].float()[:, None] / 127.0
        state = parts.get("state")
        if state is None or "absmax" not in parts or "quant_map" not in parts:
            return None
        if "nested_blocksize" in state and ("nested_absmax" not in parts or "nested_quant_map" not in parts):
            return None
        return dequantize_4bit(parts["weight"], parts, state)


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
