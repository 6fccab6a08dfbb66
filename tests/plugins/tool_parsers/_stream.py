"""The streaming law every parser keeps: parse each prefix of a text, as a stream does,
and check that content and arguments only grow and the last parse equals the parse of
the whole text."""

from __future__ import annotations

import json
from typing import Any

from pagedllm.core.contracts.tools import ParsedTools, ToolParser, ToolSpec


def grows(before: ParsedTools, after: ParsedTools) -> None:
    assert after.content.startswith(before.content), (before.content, after.content)
    assert len(after.calls) >= len(before.calls), (before.calls, after.calls)
    for old, new in zip(before.calls, after.calls):
        assert new.name == old.name
        assert new.arguments.startswith(old.arguments), (old.arguments, new.arguments)


def parse_streamed(cls: type[ToolParser], text: str, tools: list[ToolSpec] | None = None,
                   step: int = 1) -> ParsedTools:
    """The whole-text parse of `text`, checked against a parse of every prefix."""
    whole = cls(None, tools).parse(text, finished=True)
    parser = cls(None, tools)
    seen = ParsedTools("")
    for end in range(0, len(text) + 1, step):
        now = parser.parse(text[:end], finished=False)
        grows(seen, now)
        assert len(now.content) <= end
        seen = now
    final = parser.parse(text, finished=True)
    grows(seen, final)
    assert final == whole
    for call in whole.calls:
        assert isinstance(json.loads(call.arguments), dict)
    return whole


def calls_of(parsed: ParsedTools) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]
