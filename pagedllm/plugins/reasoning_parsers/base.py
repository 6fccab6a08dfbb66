"""The split every marker-based format shares: reasoning up to the first end marker."""

from __future__ import annotations

from pagedllm.core.contracts.reasoning import partial_suffix


def split_at_end(body: str, finished: bool, end_tags: tuple[str, ...]) -> tuple[str, str]:
    """(reasoning, content) of `body`, the text after the opening marker (or the whole text
    when the format has none): reasoning up to the earliest end marker, content after it.
    With no end marker yet, all of it is reasoning, less (unless `finished`) a tail that
    may still become one; the held-back tail only ever shrinks into reasoning or the tag."""
    hits = [(at, tag) for tag in end_tags if (at := body.find(tag)) >= 0]
    if hits:
        at, tag = min(hits)
        return body[:at], body[at + len(tag):]
    if finished:
        return body, ""
    return body[:len(body) - partial_suffix(body, *end_tags)], ""
