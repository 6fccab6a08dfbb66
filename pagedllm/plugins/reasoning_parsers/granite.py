"""IBM Granite 3.x: "Here is my thought process: … Here is my response: …"."""

from __future__ import annotations

from typing import ClassVar

from pagedllm.core.contracts.reasoning import ReasoningParser, could_become
from pagedllm.plugins.reasoning_parsers.base import split_at_end

STARTS = ("Here is my thought process:", "Here's my thought process:")
ENDS = ("Here is my response:", "Here's my response:")


class GraniteReasoningParser(ReasoningParser):
    """Granite's thinking mode writes its markers as plain text (no special tokens).

    If the text (after leading blanks) starts with "Here is my thought process:" (or
    "Here's …"), the reasoning is the text up to "Here is my response:" (or "Here's …")
    and the content is what follows it; with no response marker yet it is all reasoning.
    Text that does not open with the thought marker is all content (thinking was off).
    While streaming, a tail that may still become a marker is held back. Stateless.
    """

    name: ClassVar[str] = "granite"
    end_tag: ClassVar[str | None] = ENDS[0]

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        head = text.lstrip()
        for start in STARTS:
            if head.startswith(start):
                return split_at_end(head[len(start):], finished, ENDS)
        if not finished and could_become(head, *STARTS):
            return "", ""  # only blanks, or the start of the thought marker: wait for more
        return "", text
