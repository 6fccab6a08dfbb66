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

Tensor parallelism (Megatron's split, vLLM's semantics) lives here too: a `Linear` built
with `parallel="column"` holds this rank's rows of each fused shard, one built with
`parallel="row"` this rank's columns (its output is summed over the group), and a
`VocabEmbedding` given a group of several ranks holds one slice of the vocabulary. Each
split parameter carries the one rule for its part (`tp_dim`, `tp_parts`), read by
`load_shard`, which narrows a checkpoint tensor to it before copying. With a one-rank group
(the default) nothing is split and nothing changes.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.core.contracts import (
    KV_CACHE_TORCH_DTYPES,
    AttentionContext,
    AttentionImpl,
    EmbeddingMethod,
    KVCacheSpec,
    LinearMethod,
    ModelContext,
    QuantConfig,
)
from pagedllm import ops
from pagedllm.core.parallel import Group
# rotary embeddings live in rope.py; re-exported here, where model plugins have imported them from
from pagedllm.plugins.models.rope import RotaryEmbedding, rope_inv_freq, rope_parameters  # noqa: F401

logger = logging.getLogger("pagedllm")


def load_shard(param: torch.Tensor, loaded: torch.Tensor, shard: int | None) -> None:
    """Copy a checkpoint tensor into `param`: whole, or as shard `shard` of a fused layer.

    The one rule for every format: a parameter's `output_offsets` (the fused layer's
    sub-matrix row offsets) locate a shard along its `output_dim` (default 0) after
    dividing by its `pack_factor` (default 1): AWQ's qweight [in, out / 8] shards on dim 1
    by 8, GPTQ's qzeros likewise, block scales by their block size. A parameter with
    `per_shard` set has one row per shard instead (e.g. GPTQ's g_idx). A parameter with its
    own `weight_loader` does all of this itself. Values are converted to the parameter's
    dtype by the copy.

    A tensor-parallel parameter (`tp_dim` set, see `rank_part`) first takes this rank's
    part of the checkpoint tensor, a view (the mmap-backed tensor is never copied whole);
    everything above then applies to that part, and a whole-tensor copy fills the first
    rows of the parameter along `tp_dim` (a vocabulary's padded last part keeps its zero
    rows)."""
    loaded = rank_part(param, loaded, shard)
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
        target = param.data
        tp_dim = getattr(param, "tp_dim", None)
        if tp_dim is not None and loaded.shape[tp_dim] <= target.shape[tp_dim]:
            target = target.narrow(tp_dim, 0, loaded.shape[tp_dim])
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(target.shape)} vs checkpoint {tuple(loaded.shape)}")
        target.copy_(loaded)
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


def split_parameter(param: torch.Tensor, dim: int | None, parts: Sequence[tuple[int, int, int]]) -> None:
    """Mark `param` as tensor-parallel: along its `dim` it holds, for each shard of its
    layer, the rows (start, size) of that shard's checkpoint tensor whose full extent is
    `full` (`parts`: one (start, size, full) per shard, or one for every shard).
    Rows count logical rows; `rank_part` divides by `pack_factor` along `output_dim`, by
    `input_pack_factor` along another dim (a block scale's input blocks).
    `dim` None: the parameter is whole on every rank."""
    param.tp_dim = dim  # type: ignore[attr-defined]
    param.tp_parts = [tuple(p) for p in parts]  # type: ignore[attr-defined]


def rank_part(param: torch.Tensor, loaded: torch.Tensor, shard: int | None) -> torch.Tensor:
    """This rank's part of checkpoint tensor `loaded` for `param` (itself when `param` is
    not split): a narrowed view along `param.tp_dim`, after checking the checkpoint holds
    the full extent the layer was built for."""
    dim = getattr(param, "tp_dim", None)
    if dim is None:
        return loaded
    parts = param.tp_parts  # type: ignore[attr-defined]
    if shard is None and len(parts) > 1:
        raise ValueError(f"one checkpoint tensor for all {len(parts)} shards of a fused layer cannot be split over "
                         "tensor-parallel ranks; the checkpoint must store each shard (q/k/v, gate/up) separately")
    start, size, full = parts[0 if len(parts) == 1 else shard]
    # rows count logical rows / columns: a parameter packing several per element (AWQ's
    # words, block scales' blocks) divides by its pack factor along that dim
    pack = (getattr(param, "pack_factor", 1) if dim == getattr(param, "output_dim", 0)
            else getattr(param, "input_pack_factor", 1))
    if pack != 1:
        start, size, full = start // pack, -(-size // pack), -(-full // pack)
    if loaded.dim() <= dim or loaded.shape[dim] != full:
        raise ValueError(f"shape {tuple(loaded.shape)}: expected {full} rows along dim {dim}, which "
                         "tensor parallelism splits")
    return loaded.narrow(dim, start, size)


