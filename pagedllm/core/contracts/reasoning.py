"""Reasoning parsers: split a completion into its reasoning and its content.

Models that think aloud mark the thinking in their own syntax (DeepSeek-R1's and
Qwen3's `<think>…</think>`, Granite's "Here is my thought process: … Here is my
response:"). A parser turns the cumulative completion text into `(reasoning, content)`;
the server sends them as `reasoning_content` and `content`. The contract is text only, so
a parser package need not import the server.

The text is always the cumulative text, never a delta, so a tag split across two tokens
("</th" + "ink>") cannot leak into either part: while the text could still be the start
of a tag, that tail is held back (until the request finishes). Both parts only ever
grow from one call to the next, so a stream sends `split(now) - split(before)`
(`ReasoningDelta` keeps that count).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


class ReasoningParser(ABC):
    """Splits completion text into (reasoning, content). One instance per choice parsed:
    a parser may remember what it has handed out (a stream cannot take text back).

    Args:
        tokenizer: the model's tokenizer (transformers interface), for parsers that need
            its special tokens; text-only parsers ignore it (None is fine in tests).

    Class-level facts:
        name: the `--reasoning-parser` name.
        end_tag: the text after which content starts, or None when there is no such
            text; structured outputs start constraining after it.
    """

    name: ClassVar[str] = ""
    end_tag: ClassVar[str | None] = None

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def split(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of the cumulative `text` so far. Unless `finished`, text
        that could still be part of a tag is held back from both; each part only grows
        from one call to the next."""


def partial_suffix(text: str, *tags: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`:
    what a parser (reasoning or tool-call) holds back while the rest of a tag may still arrive."""
    best = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:size]):
                best = size
                break
    return best


def could_become(head: str, *tags: str) -> bool:
    """True when `head` is a (possibly empty) prefix of one of `tags`: the text so far
    may still turn out to open with that tag, so nothing can be labelled yet."""
    return any(tag.startswith(head) for tag in tags)


@dataclass
class ReasoningDelta:
    """Tracks what one streamed choice has sent of each part."""

    parser: ReasoningParser
    sent_reasoning: int = 0
    sent_content: int = 0

    def update(self, text: str, finished: bool) -> tuple[str, str]:
        """The (reasoning, content) text not sent yet."""
        reasoning, content = self.parser.split(text, finished)
        delta = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        self.sent_content = max(self.sent_content, len(content))
        return delta
