"""Quantization: a format's config picks, per layer, how weights are stored and multiplied.

The unquantized methods are the defaults (plugins/models/layers.py), so a layer never
asks whether it is quantized.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Sequence

import torch
from torch import nn


class LinearMethod(ABC):
    """How one linear layer stores its weight and computes x @ W^T.

    The unquantized method is the default, so a layer never asks "am I quantized?".
    """

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


class EmbeddingMethod(ABC):
    """How a vocabulary matrix [vocab, hidden] is stored and used: rows are looked up for
    input ids, and the same matrix (tied embeddings) or an lm_head computes logits.

    Quantized checkpoints (GGUF stores token_embd in Q8_0 or Q6_K) may keep the matrix in
    their own blocks; the default method keeps one dense tensor.
    """

    @abstractmethod
    def create_weights(self, layer: nn.Module, vocab_size: int, hidden_size: int, params_dtype: torch.dtype) -> None:
        """Register the layer's parameters (a `weight_loader` attribute when loading is
        not a plain copy)."""

    def process_after_loading(self, layer: nn.Module) -> None:
        """Repack or convert the loaded weights (called once, after all weights load)."""

    @abstractmethod
    def embed(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the matrix for `input_ids` [T] -> [T, hidden] in the compute dtype."""

    @abstractmethod
    def logits(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] @ W^T -> [T, vocab]."""


class QuantConfig(ABC):
    """A quantization format, built from a checkpoint's `quantization_config` or `--quantization`."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> "QuantConfig":
        """Build from the checkpoint's `quantization_config` dict ({} when only the flag names it)."""

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethod | None:
        """The method for the linear layer named `prefix`; None means unquantized."""

    def embedding_method(self, prefix: str) -> EmbeddingMethod | None:
        """The method for the vocabulary embedding or lm_head named `prefix`; None = dense."""
        return None

    def check(self, device: torch.device, dtype: torch.dtype) -> list[str]:
        """Reasons this format cannot run here (empty = it can)."""
        return []
