"""What plugins implement: the only core module a plugin author must read (with hookspecs.py).

Four kinds of plugin meet the core here: attention backends, quantizers, speculative
proposers and model architectures, plus checkpoint formats (a file type such as GGUF
that carries config, tokenizer and weights together), implementations of the layer ops
(`pagedllm.ops`) and graph runners (capture a step's forward once, replay it after). Data crossing a boundary is a
frozen dataclass; behaviour is a small ABC. Tensors in a `BatchLayout` are owned by the
worker and valid for one step; plugins must not keep references past `forward`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Sequence

import torch
from torch import nn

# --------------------------------------------------------------------------- attention


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

    def __post_init__(self) -> None:
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

    `k_scale` / `v_scale` are the per-layer FP8 KV-cache scales (1.0 unless the
    checkpoint supplies them); the layer sets them after loading weights.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        self.spec = spec
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.k_scale = 1.0
        self.v_scale = 1.0

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
        only the last `sliding_window` tokens when set).
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
    `kv_caches[i]`.
    """

    metadata: Any
    kv_caches: list[torch.Tensor]


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


# --------------------------------------------------------------------------- quantization


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


# --------------------------------------------------------------------------- speculative decoding


class SpecProposer(ABC):
    """Proposes up to k draft tokens per request; the core verifies them in one target pass."""

    name: ClassVar[str]

    @abstractmethod
    def propose(self, token_ids: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """For each request's full token list, return at most k proposed next tokens."""


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class KVCacheSpec:
    """A model's attention and KV-cache facts (on this rank): what the worker needs to
    pick an attention backend and size the cache before the model is built."""

    num_layers: int  # attention layers, each with its own cache tensor
    num_heads: int  # query heads
    num_kv_heads: int
    head_size: int

    def bytes_per_token(self, element_size: int) -> int:
        """K and V for every layer: 2 x layers x kv_heads x head_dim x element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * element_size


@dataclass
class ModelContext:
    """Everything a model architecture needs at construction."""

    hf_config: Any  # a transformers PretrainedConfig (or one built from GGUF metadata)
    dtype: torch.dtype
    device: torch.device
    attention_backend: type[AttentionBackend]
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    quant_config: QuantConfig | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class CausalLM(nn.Module, ABC):
    """A decoder-only model over the flattened token stream.

    Subclasses are registered under the Hugging Face architecture name
    (`config.json` "architectures"). They build their attention layers with
    `context.attention_backend.impl_cls()`.
    """

    def __init__(self, context: ModelContext) -> None:
        super().__init__()
        self.context = context

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] for the flattened batch."""

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab_size] (float32) for the rows that need a token."""

    @abstractmethod
    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume (checkpoint name, tensor) pairs; return the parameter names filled."""

    @classmethod
    @abstractmethod
    def kv_cache_spec(cls, hf_config: Any) -> KVCacheSpec:
        """The attention / KV-cache facts of a model with this config (asked before the
        model is built, to choose the attention backend and size the cache; the model's
        own layers should read their head counts from here too)."""


# --------------------------------------------------------------------------- layer ops


@dataclass(frozen=True)
class OpImpl:
    """One implementation of a layer op of `pagedllm.ops` (rms_norm, rotary_qkv,
    silu_and_mul, gather_rows, pack_linear; each op's docstring there is its contract).

    Offered through the `pagedllm_op_impls` hook. For each (device type, dtype) of an
    op's first tensor argument, the op uses the runnable implementation with the highest
    `priority`, chosen on first use and kept; the op's plain-torch reference (priority 0)
    runs where no other can.
    """

    op: str  # the op's name in pagedllm.ops
    name: str  # shown in logs, e.g. "cpu_native"
    fn: Callable[..., Any]  # the op's signature and semantics
    # reasons it cannot run on tensors of this device and dtype (empty: it can)
    check: Callable[[torch.device, torch.dtype], list[str]]
    priority: int = 10


# --------------------------------------------------------------------------- graph capture


class GraphRunner(ABC):
    """Runs a step's forward faster than calling the model: captures it once per batch
    shape and replays it later (CUDA graphs on a GPU; recorded native kernel calls on the
    CPU). The worker builds the runnable one with the highest priority for its device
    after loading, unless --enforce-eager; without one, every step runs eagerly.
    """

    name: ClassVar[str]
    priority: ClassVar[dict[str, int]] = {}

    @classmethod
    @abstractmethod
    def check(cls, device: torch.device, backend: type[AttentionBackend]) -> list[str]:
        """Reasons it cannot run here (empty = it can). `backend.graph_support` says which
        steps the attention backend's metadata allows capturing."""

    def __init__(self, model: nn.Module, backend: type[AttentionBackend]) -> None:
        self.model = model
        self.backend = backend

    @abstractmethod
    def __call__(self, layout: BatchLayout, attn: AttentionContext) -> torch.Tensor:
        """Hidden states for the step, equal to `model(layout.input_ids, layout.positions,
        attn)`; steps it cannot replay it runs eagerly."""


# --------------------------------------------------------------------------- checkpoint formats


class CheckpointFormat(ABC):
    """A kind of model file or directory: where config, tokenizer and weights come from.

    The core knows the Hugging Face directory format; plugins add others (GGUF).
    """

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def detect(cls, path: str) -> bool:
        """True when `path` is unmistakably this format (used for load_format="auto")."""

    def __init__(self, path: str, options: dict[str, Any] | None = None) -> None:
        self.path = path
        self.options = dict(options or {})  # EngineConfig.plugin_options (plugin-added flags)

    @abstractmethod
    def hf_config(self) -> Any:
        """The model's transformers config object (architectures, sizes, rope, ...)."""

    @abstractmethod
    def tokenizer(self) -> Any:
        """A tokenizer with transformers' interface (encode, decode, eos_token_id,
        apply_chat_template, convert_ids_to_tokens)."""

    @abstractmethod
    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) pairs, named as the model's `load_weights` expects."""

    def quantization(self) -> str | None:
        """The quantizer this checkpoint needs by default (None = unquantized)."""
        return None
