"""One sequence's structured-output constraint: a backend matcher plus what every backend
shares - end-of-sequence tokens, the padded logits width, and the reasoning gate.

Invariants: `_history` holds one entry per accepted token, in order (REASONING: before
the gate opened, not seen by the matcher; GRAMMAR: accepted by the matcher; EOS: the end
of a complete match), so `rollback(n)` undoes exactly the last n, across the gate too.
EOS bits are allowed iff the matcher is in an accepting state; bits of ids past the
tokenizer's vocabulary are always cleared.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from pagedllm.core.contracts import LogitsProcessor
from pagedllm.plugins.structured_outputs.backends import Matcher
from pagedllm.plugins.structured_outputs.compiler import CompileJob

REASONING, GRAMMAR, EOS = 0, 1, 2


class MaskLayout:
    """The bits of a row every processor of one engine fixes after its matcher filled it.

    vocab_size: the logits width; tokenizer_size: ids below it are real tokens;
    eos_token_ids: the ids that end a sequence."""

    def __init__(self, vocab_size: int, tokenizer_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.tokenizer_size = min(tokenizer_size, vocab_size)
        self.eos_token_ids = frozenset(t for t in eos_token_ids if 0 <= t < self.tokenizer_size)
        self._eos = [(t // 32, np.uint32(1 << (t % 32))) for t in sorted(self.eos_token_ids)]
        words = -(-vocab_size // 32)
        self._tail_word = self.tokenizer_size // 32 if self.tokenizer_size < words * 32 else None
        self._tail_keep = np.uint32((1 << (self.tokenizer_size % 32)) - 1)

    def finish(self, bitmask: torch.Tensor, row: int, allow_eos: bool) -> None:
        """Clear the padding bits of `bitmask[row]` and set its EOS bits to `allow_eos`."""
        words = bitmask[row].numpy().view(np.uint32)
        if self._tail_word is not None:
            words[self._tail_word] &= self._tail_keep
            words[self._tail_word + 1:] = 0
        for word, bit in self._eos:
            if allow_eos:
                words[word] |= bit
            else:
                words[word] &= ~bit

    def only_eos(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        self.finish(bitmask, row, True)


class ReasoningGate:
    """Watches the generated text for `end` (e.g. "</think>"): the constraint applies to
    the tokens after the one that completes it. Only a short tail is decoded per token:
    `end` spans at most its byte length in tokens (every token is at least one byte)."""

    def __init__(self, tokenizer: Any, end: str) -> None:
        self.tokenizer = tokenizer
        self.end = end
        self._window = len(end.encode("utf-8")) + 1
        self.token_ids: list[int] = []

    def push(self, token_id: int) -> bool:
        """Record a reasoning token; True if it completes the end marker."""
        self.token_ids.append(token_id)
        tail = self.token_ids[-self._window:]
        text = self.tokenizer.decode(tail, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self.end in text

    def pop(self) -> None:
        self.token_ids.pop()


PROMPT_TAIL_TOKENS = 16  # prompt tokens read to see whether the template closed the reasoning


def reasoning_closed_by_prompt(tokenizer: Any, prompt_token_ids: Sequence[int], end: str) -> bool:
    """Whether the prompt itself ends with the reasoning's end marker (blanks after it):
    a chat template that turned thinking off (Qwen3's enable_thinking=False writes an empty
    `<think></think>` block into the generation prompt) leaves no reasoning to wait for, so
    the constraint starts at the first token, as vLLM's is_reasoning_end(prompt) decides."""
    if tokenizer is None or not prompt_token_ids:
        return False
    tail = tokenizer.decode(list(prompt_token_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)
    return tail.rstrip().endswith(end)


class StructuredOutputsProcessor(LogitsProcessor):
    """The contract's processor (core/contracts/logits.py) over a compile job.

    job: the (maybe still running) compile; layout: the engine's MaskLayout; gate: a
    ReasoningGate when constraints start after the reasoning section, else None."""

    def __init__(self, job: CompileJob, layout: MaskLayout, gate: ReasoningGate | None = None) -> None:
        self._job = job
        self._layout = layout
        self._gate = gate
        self._open_at: int | None = None if gate is not None else 0  # history length when the gate opened
        self._matcher: Matcher | None = None
        self._history: list[int] = []
        self._terminated = False

    # ------------------------------------------------------------------ readiness

    def ready(self) -> bool:
        if self._matcher is not None:
            return True
        if not self._job.done() or self._job.failure() is not None:
            return False
        self._matcher = self._job.grammar().new_matcher()
        return True

    def failure(self) -> str | None:
        return None if self._matcher is not None else self._job.failure()

    def _ready_matcher(self) -> Matcher:
        if self._matcher is None and not self.ready():
            raise RuntimeError("structured outputs: the processor was used before its grammar compiled")
        return self._matcher  # type: ignore[return-value]

    # ------------------------------------------------------------------ the contract

    @property
    def in_reasoning(self) -> bool:
        """Whether tokens are still free (the reasoning section has not ended)."""
        return self._open_at is None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.in_reasoning:
            return  # unconstrained: the row stays as preset
        if self._terminated:
            self._layout.only_eos(bitmask, row)
            return
        matcher = self._ready_matcher()
        matcher.fill_bitmask(bitmask, row)
        self._layout.finish(bitmask, row, matcher.is_accepting())

    def accept(self, token_ids: Sequence[int]) -> bool:
        for done, token in enumerate(token_ids):
            if not self._accept_one(int(token)):
                self.rollback(done)
                return False
        return True

    def _accept_one(self, token: int) -> bool:
        if self._terminated:
            return False
        if self.in_reasoning:
            assert self._gate is not None
            self._history.append(REASONING)
            if self._gate.push(token):
                self._open_at = len(self._history)
            return True
        matcher = self._ready_matcher()
        if token in self._layout.eos_token_ids:
            if not matcher.is_accepting():
                return False
            self._terminated = True
            self._history.append(EOS)
            return True
        if not matcher.accept(token):
            return False
        self._history.append(GRAMMAR)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._history):
            raise ValueError(f"structured outputs: cannot roll back {num_tokens} tokens, "
                             f"only {len(self._history)} were accepted")
        grammar_tokens = 0
        for _ in range(num_tokens):
            kind = self._history.pop()
            if kind == GRAMMAR:
                grammar_tokens += 1
            elif kind == EOS:
                self._terminated = False
            else:
                assert self._gate is not None
                self._gate.pop()
        if grammar_tokens:
            self._ready_matcher().rollback(grammar_tokens)
        if self._gate is not None and self._open_at is not None and len(self._history) < self._open_at:
            self._open_at = None  # the token that ended the reasoning was undone

    def is_terminated(self) -> bool:
        return self._terminated
