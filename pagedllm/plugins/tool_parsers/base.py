"""What the built-in parsers share: a completion seen as a run of segments.

Each parser turns the text into segments, in order: plain text (content), groups of
calls, and at most one `HELD` at the end, for text that could still become a call
(a partial `<tool_call>`, a call whose name is not out yet). `assemble` makes the
`ParsedTools` from them, with one rule for every format:

- text right before and right after a group of calls loses its blank edges, and the
  pieces of text left are joined with a newline ("Let me look.\n<tool_call>..." gives
  the content "Let me look.");
- unless finished, trailing blanks are held back too (they may precede a call);
- text with no call in it comes back exactly as it was.

Every rule only ever lengthens the content as text is added, which a stream needs.
A region that turns out malformed is content, tags and all. What a stream cannot do
is take back a call it has sent: a call whose name was out before its JSON went wrong
stays sent (a whole-text parse calls it content).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator

from pagedllm.core.contracts.reasoning import partial_suffix  # the held-back tail; reasoning parsers share it
from pagedllm.core.contracts.tools import ParsedTools, ToolCall, ToolParser
from pagedllm.core.json_scan import JSONField, JSONMalformed, scan_object, skip_ws


class _Held:
    def __repr__(self) -> str:
        return "HELD"


HELD = _Held()  # a segment: the rest of the text is held back
PENDING = _Held()  # a region's answer: valid so far, but nothing to show yet
Segment = str | list[ToolCall] | _Held
Region = list[ToolCall] | None | _Held  # calls, malformed (None), or PENDING
ARGUMENT_KEYS = ("arguments", "parameters")


def assemble(segments: Iterable[Segment], finished: bool) -> ParsedTools:
    """ParsedTools from a parser's segments (see the module docstring for the rules)."""
    pieces: list[str] = []
    calls: list[ToolCall] = []
    current: list[str] = []
    after_call = held = False
    for segment in segments:
        if segment is HELD:
            held = True
            break
        if isinstance(segment, str):
            current.append(segment)
            continue
        piece = "".join(current)
        pieces.append((piece.lstrip() if after_call else piece).rstrip())
        current, after_call = [], True
        calls.extend(segment)
    last = "".join(current)
    if after_call:
        last = last.lstrip()
    if held or not finished:
        last = last.rstrip()
    pieces.append(last)
    return ParsedTools("\n".join(p for p in pieces if p), calls)


class SegmentParser(ToolParser):
    """A parser written as `segments(text, finished)`; `parse` assembles them."""

    def segments(self, text: str, finished: bool) -> Iterator[Segment]:
        raise NotImplementedError

    def parse(self, text: str, finished: bool) -> ParsedTools:
        return assemble(self.segments(text, finished), finished)


def tagged_regions(text: str, start: str, end: str, finished: bool,
                   parse_body: Callable[[str, bool], Region]) -> Iterator[Segment]:
    """Segments of a format whose calls sit between `start` and `end` tags.

    A region runs from `start` to the first `end` after it (or to the end of the text);
    `parse_body(body, complete)` reads what is between, `complete` when no more can come
    (the region closed, or the text is finished): it returns the calls, PENDING, or None
    when malformed, which makes the whole region content.
    """
    pos = 0
    while True:
        begin = text.find(start, pos)
        if begin < 0:
            tail = text[pos:]
            held = 0 if finished else partial_suffix(tail, start)
            yield tail[:len(tail) - held]
            if held:
                yield HELD
            return
        yield text[pos:begin]
        body_start = begin + len(start)
        close = text.find(end, body_start)
        closed = close >= 0
        body = text[body_start:close] if closed else text[body_start:]
        if not closed and not finished:
            body = body[:len(body) - partial_suffix(body, end)]
        region_end = close + len(end) if closed else len(text)
        result = parse_body(body, closed or finished)
        if result is None:
            yield text[begin:region_end]
        elif result is PENDING:
            yield HELD
            return
        else:
            yield result
        if not closed:
            return
        pos = region_end


def json_call(text: str, members: list[JSONField], done: bool, name_key: str = "name",
              argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> ToolCall | None | _Held:
    """The call a (maybe unfinished) JSON object `{"name": ..., "arguments": {...}}` holds.

    `members` are the object's members (`scan_object`), `done` whether it has closed. The
    arguments are the object's text as the model wrote it (so they only grow while it
    streams). Returns None when the object cannot be a call (another key, a name that is
    not a string, arguments that are not an object), PENDING while the name is not out.
    """
    name: str | None = None
    arguments: str | None = None
    seen: set[str] = set()
    for member in members:
        if member.key in seen or (member.key != name_key and member.key not in argument_keys):
            return None
        seen.add(member.key)
        if member.key == name_key:
            if member.end is None:
                if text[member.start:member.start + 1] not in ('"', ""):
                    return None
                continue
            value = json.loads(text[member.start:member.end])
            if not isinstance(value, str) or not value:
                return None
            name = value
        else:
            if len(seen & set(argument_keys)) > 1:
                return None
            arguments = member.raw(text)
            if arguments and not arguments.startswith("{"):
                return None
    if name is None:
        return None if done else PENDING
    if not arguments:
        if not done:
            return PENDING  # shown once its arguments have begun as an object
        arguments = "{}"
    return ToolCall(name, arguments)


def json_object_call(body: str, complete: bool, pos: int = 0) -> Region:
    """A region whose body is one JSON call object and nothing else but blanks."""
    pos = skip_ws(body, pos)
    if pos == len(body):
        return None if complete else PENDING
    if body[pos] != "{":
        return None
    try:
        members, end = scan_object(body, pos)
    except JSONMalformed:
        return None
    if end is None and complete:
        return None
    if end is not None and body[end:].strip():
        return None
    call = json_call(body, members, end is not None)
    return call if call is None or call is PENDING else [call]
