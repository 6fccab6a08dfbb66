"""Quantization: a format's config picks, per layer, how weights are stored and multiplied.

The unquantized methods are the defaults (plugins/models/layers.py), so a layer never
asks whether it is quantized.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import re
from typing import Any, ClassVar, Iterator, Mapping, Sequence

import torch
from torch import nn


class LinearMethod(ABC):
    """How one linear layer stores its weight and computes x @ W^T.

    The unquantized method is the default, so a layer never asks "am I quantized?".
    """

    # whether its parameters load a tensor-parallel rank's slice (`create_weights` gets
    # the rank's sizes; the layer narrows checkpoint tensors): a layer refuses more than
    # one tensor-parallel rank with a method that does not
    supports_tensor_parallel: ClassVar[bool] = False

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: Sequence[int],
        params_dtype: torch.dtype,
    ) -> None:
        """Register the layer's parameters. `output_sizes` lists the fused sub-matrices
        (e.g. q, k, v) on this rank; each parameter gets a `weight_loader` attribute
        `(param, tensor, shard_index | None)` when its loading is not a plain copy."""

    def process_after_loading(self, layer: nn.Module) -> None:
        """Repack or convert the loaded weights (called once, after all weights load)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Return x @ W^T (+ bias) for x of shape [..., input_size]."""

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """For a gate/up layer (output [gate | up]): silu(gate) * up of `apply`'s result,
        computed in one pass where the method's kernel fuses the activation (it then never
        writes the product), else None and the layer runs `apply` and the activation op.
        A fused result must equal the two run apart."""
        return None


class EmbeddingMethod(ABC):
    """How a vocabulary matrix [vocab, hidden] is stored and used: rows are looked up for
    input ids, and the same matrix (tied embeddings) or an lm_head computes logits.

    Quantized checkpoints (GGUF stores token_embd in Q8_0 or Q6_K) may keep the matrix in
    their own blocks; the default method keeps one dense tensor.
    """

    # as LinearMethod's: whether it holds one rank's vocabulary rows
    supports_tensor_parallel: ClassVar[bool] = False

    @abstractmethod
    def create_weights(self, layer: nn.Module, vocab_size: int, hidden_size: int, params_dtype: torch.dtype) -> None:
        """Register the layer's parameters (a `weight_loader` attribute when loading is
        not a plain copy)."""

    def process_after_loading(self, layer: nn.Module) -> None:
        """Repack or convert the loaded weights (called once, after all weights load).
        `layer.serves_logits` is False for an input embedding whose model has its own
        lm_head (untied): `logits` is never called on it, so whatever only logits would
        read (a packed head, kernel timings) need not be built."""

    @abstractmethod
    def embed(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the matrix for `input_ids` [T] -> [T, hidden] in the compute dtype."""

    @abstractmethod
    def logits(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] @ W^T -> [T, vocab]."""


class MoEMethod(ABC):
    """How one layer's routed experts store their weights and run: the quantizer's
    counterpart of `LinearMethod` for a whole set of E experts, so that their GEMMs can be
    grouped (one kernel over every expert) instead of being E separate linear layers.

    The dense layout (the default method's) is `w13_weight` [E, 2I, H] (each expert's gate
    rows, then its up rows) and `w2_weight` [E, H, I]; a method may register its own
    tensors, named `w13_<suffix>` / `w2_<suffix>` after the checkpoint's per-expert suffix
    (`weight`, `weight_scale`, ...), which is how checkpoint names reach them. Every
    parameter the checkpoint fills has a `weight_loader(param, tensor, (expert, shard))`:
    `expert` the expert index (None: the tensor stacks every expert along a leading dim),
    `shard` 0 gate / 1 up of w13 (None: the whole parameter of that expert, e.g. w2 or a
    fused gate_up).
    """

    # whether it holds one rank's share of the experts: `num_experts` and
    # `intermediate_size` are the rank's (expert parallel: its experts; tensor parallel:
    # every expert's slice), and its loaders take the rank's part of checkpoint tensors
    supports_tensor_parallel: ClassVar[bool] = False

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        """Register the experts' parameters on `layer` (see the class docstring)."""

    def process_after_loading(self, layer: nn.Module) -> None:
        """Repack or convert the loaded weights (called once, after all weights load)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' output [T, H] for x [T, H]: for each token the sum over its
        k experts of topk_weights [T, k] (float32) x expert(x), experts topk_ids [T, k]."""