def _offsets(sizes: Sequence[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


class UnquantizedLinearMethod(LinearMethod):
    """A dense weight [sum(output_sizes), input_size] in the compute dtype, or in
    `ops.dense_weight_dtype()` where the load keeps a 16-bit checkpoint's weights as they
    are under float32 compute (the bias stays in the compute dtype)."""

    supports_tensor_parallel = True  # its one weight narrows like any tensor (Linear marks it)

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        dtype = ops.dense_weight_dtype() or params_dtype
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype), requires_grad=False)
        weight.output_offsets = _offsets(output_sizes)  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    def process_after_loading(self, layer):
        layer.packed = ops.pack_linear(layer.weight)
        if layer.packed.owns_copy:  # a packed copy (e.g. the CPU GEMM's panels) replaces the plain weight
            del layer.weight

    def apply(self, layer, x, bias):
        packed = layer.__dict__.get("packed")  # set after loading
        return packed(x, bias) if packed is not None else F.linear(x, layer.weight, bias)

    def apply_silu_and_mul(self, layer, x, bias):
        packed = layer.__dict__.get("packed")
        return packed.silu_and_mul(x, bias) if packed is not None else None


PARALLEL_MODES = (None, "column", "row")


def one_rank() -> Group:
    """A group of this process alone: every collective is a no-op."""
    return Group([0], 0)


def _refuse_unsplittable(method: LinearMethod | EmbeddingMethod, quant_config: QuantConfig | None,
                         tp: Group) -> None:
    if tp.size > 1 and not type(method).supports_tensor_parallel:
        name = quant_config.name if quant_config is not None else type(method).__name__
        raise NotImplementedError(f"quantization {name} with tensor_parallel_size > 1 is not supported yet; "
                                  "use an unquantized checkpoint or tensor_parallel_size=1")


