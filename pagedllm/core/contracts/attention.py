"""Attention backends: the flattened batch they read (`BatchLayout`), the per-model facts
(`AttentionSpec`), the backend class, its once-per-step metadata builder and per-layer impl.

Tensors in a `BatchLayout` are owned by the worker and valid for one step; backends
must not keep references past `forward`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class BatchLayout:
    """One scheduled step flattened into a single token stream (backend-neutral).

    Requests appear in the order of `query_start_loc`; request i owns tokens
    `query_start_loc[i]:query_start_loc[i+1]`, which sit at the end of its context of
    `seq_lens[i]` tokens (so `seq_lens[i] - query_len_i` tokens are already in the cache).
    All tensors live on the model's device except the `*_cpu` copies, which builders
    use to avoid device syncs.
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, context length including the new tokens
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_reqs(self) -> int:
        return self.seq_lens_cpu.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


ATTENTION_KINDS = ("mha", "mla")


@dataclass(frozen=True)
class AttentionSpec:
    """The per-model facts a backend needs to build metadata and run its kernels."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # kv heads on this rank
    head_size: int
    dtype: torch.dtype  # compute dtype of q/k/v
    kv_cache_dtype: str  # "auto" | "fp8" | "fp8_e4m3" | "fp8_e5m2"
    block_size: int
    device: torch.device
    # how float32 matmuls may round their inputs (core/precision.py): under "medium" a
    # backend may keep an "auto" cache of a float32 model in bf16 (attention's two
    # products then take bf16 keys and values, as the GEMMs take bf16 weights)
    matmul_precision: str = "highest"
    # "mha": K and V per KV head; "mla": one latent per token (KVCacheSpec explains it):
    # keys are the whole latent (head_size elements), values its first value_size
    kind: str = "mha"
    value_size: int | None = None  # MLA: the output head size; None = head_size
    # some layer attends within fixed chunks (KVCacheSpec.attention_chunks, Llama 4): only
    # backends with `supports_attention_chunks` can run it
    chunked: bool = False

    @property
    def out_head_size(self) -> int:
        """Elements per head of what attention returns (the value size)."""
        return self.value_size or self.head_size

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"attention kind {self.kind!r} is not one of {', '.join(ATTENTION_KINDS)}")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}: "
                             "no attention backend can run this model")


class AttentionMetadataBuilder(ABC):
    """Turns the worker's `BatchLayout` into the backend's own metadata, once per step.

    The result is shared by every layer of the step, so expensive planning (index
    arrays, wrapper plans) belongs here and not in `AttentionImpl.forward`.
    """

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    @abstractmethod
    def build(self, layout: BatchLayout) -> Any:
        """Return the backend metadata for this step; called once before the model runs."""


class AttentionImpl(ABC):
    """One attention layer's kernel. Created by the model's attention layer.

    `k_scale` / `v_scale` are the per-layer FP8 KV-cache scales: a cached element is
    value / scale, read back as element * scale. They are 1.0 unless something sets them:
    the model's loader from the checkpoint's k_scale / v_scale tensors (plain assignment,
    which `kv_scales_source` records as "given"), or the attention layer from the first
    batch under --calculate-kv-scales (`set_calculated_kv_scales`). Backends read them on
    every forward, so a scale set after construction takes effect on the next step.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        *,
        attention_chunk_size: int | None = None,
    ) -> None:
        self.spec = spec
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # chunked local attention (see `forward`); set only on backends that declare
        # `supports_attention_chunks` (the registry refuses the others for such a model)
        self.attention_chunk_size = attention_chunk_size
        self._k_scale: float = 1.0
        self._v_scale: float = 1.0
        # where the scales came from: "default" (1.0), "given" (assigned from outside: a
        # checkpoint's scales) or "calculated" (from the first batch); a layer calculating
        # scales keeps given ones (a checkpoint's calibration beats one batch's)
        self.kv_scales_source = "default"

    @property
    def k_scale(self) -> float:
        return self._k_scale

    @k_scale.setter
    def k_scale(self, value: float) -> None:
        self._k_scale = value
        self.kv_scales_source = "given"

    @property
    def v_scale(self) -> float:
        return self._v_scale

    @v_scale.setter
    def v_scale(self, value: float) -> None:
        self._v_scale = value
        self.kv_scales_source = "given"

    def set_calculated_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """Scales measured from the data (--calculate-kv-scales), recorded as "calculated"."""
        self._k_scale, self._v_scale = k_scale, v_scale
        self.kv_scales_source = "calculated"

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
    ) -> torch.Tensor:
        """Write k/v into `kv_cache` through the step's slot mapping, then attend.

        q: [num_tokens, num_heads, head_size]; k, v: [num_tokens, num_kv_heads, head_size].
        Returns [num_tokens, num_heads, head_size] in q's dtype. Causal within the
        step; every query attends to all cached tokens of its request before it (and
        only the last `sliding_window` tokens when set: a query at position p sees keys
        at positions p - sliding_window + 1 .. p). With `attention_chunk_size` C set, the
        context is cut into chunks of C positions and a query sees only its own chunk's
        keys up to itself: positions floor(p / C) * C .. p (Llama 4's local layers).

        An "mla" spec: k is the latent [num_tokens, 1, head_size] and v is None; the
        cache (`latent_cache_shape`) holds latents, keys are whole latents, values their
        first `spec.value_size` elements; returns [num_tokens, num_heads, value_size].
        """