class QuantConfig(ABC):
    """A quantization format, built from a checkpoint's `quantization_config` or `--quantization`.

    The core calls, in order: `from_config` (checkpoint config and flags apart, so a
    flag never silently overrides what the checkpoint says), `bind` (the model's fused
    layer names, before the model is built), `linear_method` / `embedding_method` per
    layer, `weights` around the checkpoint's tensor stream, and, once every tensor is
    in, `process_after_loading` of each layer's method.
    """

    name: ClassVar[str]
    # vLLM names that select this format too (vLLM picks a kernel by name: awq_marlin)
    aliases: ClassVar[tuple[str, ...]] = ()
    # True when `--quantization NAME` may quantize a float checkpoint while it loads;
    # otherwise the flag needs a checkpoint saved in this format
    quantizes_dense: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any], options: dict[str, Any]) -> "QuantConfig":
        """Build from the checkpoint's `quantization_config` ({} when only the flag names
        the format) and the engine's plugin options (plugin-added flags)."""

    def bind(self, packed_modules: Mapping[str, tuple[str, int]]) -> None:
        """The model's fused layers: checkpoint sub-module name -> (fused name, shard),
        e.g. q_proj -> (qkv_proj, 0), so that skip lists written in checkpoint names
        (`modules_to_not_convert`, `ignore`) can be applied to fused layers."""
        self.packed_modules = dict(packed_modules)

    def checkpoint_names(self, prefix: str) -> list[str]:
        """The checkpoint module names a layer of ours is made of, in shard order:
        model.layers.0.self_attn.qkv_proj -> [...q_proj, ...k_proj, ...v_proj]."""
        head, _, last = prefix.rpartition(".")
        parts = sorted((shard, name) for name, (fused, shard) in getattr(self, "packed_modules", {}).items()
                       if fused == last)
        if not parts:
            return [prefix]
        return [f"{head}.{name}" if head else name for _, name in parts]

    def is_skipped(self, prefix: str, patterns: Sequence[str]) -> bool:
        """Whether the layer `prefix` is left unquantized by a skip list in checkpoint
        names (see `skip_matches`); a fused layer whose parts disagree (q skipped, k
        not) cannot be one quantized matrix, so it is refused."""
        if not patterns:
            return False
        names = self.checkpoint_names(prefix)
        hits = [any(skip_matches(name, p) for p in patterns) for name in names]
        if all(hits):
            return True
        if any(hits):
            skipped = [n for n, h in zip(names, hits) if h]
            raise ValueError(f"{self.name}: the skip list leaves {skipped} unquantized but not the rest of "
                             f"{names}, which this engine runs as one fused layer ({prefix}); skip all of "
                             "them or none")
        return False

    def weights(self, stream: Iterator[tuple[str, torch.Tensor]], model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's (name, tensor) stream as the model's loader should see it: a
        format may rename or fold tensors whose names are not parameter names, drop
        tensors, or quantize float ones as they pass (one at a time, never the whole
        model in full precision). `model` is built (its parameters say what it
        expects). Tensors keep their checkpoint dtype: the layer's method decides what
        to convert."""
        return stream

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethod | None:
        """The method for the linear layer named `prefix`; None means unquantized."""

    def embedding_method(self, prefix: str) -> EmbeddingMethod | None:
        """The method for the vocabulary embedding or lm_head named `prefix`; None = dense."""
        return None

    def moe_method(self, prefix: str) -> MoEMethod | None:
        """The method for the routed experts named `prefix` (`model.layers.3.mlp.experts`);
        None = dense experts (a format returns None for experts its skip list leaves
        unquantized). The default refuses: a format that has not said how it stores
        experts would otherwise load its quantized tensors as garbage dense weights."""
        raise NotImplementedError(f"quantization {self.name!r} does not support mixture-of-experts layers yet "
                                  f"({prefix}); use an unquantized checkpoint or one in a format that does")

    def check(self, device: torch.device, dtype: torch.dtype) -> list[str]:
        """Reasons this format cannot run here (empty = it can)."""
        return []


def skip_matches(name: str, pattern: str) -> bool:
    """Whether checkpoint module `name` matches one skip-list entry: "re:REGEX" (as
    compressed-tensors writes them) searched in the name, else the entry as whole dotted
    components of the name (lm_head, q_proj, model.layers.0.mlp)."""
    if pattern.startswith("re:"):
        return re.search(pattern[3:], name) is not None
    return f".{pattern.strip('.')}." in f".{name}."