class Linear(nn.Module):
    """y = x W^T (+ b) where W may be several fused sub-matrices (q/k/v, gate/up).

    `parallel` splits it over the tensor-parallel group `tp` (Megatron):
    - None: every rank holds the whole layer (the default; also any layer at tp=1);
    - "column": each output shard is cut along its rows into `output_parts[i]` equal
      parts (default tp.size) and rank r holds part r * parts // tp.size, so with fewer
      parts than ranks a part is replicated (KV heads when tp > num_kv_heads); the output
      is this rank's columns of y, not gathered;
    - "row": the input dim is cut into tp.size parts (x arrives already split, e.g. a
      column layer's output); the partial products are summed over the group
      (`tp.all_reduce`) and the bias is added once, after the sum.
    `input_size` and `output_sizes` are the whole layer's (the checkpoint's); the
    attributes of the same names, and what the LinearMethod's `create_weights` gets, are
    this rank's."""

    def __init__(self, input_size: int, output_sizes: Sequence[int] | int, *, bias: bool = False,
                 quant_config: QuantConfig | None = None, prefix: str = "",
                 params_dtype: torch.dtype = torch.float32, parallel: str | None = None,
                 tp: Group | None = None, output_parts: Sequence[int] | None = None) -> None:
        super().__init__()
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"{prefix}: parallel={parallel!r}; expected one of {PARALLEL_MODES}")
        full_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.tp = tp if tp is not None else one_rank()
        self.parallel = parallel if self.tp.size > 1 else None
        self.prefix = prefix
        method = quant_config.linear_method(prefix) if quant_config is not None else None
        self.method: LinearMethod = method or UnquantizedLinearMethod()
        if self.parallel is not None:
            _refuse_unsplittable(self.method, quant_config, self.tp)
        out_parts = self._output_parts(full_sizes, output_parts)
        in_part = self._input_part(input_size)
        self.output_sizes = [size for _, size, _ in out_parts]
        self.input_size = in_part[1]
        self.method.create_weights(self, self.input_size, self.output_sizes, params_dtype)
        if bias:
            rows = self.output_sizes if self.parallel != "row" else full_sizes
            b = nn.Parameter(torch.zeros(sum(rows), dtype=params_dtype), requires_grad=False)
            b.output_offsets = _offsets(rows)  # type: ignore[attr-defined]
            self.bias = b
        else:
            self.bias = None
        if self.parallel is not None:
            self._mark_split(out_parts, in_part)

    def _output_parts(self, sizes: list[int], parts: Sequence[int] | None) -> list[tuple[int, int, int]]:
        """(start, size, full) of this rank's rows of each output shard."""
        if self.parallel != "column":
            return [(0, s, s) for s in sizes]
        tp = self.tp
        counts = list(parts) if parts is not None else [tp.size] * len(sizes)
        if len(counts) != len(sizes):
            raise ValueError(f"{self.prefix}: output_parts names {len(counts)} shards, the layer has {len(sizes)}")
        out = []
        for i, (size, count) in enumerate(zip(sizes, counts)):
            if count < 1 or tp.size % count or size % count:
                raise ValueError(f"{self.prefix}: output shard {i} ({size} rows) cannot be cut into {count} equal "
                                 f"parts shared by tensor_parallel_size={tp.size} ranks")
            piece = size // count
            out.append(((tp.rank * count // tp.size) * piece, piece, size))
        return out

    def _input_part(self, size: int) -> tuple[int, int, int]:
        """(start, size, full) of this rank's input columns."""
        if self.parallel != "row":
            return (0, size, size)
        if size % self.tp.size:
            raise ValueError(f"{self.prefix}: input size {size} does not split over "
                             f"tensor_parallel_size={self.tp.size} ranks")
        piece = size // self.tp.size
        return (self.tp.rank * piece, piece, size)

    def _mark_split(self, out_parts: list[tuple[int, int, int]], in_part: tuple[int, int, int]) -> None:
        """Tell each parameter the method registered (and the bias) which part it holds. A
        method may have set `tp_dim` itself (None: whole on every rank)."""
        for name, param in self.named_parameters(recurse=False):
            if hasattr(param, "tp_dim"):
                continue
            if self.parallel == "column":
                split_parameter(param, getattr(param, "output_dim", 0), out_parts)
            elif name == "bias":
                split_parameter(param, None, [])  # whole: added once, after the sum
            else:
                dim = getattr(param, "input_dim", 1 if param.dim() >= 2 else None)
                split_parameter(param, dim, [in_part])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel != "row":
            return self.method.apply(self, x, self.bias)
        y = self.tp.all_reduce(self.method.apply(self, x, None))
        return y if self.bias is None else y + self.bias

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this gate/up layer's output [gate | up] (each column-parallel
        rank holds its own gate and up columns): fused into the matmul where the method's
        kernel does that for this batch (`LinearMethod.apply_silu_and_mul`), else the
        layer's output through `ops.silu_and_mul`."""
        if self.parallel != "row":
            fused = self.method.apply_silu_and_mul(self, x, self.bias)
            if fused is not None:
                return fused
        return ops.silu_and_mul(self(x))


def attention_projections(ctx: ModelContext, num_heads: int, num_kv_heads: int, head_dim: int, prefix: str,
                          qkv_bias: bool = False, out_bias: bool = False) -> tuple["Linear", "Linear"]:
    """One attention layer's fused q/k/v projection (hidden -> (H + 2 KVH) x D, shards q, k, v)
    and its output projection (H x D -> hidden), through the context's quantizer.

    The head counts are the model's; over `ctx.parallel.tp` the q/k/v projection is split by
    heads (column) and the output projection by its input (row): rank r holds H / tp query
    heads and KVH / tp KV heads, or, with fewer KV heads than ranks, the one KV head
    r // (tp / KVH) (`KVCacheSpec.for_tensor_parallel` gives the same counts and refuses
    sizes that do not divide)."""
    tp = ctx.parallel.tp
    hidden = ctx.hf_config.hidden_size
    KVCacheSpec(num_layers=1, num_heads=num_heads, num_kv_heads=num_kv_heads,
                head_size=head_dim).for_tensor_parallel(tp.size)  # raises for sizes that do not split
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    kv_parts = min(num_kv_heads, tp.size)
    qkv = Linear(hidden, [q_size, kv_size, kv_size], bias=qkv_bias, quant_config=ctx.quant_config,
                 prefix=f"{prefix}.qkv_proj", params_dtype=ctx.dtype, parallel="column", tp=tp,
                 output_parts=[tp.size, kv_parts, kv_parts])
    out = Linear(q_size, hidden, bias=out_bias, quant_config=ctx.quant_config, prefix=f"{prefix}.o_proj",
                 params_dtype=ctx.dtype, parallel="row", tp=tp)
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


# vLLM's divisors for KV scales calculated from the first batch (its K_SCALE_CONSTANT and
# V_SCALE_CONSTANT): that batch's largest |key| is cached as 200 and its largest |value| as
# 100, under e4m3's 448, so later batches may run 2.2x (keys) and 4.5x (values) larger
# before the cache saturates.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


class KVScaleCalculation:
    """--calculate-kv-scales for one attention layer with an FP8 cache: on the first step
    that is not dummy (`AttentionContext.dummy`: the memory-profiling run) and has tokens,
    before that step's keys and values are cached, set the impl's scales to
    max|k| / K_SCALE_CONSTANT and max|v| / V_SCALE_CONSTANT (vLLM's rule, per layer and per
    tensor-parallel rank: each rank measures the heads it holds), once. A checkpoint's own
    scales (the impl's `kv_scales_source` is "given") are kept instead, and said so.

    The measurement reads the amax back to the host, so it must be an eager step: later
    steps may be replayed (CPU step replay records only a shape's second step; graph
    captures bake the scales in), and the layer drops this object once it has decided,
    so nothing is measured again. MLA layers (one latent, `v` None) get k_scale for both."""

    def __init__(self, layer_idx: int) -> None:
        self.layer_idx = layer_idx
        # layer 0 speaks at info level, once per model; the others at debug level
        self.say = logger.info if layer_idx == 0 else logger.debug

    def decide(self, impl: AttentionImpl, k: torch.Tensor, v: torch.Tensor | None, attn: AttentionContext) -> bool:
        """True once this layer's scales are decided (from now on the caller drops this
        object); False on a step that must not count (dummy, or without tokens)."""
        if attn.dummy or k.shape[0] == 0:
            return False
        if impl.kv_scales_source == "given":
            self.say("--calculate-kv-scales: layer %d keeps the checkpoint's FP8 KV scales (k_scale=%.4g, "
                     "v_scale=%.4g): calibrated scales win over the first batch's", self.layer_idx,
                     float(impl.k_scale), float(impl.v_scale))
            return True
        if k.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("--calculate-kv-scales: a CUDA graph is being captured before an eager step measured "
                               f"layer {self.layer_idx}'s FP8 KV scales; the first real step must run eagerly (the "
                               "graph would bake in scales of 1.0)")
        amax = torch.stack([k.detach().abs().amax().float(),
                            (v if v is not None else k).detach().abs().amax().float()]).tolist()
        k_scale = self._scale(amax[0], K_SCALE_CONSTANT, "keys", float(impl.k_scale))
        v_scale = k_scale if v is None else self._scale(amax[1], V_SCALE_CONSTANT, "values", float(impl.v_scale))
        impl.set_calculated_kv_scales(k_scale, v_scale)
        self.say("--calculate-kv-scales: layer %d's FP8 KV scales from the first batch (%d tokens): k_scale=%.4g "
                 "(max |k| %.4g / %g), v_scale=%.4g (max |v| %.4g / %g)%s", self.layer_idx, k.shape[0], k_scale,
                 amax[0], K_SCALE_CONSTANT, v_scale, amax[1], V_SCALE_CONSTANT,
                 "; the other layers' at debug level" if self.layer_idx == 0 else "")
        return True

    def _scale(self, amax: float, constant: float, what: str, current: float) -> float:
        if math.isfinite(amax) and amax > 0:
            return amax / constant
        logger.warning("--calculate-kv-scales: layer %d's %s in the first batch are %s; its scale stays %g",
                       self.layer_idx, what, "all zero" if amax == 0 else "not finite", current)
        return current


def kv_scale_calculation(context: ModelContext, layer_idx: int) -> KVScaleCalculation | None:
    """What measures this layer's FP8 KV scales when --calculate-kv-scales asks (None: the
    scales stay the checkpoint's or 1.0). With a cache that is not FP8 the flag changes
    nothing, which layer 0 says."""
    if not context.calculate_kv_scales:  # CacheConfig.calculate_kv_scales, set by the worker
        return None
    if context.kv_cache_dtype not in KV_CACHE_TORCH_DTYPES:
        if layer_idx == 0:
            logger.warning("--calculate-kv-scales has no effect with kv_cache_dtype=%s: only an FP8 KV cache "
                           "(kv_cache_dtype fp8, fp8_e4m3, fp8_e5m2) uses k/v scales", context.kv_cache_dtype)
        return None
    return KVScaleCalculation(layer_idx)


class Attention(nn.Module):
    """Calls the selected backend's impl with this layer's slice of the KV cache (and, under
    --calculate-kv-scales with an FP8 cache, first sets its scales from the first batch:
    `KVScaleCalculation`)."""

    def __init__(self, context: ModelContext, layer_idx: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, scale: float, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, attention_chunk_size: int | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        spec = context.attention_spec(num_heads, num_kv_heads, head_dim)
        chunking = {"attention_chunk_size": attention_chunk_size} if attention_chunk_size else {}
        self.impl = context.attention_backend.impl_cls()(spec, scale, sliding_window, logits_soft_cap, **chunking)
        self.kv_scales = kv_scale_calculation(context, layer_idx)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        if self.kv_scales is not None and self.kv_scales.decide(self.impl, k, v, attn):
            self.kv_scales = None  # decided once: never measured again
        out = self.impl.forward(q, k, v, attn.kv_caches[self.layer_idx], attn.metadata)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)


class UnquantizedEmbeddingMethod(EmbeddingMethod):
    """One dense [vocab, hidden] tensor in the compute dtype, or in `ops.dense_weight_dtype()`
    as the linear weights (a 16-bit checkpoint under float32 compute: its rows are widened
    as they are looked up, its logits are bf16 products)."""

    supports_tensor_parallel = True  # VocabEmbedding marks and narrows its rows

    def create_weights(self, layer, vocab_size, hidden_size, params_dtype):
        layer.rows_dtype = params_dtype  # what lookups return: the compute dtype
        dtype = ops.dense_weight_dtype() or params_dtype
        layer.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def process_after_loading(self, layer):
        if layer.serves_logits:
            layer.head = ops.pack_linear(layer.weight)  # lookups keep the plain weight

    def embed(self, layer, input_ids):
        if input_ids.dim() == 1:
            return ops.gather_rows(layer.weight, input_ids, layer.rows_dtype)
        return F.embedding(input_ids, layer.weight).to(layer.rows_dtype)

    def logits(self, layer, x):
        head = layer.__dict__.get("head")
        return head(x, None) if head is not None else F.linear(x, layer.weight)


class VocabEmbedding(nn.Module):
    """The token embedding, or an untied lm_head: `forward` looks rows up, `logits`
    multiplies by the same matrix.

    Over a tensor-parallel group `tp` of several ranks the vocabulary is split in equal
    parts of ceil(vocab / tp) rows (the last rank's padded with zero rows): rank r holds
    ids [vocab_start, vocab_end). `forward` looks up the ids it holds, zeroes the others'
    rows and sums over the group; `logits` gathers every rank's columns, so both return
    what the whole matrix would, on every rank."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 quant_config: QuantConfig | None = None, prefix: str = "", tp: Group | None = None,
                 serves_logits: bool = True) -> None:
        super().__init__()
        self.prefix = prefix
        self.vocab_size = vocab_size
        # False: an untied input embedding, only looked up (its method builds no head)
        self.serves_logits = serves_logits
        self.tp = tp if tp is not None else one_rank()
        method = quant_config.embedding_method(prefix) if quant_config is not None else None
        self.method: EmbeddingMethod = method or UnquantizedEmbeddingMethod()
        _refuse_unsplittable(self.method, quant_config, self.tp)
        rows = -(-vocab_size // self.tp.size)
        self.vocab_start = min(self.tp.rank * rows, vocab_size)
        self.vocab_end = min(self.vocab_start + rows, vocab_size)
        self.method.create_weights(self, rows, hidden_size, dtype)
        if self.tp.size > 1:
            held = self.vocab_end - self.vocab_start
            for param in self.parameters(recurse=False):
                split_parameter(param, 0, [(self.vocab_start, held, vocab_size)])
                param.data[held:].zero_()  # padding: zero logits, trimmed after the gather

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.method.embed(self, input_ids)
        held = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(held, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        rows = self.method.embed(self, local).masked_fill(~held.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(rows)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if not self.serves_logits:
            raise RuntimeError(f"{self.prefix}: built as an input embedding only (the model has its own lm_head); "
                               "it computes no logits")
        if self.tp.size == 1:
            return self.method.logits(self, x)
        return self.tp.all_gather(self.method.logits(self, x), dim=-1)[..., :self.vocab_size]
