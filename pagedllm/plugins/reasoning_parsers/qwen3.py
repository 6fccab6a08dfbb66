"""Qwen3's `<think>…</think>`, where output with no think block is the answer."""

from __future__ import annotations

from typing import Any, ClassVar

from pagedllm.core.contracts.reasoning import ReasoningParser, could_become, partial_suffix
from pagedllm.plugins.reasoning_parsers.base import split_at_end

START, END = "<think>", "</think>"


class Qwen3ReasoningParser(ReasoningParser):
    """vLLM's recommendation for Qwen3: output without a think block is content.

    The rule:
    - if the text (after leading blanks) starts with `<think>`, it is reasoning until
      `</think>` and content after it (an unclosed block is all reasoning);
    - if it does not, it is content, except that a `</think>` is split there (the chat
      template opened the think block in the prompt, as Qwen3's thinking templates do)
      as long as none of the text has been handed out as content yet.

    So a whole answer (one finished call) "a</think>b" is ("a", "b"). A stream is held
    back only while its text is blanks or a partial tag; after that it is sent as content
    and cannot later be re-labelled: a `</think>` that comes after content was sent stays
    in the content as text. That is why this parser keeps state: one instance per choice.
    """

    name: ClassVar[str] = "qwen3"
    end_tag: ClassVar[str | None] = END

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self.content_sent = False  # content handed out before any </think>: no split now

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        head = text.lstrip()
        if head.startswith(START):
            return split_at_end(head[len(START):], finished, (END,))
        if not finished and could_become(head, START, END):
            return "", ""  # only blanks or the start of a tag: wait for more
        if not self.content_sent:
            reasoning, tag, content = text.partition(END)
            if tag:
                return reasoning, content
        content = text if finished else text[:len(text) - partial_suffix(text, END)]
        self.content_sent = self.content_sent or bool(content)
        return "", content
