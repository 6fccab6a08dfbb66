"""Reasoning parsers: split a completion into `reasoning_content` and `content`.

A parser works on the cumulative text, never on deltas, so a tag split across two
tokens ("</th" + "ink>") cannot leak into either part: while the text could still be
the start of a tag, that tail is held back (until the request finishes). Both parts
only ever grow, so streaming sends `split(now) - split(before)`.
"""

from __future__ import annotations

from dataclasses import dataclass


class DeepSeekR1ReasoningParser:
    """DeepSeek-R1 style: everything before `</think>` is reasoning, the rest is content.

    As in vLLM, the opening `<think>` is optional (R1's chat template already emits it),
    so an output with no `</think>` is all reasoning.
    """

    start_tag = "<think>"
    end_tag = "</think>"

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far; partial tags are held back unless finished."""
        head = text.lstrip()
        if head.startswith(self.start_tag):
            text = head[len(self.start_tag):]
        elif not finished and self.start_tag.startswith(head):
            return "", ""  # only blanks, or the start of "<think>": wait for more
        reasoning, tag, content = text.partition(self.end_tag)
        if tag:
            return reasoning, content
        if not finished:
            reasoning = reasoning[:len(reasoning) - _partial_suffix(reasoning, self.end_tag)]
        return reasoning, ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


REASONING_PARSERS: dict[str, type[DeepSeekR1ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


def get_reasoning_parser(name: str) -> DeepSeekR1ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; available: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]()


@dataclass
class ReasoningDelta:
    """Tracks what one streamed choice has sent of each part."""

    parser: DeepSeekR1ReasoningParser
    sent_reasoning: int = 0
    sent_content: int = 0

    def update(self, text: str, finished: bool) -> tuple[str, str]:
        """The (reasoning, content) text not sent yet."""
        reasoning, content = self.parser.split(text, finished)
        delta = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        self.sent_content = max(self.sent_content, len(content))
        return delta
