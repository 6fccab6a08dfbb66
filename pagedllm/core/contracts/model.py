"""Model architectures and checkpoint formats: what the worker builds and loads."""

from __future__ import annotations

from abc import ABC, abstractmethod
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

import torch
from torch import nn

from pagedllm.core.contracts.attention import AttentionBackend, AttentionContext, AttentionSpec
from pagedllm.core.contracts.quant import QuantConfig
from pagedllm.core.parallel import ParallelState


@dataclass(frozen=True)
class KVCacheSpec:
    """A model's attention and KV-cache facts (on this rank), supplied by the model class
    from its config: what the worker needs to pick an attention backend and size the cache
    before the model is built.

    Two kinds of layer cache exist. "mha" (the default): K and V per KV head,
    `head_size` elements each. "mla" (multi-head latent attention, DeepSeek-V2/V3): one
    latent vector of `latent_size` elements per token, shared by every head; the backend
    attends with the whole latent as the key (queries arrive already projected into it,
    `head_size` = `latent_size`) and its first `value_size` elements as the value.
    """

    num_layers: int  # attention layers, each with its own cache tensor
    num_heads: int  # query heads
    num_kv_heads: int  # 1 for MLA (the latent is shared by every head)
    head_size: int  # the q.k dot-product size (MLA: the latent size)
    # MLA only: elements cached per token and layer, and how many of them are the value
    latent_size: int | None = None
    value_size: int | None = None
    # per-layer sliding windows in tokens (None = a global layer); () = every layer global
    sliding_windows: tuple[int | None, ...] = ()
    # per-layer attention chunks in tokens (None = not chunked); () = no layer chunked. A
    # chunked layer's query at p sees only positions floor(p / C) * C .. p (Llama 4's
    # local layers); such a model needs a backend with `supports_attention_chunks`
    attention_chunks: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        for what, per_layer in (("sliding_windows", self.sliding_windows), ("attention_chunks", self.attention_chunks)):
            if per_layer and len(per_layer) != self.num_layers:
                raise ValueError(f"{what} names {len(per_layer)} layers, the model has {self.num_layers}")
        if (self.latent_size is None) != (self.value_size is None):
            raise ValueError("an MLA cache needs both latent_size and value_size")

    @property
    def kind(self) -> str:
        """The attention kind backends declare they serve: "mha" or "mla"."""
        return "mla" if self.latent_size is not None else "mha"

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it attends to the whole context)."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    def chunk(self, layer: int) -> int | None:
        """Layer `layer`'s attention chunk size (None: not chunked)."""
        return self.attention_chunks[layer] if self.attention_chunks else None

    @property
    def chunked(self) -> bool:
        """Whether any layer attends within chunks (AttentionSpec.chunked). Chunked layers
        never let blocks be released early (`kv_window` reads windows only): a chunk's
        start can lie anywhere up to C - 1 tokens back."""
        return any(c is not None for c in self.attention_chunks)

    @property
    def kv_window(self) -> int | None:
        """The window beyond which no layer ever reads a token again (the largest window when
        every layer is windowed; None when any layer is global): blocks wholly older than it
        can be released while the request runs."""
        windows = self.sliding_windows
        if not windows or any(w is None for w in windows):
            return None
        return max(windows)  # type: ignore[type-var]

    def for_tensor_parallel(self, tp_size: int) -> "KVCacheSpec":
        """The facts one of `tp_size` tensor-parallel ranks sees: its share of the query
        heads and of the KV heads, a KV head replicated on several ranks when there are
        fewer KV heads than ranks (MLA's one latent is every rank's)."""
        if tp_size == 1:
            return self
        if self.num_heads % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's {self.num_heads} "
                             "attention heads; pick a size that does")
        kv_heads = self.num_kv_heads
        if self.latent_size is None:
            if kv_heads >= tp_size and kv_heads % tp_size:
                raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's {kv_heads} KV heads")
            if kv_heads < tp_size and tp_size % kv_heads:
                raise ValueError(f"tensor_parallel_size={tp_size} is not a multiple of the model's {kv_heads} "
                                 "KV heads (each KV head must be replicated on the same number of ranks)")
            kv_heads = max(1, kv_heads // tp_size)
        return dataclasses.replace(self, num_heads=self.num_heads // tp_size, num_kv_heads=kv_heads)

    def bytes_per_token(self, element_size: int, layers: int | None = None) -> int:
        """Cache bytes one token takes across every layer: MLA's latent, or K and V per
        KV head (2 x layers x kv_heads x head_dim x element size). `layers`: count only
        that many layers (a pipeline stage's)."""
        layers = self.num_layers if layers is None else layers
        if self.latent_size is not None:
            return layers * self.latent_size * element_size
        return 2 * layers * self.num_kv_heads * self.head_size * element_size


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
    matmul_precision: str = "highest"  # the worker's (core/precision.py), for AttentionSpec
    # this rank and its groups: tensor-parallel layers split by `parallel.tp`, a pipeline
    # stage builds only `parallel.stage_layers(n)`; one rank unless the engine asks for more
    parallel: ParallelState = field(default_factory=ParallelState.single)
    # the engine's context length: per-position tables (rotary) must cover it, which is
    # longer than the config's when PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN lets it be
    max_model_len: int | None = None
    # --calculate-kv-scales: FP8 KV-cache scales measured on the first real step
    calculate_kv_scales: bool = False

    def attention_spec(self, num_heads: int, num_kv_heads: int, head_size: int, kind: str = "mha",
                       value_size: int | None = None) -> AttentionSpec:
        """The AttentionSpec of one attention layer of this model: its head facts on top of
        the worker's dtype, cache dtype, block size, device and matmul precision (the same
        facts the worker's metadata builder sees)."""
        return AttentionSpec(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, dtype=self.dtype,
                             kv_cache_dtype=self.kv_cache_dtype, block_size=self.block_size, device=self.device,
                             matmul_precision=self.matmul_precision, kind=kind, value_size=value_size)


@dataclass
class IntermediateTensors:
    """What a pipeline stage hands the next one: named [num_tokens, ...] tensors (Llama's:
    the hidden state and the residual). The worker sends them on; the next stage's
    `forward` receives them in place of input ids."""

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class CausalLM(nn.Module, ABC):
    """A decoder-only model over the flattened token stream.

    Subclasses are registered under the Hugging Face architecture name
    (`config.json` "architectures"). They build their attention layers with
    `context.attention_backend.impl_cls()`.
    """

    # checkpoint sub-module name -> (our fused module, shard index), e.g. "q_proj" ->
    # ("qkv_proj", 0): how the loader fuses checkpoint tensors, and how a quantizer maps
    # a skip list written in checkpoint names onto our layers
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {}

    def __init__(self, context: ModelContext) -> None:
        super().__init__()
        self.context = context

    # whether the class splits itself over `context.parallel` (tensor-parallel layers,
    # pipeline stages); the worker refuses more than one rank for a class that does not
    supports_parallel: ClassVar[bool] = False

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Hidden states [num_tokens, hidden_size] for the flattened batch. Under pipeline
        parallelism a stage other than the first gets the previous stage's `intermediate`
        (and still the step's input_ids and positions), and a stage other than the last
        returns its IntermediateTensors instead of hidden states."""

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding (`module(input_ids)` -> [n, hidden]): an EAGLE head without
        its own embedding shares the target's."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its token embedding")

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """From now on, `forward` returns [num_tokens, (1 + len(layers)) x hidden]: the
        final hidden states, then the hidden state entering each listed decoder layer
        (0-based; the residual stream there), side by side (one tensor, so that a replayed
        step returns them too). EAGLE-3 reads them."""
        raise NotImplementedError(f"{type(self).__name__} cannot return inner layers' hidden states "
                                  "(a speculative method asked for them)")

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab_size] (float32) for the rows that need a token."""

    def after_loading(self) -> None:
        """Called once by the core after every layer method has repacked its loaded weights:
        the place to derive tensors from them (MLA's absorbed projections). Default: nothing."""

    @abstractmethod
    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume (checkpoint name, tensor) pairs; return the parameter names filled.

        Tensors arrive in their checkpoint dtype (a parameter's loader converts; a
        quantized layer's method decides); the core calls each layer method's
        `process_after_loading` afterwards."""

    @classmethod
    @abstractmethod
    def kv_cache_spec(cls, hf_config: Any) -> KVCacheSpec:
        """The attention / KV-cache facts of a model with this config (asked before the
        model is built, to choose the attention backend and size the cache; the model's
        own layers should read their head counts from here too)."""


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