class GraphSupport(enum.Enum):
    """Which steps' forward can be captured once and replayed with a backend's metadata."""

    NEVER = "never"
    # pure-decode steps (one query token per request): every tensor of the metadata has a
    # shape that depends only on the batch shape, so a capture per shape replays
    DECODE = "decode"


class AttentionBackend(ABC):
    """A family of attention kernels over the paged KV cache (class-level facts only)."""

    name: ClassVar[str]
    # Auto-selection picks the runnable backend with the highest priority for the device.
    priority: ClassVar[dict[str, int]] = {}
    # Which steps a graph runner may capture with this backend's metadata (see GraphRunner).
    graph_support: ClassVar[GraphSupport] = GraphSupport.NEVER
    # With GraphSupport.DECODE: steps whose every request has at most this many query
    # tokens have metadata whose shapes depend on the batch shape alone (1: decodes only;
    # more lets speculative verify steps, 1 + k tokens per request, be captured too).
    graph_max_query_len: ClassVar[int] = 1
    # the attention kinds (AttentionSpec.kind) this backend serves; the registry refuses
    # a model of another kind here, naming the backends that serve it
    kinds: ClassVar[frozenset[str]] = frozenset({"mha"})
    # whether its impls honour `attention_chunk_size` (chunked local attention); the
    # registry refuses a model with chunked layers (AttentionSpec.chunked) elsewhere
    supports_attention_chunks: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def check(cls, spec: AttentionSpec) -> list[str]:
        """Reasons this backend cannot run `spec` here (empty list = it can).

        Must not raise when an optional library is missing: say so instead.
        """

    @classmethod
    def kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV-cache tensor (K and V together). The default layout,
        [2, num_blocks, block_size, num_kv_heads, head_size], is K then V; a backend
        whose library wants another layout overrides this."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def latent_cache_shape(cls, num_blocks: int, block_size: int, latent_size: int) -> tuple[int, ...]:
        """Shape of one MLA layer's cache (backends serving "mla"): one latent per token."""
        return (num_blocks, block_size, latent_size)

    @classmethod
    def cache_shape(cls, num_blocks: int, block_size: int, spec: Any) -> tuple[int, ...]:
        """One layer's cache shape for a model's KVCacheSpec, whichever its kind."""
        if spec.latent_size is not None:
            return cls.latent_cache_shape(num_blocks, block_size, spec.latent_size)
        return cls.kv_cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_size)

    @classmethod
    def kv_cache_dtype(cls, spec: AttentionSpec) -> torch.dtype:
        """The element type this backend keeps the cache in: by default the model dtype, or
        the FP8 kind `spec.kv_cache_dtype` names. For "auto" a backend may pick another
        type its kernels serve better, as long as it is exact for spec.dtype or allowed by
        spec.matmul_precision (CPU_ATTN: bf16 for a bf16 model, or a float32 one under
        "medium", where its kernels have a bf16 path; float32 otherwise); q, k and v still
        arrive, and the output must leave, in spec.dtype."""
        return kv_cache_torch_dtype(spec.kv_cache_dtype, spec.dtype)

    @classmethod
    @abstractmethod
    def builder_cls(cls) -> type[AttentionMetadataBuilder]:
        """The metadata builder class (imported lazily, on selection)."""

    @classmethod
    @abstractmethod
    def impl_cls(cls) -> type[AttentionImpl]:
        """The per-layer implementation class (imported lazily, on selection)."""


@dataclass
class AttentionContext:
    """What a model's forward needs for attention: the step's metadata and every layer's cache.

    Passed explicitly down the model (never a module global); layer i reads
    `kv_caches[i]`. `dummy` marks a step on made-up tokens (the memory-profiling run, a
    warm-up): layers must not learn anything from its values (--calculate-kv-scales
    measures the first step that is not dummy).
    """

    metadata: Any
    kv_caches: list[torch.Tensor]
    dummy: bool = False


# the element type of each non-"auto" name in config.KV_CACHE_DTYPES
KV_CACHE_TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type the cache is stored in: the model dtype unless an FP8 kind is asked."""
    if kv_cache_dtype == "auto":
        return model_dtype
    try:
        return KV_CACHE_TORCH_DTYPES[kv_cache_dtype]
    except KeyError:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not one of: auto, "
            + ", ".join(KV_CACHE_TORCH_DTYPES)
        ) from None
