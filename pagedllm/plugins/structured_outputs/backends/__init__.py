"""The grammar engines behind structured outputs, one small contract for all three.

A `GrammarBackend` is built once per engine (it turns the tokenizer into the library's
vocabulary, which takes from 0.1 s to a few seconds), then `compile`s each distinct spec
into a `CompiledGrammar`, which makes one `Matcher` per sequence. A matcher knows
nothing of end-of-sequence tokens, reasoning sections or the padded logits width: the
processor (../processor.py) adds those the same way for every backend.

Libraries are imported only when their backend is built (`load_backend`), so a missing or
broken one fails only the requests that select it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Sequence

import torch

from pagedllm.plugins.structured_outputs.spec import CompileSpec

# public (vLLM) name -> (module under this package, class)
BACKENDS: dict[str, tuple[str, str]] = {
    "guidance": ("guidance", "GuidanceBackend"),
    "xgrammar": ("xgrammar", "XGrammarBackend"),
    "outlines": ("outlines", "OutlinesBackend"),
}
ALIASES = {"llguidance": "guidance"}
CHOICES = ("auto", "xgrammar", "guidance", "llguidance", "outlines")


class UnsupportedSpec(ValueError):
    """The backend cannot serve this spec (a kind or feature it lacks), though the spec may
    be valid: "auto" then tries the next backend. The message names what is missing and,
    where known, the backends that have it."""


def canonical_name(name: str) -> str:
    """The backend's registry name for a user's spelling ("llguidance" -> "guidance"),
    "auto" kept; a ValueError listing the valid names otherwise."""
    if not isinstance(name, str) or name.lower() not in CHOICES:
        raise ValueError(f"structured_outputs_config backend {name!r} is unknown; valid backends: "
                         f"{', '.join(CHOICES)}")
    name = name.lower()
    return ALIASES.get(name, name)


class Matcher(ABC):
    """One sequence's position in a compiled grammar. Engine thread only."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the grammar's allowed next tokens into `bitmask[row]` (int32 words, the
        whole row, on the CPU). End-of-sequence bits are the processor's business."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False, with the state unchanged, if it is not allowed."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def is_accepting(self) -> bool:
        """Whether the text so far is a complete match (the sequence may end here)."""


class CompiledGrammar(ABC):
    """A compiled spec, shared by every sequence that asks for it (thread-safe to read)."""

    @abstractmethod
    def new_matcher(self) -> Matcher:
        """A matcher at the start of the grammar (cheap: no compiling)."""


class GrammarBackend(ABC):
    """One grammar library bound to the engine's tokenizer and logits width.

    tokenizer: the engine's transformers tokenizer; vocab_size: the logits width (may be
    larger than the tokenizer's vocabulary); eos_token_ids: every id that ends a sequence."""

    name: ClassVar[str] = ""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)

    def check(self, spec: CompileSpec) -> None:
        """Raise UnsupportedSpec for a kind this backend lacks (before any compiling)."""
        if spec.kind not in _KINDS[self.name]:
            others = [n for n, k in _KINDS.items() if spec.kind in k and n != self.name]
            raise UnsupportedSpec(f"the {self.name} backend does not support {spec.kind}; "
                                  f"backends that do: {', '.join(others)}")

    @abstractmethod
    def compile(self, spec: CompileSpec) -> CompiledGrammar:
        """Compile `spec` (on a worker thread). Raises UnsupportedSpec for a feature this
        library lacks, ValueError (the library's own words) for an invalid spec."""


# which kinds each backend serves: used in error messages without importing the libraries
_KINDS: dict[str, frozenset[str]] = {
    "guidance": frozenset({"json", "json_object", "regex", "choice", "grammar", "structural_tag"}),
    "xgrammar": frozenset({"json", "json_object", "regex", "choice", "grammar", "structural_tag"}),
    "outlines": frozenset({"json", "json_object", "regex", "choice"}),
}


def load_backend(name: str, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarBackend:
    """Import and build the backend called `name` (a canonical name, not "auto")."""
    module, cls = BACKENDS[name]
    try:
        mod = importlib.import_module(f"{__name__}.{module}")
    except ImportError as exc:
        raise UnsupportedSpec(f"the {name} backend is not available: {exc}") from exc
    return getattr(mod, cls)(tokenizer, vocab_size, eos_token_ids)


def row_pointer(bitmask: torch.Tensor, row: int) -> tuple[int, int]:
    """(address, int32 words) of `bitmask[row]`, for libraries that write raw memory."""
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask[row].is_contiguous():
        raise ValueError("structured outputs: the bitmask must be a contiguous int32 CPU tensor")
    view = bitmask[row]
    return view.data_ptr(), view.numel()
