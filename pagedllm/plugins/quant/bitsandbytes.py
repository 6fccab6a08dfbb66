"""bitsandbytes (`quant_method: "bitsandbytes"`, `--quantization bitsandbytes`): not built yet.

Named here so that a bitsandbytes checkpoint or flag fails at start-up saying what is
missing, rather than as an unknown format. What it needs: an NF4 / FP4 kernel for the
CPU (a 16-entry codebook per 4-bit code, times a block absmax: the native Q4 kernels
multiply integer codes, so NF4 does not map onto them exactly), the loader for
transformers' serialized quant state (`weight.absmax`, `weight.quant_map`, the nested
double-quant tensors, `weight.quant_state.bitsandbytes__nf4`), 8-bit `SCB` rows, and
in-flight 4-bit quantization of a dense checkpoint.
"""

from __future__ import annotations

from typing import Any

from pagedllm.core.contracts import LinearMethod, QuantConfig


class BitsAndBytesConfig(QuantConfig):
    name = "bitsandbytes"
    aliases = ("bnb",)
    quantizes_dense = True  # --quantization bitsandbytes on a float checkpoint is what users type

    @classmethod
    def from_config(cls, config: dict[str, Any], options: dict[str, Any]) -> "BitsAndBytesConfig":
        raise NotImplementedError(
            "bitsandbytes quantization is not supported yet: pagedllm has no NF4/FP4 kernel or loader for "
            "bitsandbytes' quant state. Use an AWQ, GPTQ or compressed-tensors W4A16 checkpoint for 4-bit "
            "weights, or --quantization fp8 on this checkpoint")

    def linear_method(self, prefix: str) -> LinearMethod | None:  # pragma: no cover - never built
        raise NotImplementedError
