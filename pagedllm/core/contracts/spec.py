"""Speculative decoding: a proposer only proposes; the core verifies every proposal.

After each step the core hands the proposer a `ProposalBatch` (the requests that will
decode next, what the step appended to each, how many drafts each may have, and the
target's step itself: its flattened batch and hidden states). The proposer answers with
at most `max_drafts[i]` draft tokens per request; the next step scores the request's
next token and its drafts in one target forward and keeps the accepted prefix with the
rejection sampler (core/sampler.py), so greedy output is unchanged and sampled output
keeps its distribution whatever a proposer returns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import torch

from pagedllm.core.contracts.attention import BatchLayout
from pagedllm.core.contracts.model import CausalLM, KVCacheSpec, ModelContext

# `--speculative-config` keys every method takes (the core reads them); a method adds its
# own with `SpecProposer.options`. Any other key is refused with the list of valid ones.
CORE_KEYS: dict[str, str] = {
    "method": "the proposer: ngram, draft_model, eagle, eagle3, suffix, or a plugin's",
    "num_speculative_tokens": "draft tokens per step (k)",
    "model": "draft model or EAGLE head path (methods that load one)",
    "draft_tensor_parallel_size": "ranks of the draft model (1: pagedllm runs one rank)",
    "disable_by_batch_size": "speculate only in steps with fewer running requests than this",
    "quantization": "the draft model's quantization (default: its checkpoint's)",
    "max_model_len": "accepted; the target's context length applies to the draft too",
    "revision": "accepted for compatibility (pagedllm loads local paths only)",
    "enforce_eager": "accepted; the target's --enforce-eager applies to the draft too",
    "adaptive": "pagedllm's own (default true): speculate only at batch sizes where it measured faster",
}


@dataclass(frozen=True)
class SpecDecodeConfig:
    """A checked `--speculative-config`: the core keys, and the method's own in `options`
    (every key of `SpecProposer.options`, defaults filled in)."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    quantization: str | None = None
    disable_by_batch_size: int | None = None
    adaptive: bool = True
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class DraftModel:
    """A model built and loaded by the target's machinery (loader, quantizers, attention
    backend), for a proposer that runs one: what `ProposerContext.load_model` returns."""

    model: CausalLM
    hf_config: Any  # its language model's config (loader.language_model_config)
    tokenizer: Any
    kv_spec: KVCacheSpec
    # the attention metadata of a flattened batch for this model's layers
    build_metadata: Callable[[BatchLayout], Any]
    # hidden states of a step: `model(layout.input_ids, layout.positions, attn)`, replayed
    # where the target's steps are (CPU step replay, CUDA graphs)
    run: Callable[[BatchLayout, Any], torch.Tensor]


@dataclass
class ProposerContext:
    """What a proposer gets at construction."""

    config: SpecDecodeConfig
    target: CausalLM
    hf_config: Any  # the target's language model's config (loader.language_model_config)
    tokenizer: Any  # the target's
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    block_size: int
    # build and load a model (path, quantization or None) the way the target was
    load_model: Callable[[str, str | None], DraftModel]
    # the flattened batch of (token ids, tokens already cached, new tokens, block ids)
    # per request, as the worker builds it for the target
    make_layout: Callable[[list[list[int]], list[int], list[int], list[list[int]]], BatchLayout]
    # for a proposer that builds its own layers (an EAGLE head) from a config: the
    # ModelContext the target's layers were built with (its dtype, device, attention
    # backend; no quantizer), and the metadata builder for layers of a KVCacheSpec
    model_context: Callable[[Any], ModelContext] | None = None
    metadata_builder: Callable[[KVCacheSpec], Callable[[BatchLayout], Any]] | None = None


@dataclass
class TargetStep:
    """The target's forward of the step just run, for proposers that read it (EAGLE)."""

    layout: BatchLayout
    hidden_states: torch.Tensor  # [num_tokens, hidden] after the final norm
    aux_hidden_states: list[torch.Tensor]  # the layers `SpecProposer.aux_hidden_state_layers` asked for
    batch_index: dict[str, int]  # request id -> its index in the layout
    token_ids: list[Sequence[int]]  # each request's tokens (layout order; before this step's are appended)
    samples: list[bool]  # whether each request's chunk reached its end (a token is sampled)


@dataclass
class ProposalBatch:
    """The requests to propose for after a step, in one order for every field."""

    request_ids: list[str]
    token_ids: list[Sequence[int]]  # each request's tokens so far (prompt + output); read only
    num_prompt_tokens: list[int]
    num_new_tokens: list[int]  # tokens this step appended to each (accepted drafts + 1)
    num_accepted: list[int]  # drafts of each accepted this step
    max_drafts: list[int]  # propose at most this many (k, max_model_len and max_tokens cap it)
    block_ids: list[Sequence[int]]  # each request's KV blocks, lookahead slots included
    step: TargetStep | None = None


class SpecProposer(ABC):
    """Proposes up to k draft tokens per request; the core verifies them in one target pass."""

    name: ClassVar[str]
    # this method's own `--speculative-config` keys and their defaults
    options: ClassVar[dict[str, Any]] = {}
    # a method that needs no `num_speculative_tokens` key gets this (None: the key is required)
    default_num_speculative_tokens: ClassVar[int | None] = None
    # the method loads a model or head from the config's "model" key (the core requires it)
    needs_model: ClassVar[bool] = False

    def __init__(self, context: ProposerContext) -> None:
        self.context = context
        self.k = context.config.num_speculative_tokens
        self.kv_caches: list[torch.Tensor] = []  # the layers of kv_cache_spec(), once bound

    @classmethod
    def validate(cls, config: SpecDecodeConfig) -> None:
        """Raise ValueError naming the key when the method's options are wrong."""

    def kv_cache_spec(self) -> KVCacheSpec | None:
        """Attention layers of the proposer's own model, if it runs one: the worker counts
        them in the KV-cache plan, gives them caches with the target's block count, and
        hands them over with `bind_kv_caches`. Their slots follow the target's block table."""
        return None

    def bind_kv_caches(self, caches: list[torch.Tensor]) -> None:
        """The caches of `kv_cache_spec()`'s layers (called once, before the first step)."""
        self.kv_caches = caches

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past a request's scheduled tokens the proposer writes into; the
        scheduler reserves them. By default k where the proposer has KV layers of its own
        (a draft model or head writes its k - 1 proposal steps there), else 0."""
        return self.k if self.kv_cache_spec() is not None else 0

    @property
    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        """Target layers whose output hidden states the proposer reads (`TargetStep`)."""
        return ()

    @property
    def needs_target_step(self) -> bool:
        """True when `propose` reads `ProposalBatch.step` (the worker keeps it then)."""
        return bool(self.aux_hidden_state_layers)

    @abstractmethod
    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        """At most `batch.max_drafts[i]` draft tokens for each request (may be empty)."""

    def observe(self, step: TargetStep) -> None:
        """Every target forward, when `needs_target_step` (before sampling): a proposer that
        keeps a KV cache fed by the target's hidden states covers the prompt chunks that
        sample nothing here; the rows of a sampling request reach `propose` (`batch.step`)."""

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted (its KV blocks are gone): drop its state."""
