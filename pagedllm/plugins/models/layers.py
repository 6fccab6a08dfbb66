"""Shared building blocks for model plugins: linears with a LinearMethod, norms, rotary
embeddings and the attention layer that calls the selected backend.

Layers hold parameters and shapes; the arithmetic with faster kernels than torch
(norms, rotary, the gated activation, row lookups, packed dense matmuls) goes through
`pagedllm.ops`, which picks the implementation for the device once, so no layer asks
which hardware it runs on.

A linear layer never asks whether it is quantized: it asks its QuantConfig for a
LinearMethod and falls back to `UnquantizedLinearMethod`. Fused layers (qkv, gate_up)
record their sub-matrix sizes, and each parameter knows how to load one shard
(`weight_loader`), so checkpoint mappings stay data on the model class.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.core.contracts import (
    AttentionContext,
    EmbeddingMethod,
    LinearMethod,
    ModelContext,
    QuantConfig,
)
from pagedllm import ops
# rotary embeddings live in rope.py; re-exported here, where model plugins have imported them from
from pagedllm.plugins.models.rope import RotaryEmbedding, rope_inv_freq, rope_parameters  # noqa: F401


def load_shard(param: torch.Tensor, loaded: torch.Tensor, shard: int | None) -> None:
    """Copy a checkpoint tensor into `param`: whole, or as shard `shard` of a fused layer.

    The one rule for every format: a parameter's `output_offsets` (the fused layer's
    sub-matrix row offsets) locate a shard along its `output_dim` (default 0) after
    dividing by its `pack_factor` (default 1): AWQ's qweight [in, out / 8] shards on dim 1
    by 8, GPTQ's qzeros likewise, block scales by their block size. A parameter with
    `per_shard` set has one row per shard instead (e.g. GPTQ's g_idx). A parameter with its
    own `weight_loader` does all of this itself. Values are converted to the parameter's
    dtype by the copy."""
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, loaded, shard)
        return
    if getattr(param, "per_shard", False):
        target = param.data[shard or 0]
        if target.shape != loaded.shape:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the parameter's {tuple(target.shape)}")
        target.copy_(loaded)
        return
    if shard is None:
        if param.shape != loaded.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
        param.data.copy_(loaded)
        return
    dim = getattr(param, "output_dim", 0)
    pack = getattr(param, "pack_factor", 1)
    offsets = param.output_offsets  # type: ignore[attr-defined]
    start, end = -(-offsets[shard] // pack), -(-offsets[shard + 1] // pack)
    expected = list(param.shape)
    expected[dim] = end - start
    if list(loaded.shape) != expected:
        raise ValueError(f"shard {shard} has shape {tuple(loaded.shape)}, expected {tuple(expected)}")
    param.data.narrow(dim, start, end - start).copy_(loaded)


def _offsets(sizes: Sequence[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


class UnquantizedLinearMethod(LinearMethod):
    """A dense weight [sum(output_sizes), input_size] in the compute dtype."""

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)
        weight.output_offsets = _offsets(output_sizes)  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    def process_after_loading(self, layer):
        layer.packed = ops.pack_linear(layer.weight)
        if layer.packed.owns_copy:  # a packed copy (e.g. the CPU GEMM's panels) replaces the plain weight
            del layer.weight

    def apply(self, layer, x, bias):
        packed = layer.__dict__.get("packed")  # set after loading
        return packed(x, bias) if packed is not None else F.linear(x, layer.weight, bias)


class Linear(nn.Module):
    """y = x W^T (+ b) where W may be several fused sub-matrices (q/k/v, gate/up)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int] | int, *, bias: bool = False,
                 quant_config: QuantConfig | None = None, prefix: str = "",
                 params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.input_size = input_size
        self.prefix = prefix
        method = quant_config.linear_method(prefix) if quant_config is not None else None
        self.method: LinearMethod = method or UnquantizedLinearMethod()
        self.method.create_weights(self, input_size, self.output_sizes, params_dtype)
        if bias:
            b = nn.Parameter(torch.zeros(sum(self.output_sizes), dtype=params_dtype), requires_grad=False)
            b.output_offsets = _offsets(self.output_sizes)  # type: ignore[attr-defined]
            self.bias = b
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


def attention_projections(ctx: ModelContext, num_heads: int, num_kv_heads: int, head_dim: int, prefix: str,
                          qkv_bias: bool = False, out_bias: bool = False) -> tuple["Linear", "Linear"]:
    """One attention layer's fused q/k/v projection (hidden -> (H + 2 KVH) x D, shards q, k, v)
    and its output projection (H x D -> hidden), through the context's quantizer."""
    hidden = ctx.hf_config.hidden_size
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = Linear(hidden, [q_size, kv_size, kv_size], bias=qkv_bias, quant_config=ctx.quant_config,
                 prefix=f"{prefix}.qkv_proj", params_dtype=ctx.dtype)
    out = Linear(q_size, hidden, bias=out_bias, quant_config=ctx.quant_config, prefix=f"{prefix}.o_proj",
                 params_dtype=ctx.dtype)
    return qkv, out


class RMSNorm(nn.Module):
    """RMS normalisation computed in float32; `offset=1` gives Gemma's (1 + w) form."""

    def __init__(self, size: int, eps: float, offset: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.offset = offset
        self._scale: torch.Tensor | None = None
        self._scale_version = -1

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (norm(x + residual), x + residual) (see ops.rms_norm)."""
        return ops.rms_norm(x, self.scale(), self.eps, residual)

    def scale(self) -> torch.Tensor:
        """offset + weight in float32, made once and again only if the weight is written to."""
        if self._scale is None or self._scale_version != self.weight._version:
            self._scale = (self.weight.float() + self.offset).contiguous()
            self._scale_version = self.weight._version
        return self._scale


class Attention(nn.Module):
    """Calls the selected backend's impl with this layer's slice of the KV cache."""

    def __init__(self, context: ModelContext, layer_idx: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, scale: float, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, attention_chunk_size: int | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        spec = context.attention_spec(num_heads, num_kv_heads, head_dim)
        chunking = {"attention_chunk_size": attention_chunk_size} if attention_chunk_size else {}
        self.impl = context.attention_backend.impl_cls()(spec, scale, sliding_window, logits_soft_cap, **chunking)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        out = self.impl.forward(q, k, v, attn.kv_caches[self.layer_idx], attn.metadata)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)


class UnquantizedEmbeddingMethod(EmbeddingMethod):
    """One dense [vocab, hidden] tensor in the compute dtype."""

    def create_weights(self, layer, vocab_size, hidden_size, params_dtype):
        layer.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=params_dtype), requires_grad=False)

    def process_after_loading(self, layer):
        layer.head = ops.pack_linear(layer.weight)  # lookups keep the plain weight

    def embed(self, layer, input_ids):
        if input_ids.dim() == 1:
            return ops.gather_rows(layer.weight, input_ids)
        return F.embedding(input_ids, layer.weight)

    def logits(self, layer, x):
        head = layer.__dict__.get("head")
        return head(x, None) if head is not None else F.linear(x, layer.weight)


class VocabEmbedding(nn.Module):
    """The token embedding, or an untied lm_head: `forward` looks rows up, `logits`
    multiplies by the same matrix."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix
        method = quant_config.embedding_method(prefix) if quant_config is not None else None
        self.method: EmbeddingMethod = method or UnquantizedEmbeddingMethod()
        self.method.create_weights(self, vocab_size, hidden_size, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.method.embed(self, input_ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.logits(self, x)

