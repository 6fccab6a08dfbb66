"""DeepSeek-R1's `<think>…</think>`."""

from __future__ import annotations

from typing import ClassVar

from pagedllm.core.contracts.reasoning import ReasoningParser, could_become
from pagedllm.plugins.reasoning_parsers.base import split_at_end


class DeepSeekR1ReasoningParser(ReasoningParser):
    """Everything before `</think>` is reasoning, the rest is content.

    As in vLLM, the opening `<think>` is optional (R1's chat template already emits it),
    so an output with no `</think>` is all reasoning. Stateless: one instance may serve
    every choice.
    """

    name: ClassVar[str] = "deepseek_r1"
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str | None] = "</think>"

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        head = text.lstrip()
        if head.startswith(self.start_tag):
            text = head[len(self.start_tag):]
        elif not finished and could_become(head, self.start_tag):
            return "", ""  # only blanks, or the start of "<think>": wait for more
        return split_at_end(text, finished, ("</think>",))
