"""Feed a parser growing prefixes of a text, checking the contract's growth rule."""

from __future__ import annotations

from pagedllm.core.contracts.reasoning import ReasoningParser


def stream(parser: ReasoningParser, text: str, step: int) -> tuple[str, str]:
    """The last (reasoning, content) of a stream that grows `step` characters at a time,
    asserting that each part only ever extends what was handed out before."""
    reasoning, content = "", ""
    for end in [*range(step, len(text), step), len(text)]:
        r, c = parser.split(text[:end], finished=end == len(text))
        assert r.startswith(reasoning), f"reasoning shrank or changed at {text[:end]!r}: {reasoning!r} -> {r!r}"
        assert c.startswith(content), f"content shrank or changed at {text[:end]!r}: {content!r} -> {c!r}"
        reasoning, content = r, c
    return reasoning, content
