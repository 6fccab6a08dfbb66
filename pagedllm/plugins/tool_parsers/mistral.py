"""Mistral tool calls after the `[TOOL_CALLS]` control token, in both of its shapes
(vLLM's `mistral`):

- older tokenizers: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (one array);
- v11 and later: `[TOOL_CALLS]name[ARGS]{...}`, the token again before each call
  (`[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` where the tokenizer has call ids).

`[TOOL_CALLS]` is a special token, so the server keeps special tokens in the text
(`keep_special_tokens`). Mistral's chat templates want call ids of 9 letters or digits.
"""

from __future__ import annotations

import re
import secrets
import string
from typing import Iterator

from pagedllm.core.contracts.tools import ToolCall
from pagedllm.core.json_scan import JSONMalformed, scan_array, scan_object, skip_ws
from pagedllm.plugins.tool_parsers.base import HELD, PENDING, Segment, SegmentParser, json_call, partial_suffix

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_CALL_ID = re.compile(r"[A-Za-z0-9]*")
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(SegmentParser):
    """A `[TOOL_CALLS]` region that is malformed is content (the token included); the text
    after it is read afresh, so a later `[TOOL_CALLS]` can still hold calls."""

    name = "mistral"
    keep_special_tokens = True
    tag = "[TOOL_CALLS]"

    def make_call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def segments(self, text: str, finished: bool) -> Iterator[Segment]:
        pos = 0
        while True:
            begin = text.find(self.tag, pos)
            if begin < 0:
                tail = text[pos:]
                held = 0 if finished else partial_suffix(tail, self.tag)
                yield tail[:len(tail) - held]
                if held:
                    yield HELD
                return
            yield text[pos:begin]
            body = skip_ws(text, begin + len(self.tag))
            if body == len(text) and not finished:
                yield HELD
                return
            first = text[body:body + 1]
            if first == "[":
                calls, end = self._array(text, body, finished)
            elif first == "{":
                calls, end = self._object(text, body, finished)
            else:
                calls, end = self._named(text, body, finished)
            if calls is None:  # malformed: the tag is content, read on after it
                yield self.tag
                pos = begin + len(self.tag)
                continue
            if calls:
                yield calls
            if end is None:
                yield HELD
                return
            pos = end

    def _array(self, text: str, pos: int, finished: bool) -> tuple[list[ToolCall] | None, int | None]:
        """`[{...}, ...]`: the calls so far and the array's end (None while open)."""
        try:
            items, end = scan_array(text, pos)
        except JSONMalformed:
            return None, None
        if (end is None and finished) or (end is not None and not items):
            return None, None
        calls = []
        for start, item_end in items:
            if text[start] != "{":
                return None, None
            try:
                members, _ = scan_object(text, start)
            except JSONMalformed:
                return None, None
            call = json_call(text, members, item_end is not None)
            if call is None:
                return None, None
            if call is PENDING:
                break
            calls.append(call)
        return calls, end

    def _object(self, text: str, pos: int, finished: bool) -> tuple[list[ToolCall] | None, int | None]:
        try:
            members, end = scan_object(text, pos)
        except JSONMalformed:
            return None, None
        if end is None and finished:
            return None, None
        call = json_call(text, members, end is not None)
        if call is None:
            return None, None
        return ([] if call is PENDING else [call]), end

    def _named(self, text: str, pos: int, finished: bool) -> tuple[list[ToolCall] | None, int | None]:
        """`name[ARGS]{...}` or `name[CALL_ID]id[ARGS]{...}`."""
        match = _NAME.match(text, pos)
        if match is None:
            return None, None
        name, pos = match.group(), match.end()
        if text.startswith("[CALL_ID]", pos):
            pos = _CALL_ID.match(text, pos + len("[CALL_ID]")).end()
        if text.startswith("[ARGS]", pos):
            pos += len("[ARGS]")
        elif not finished and any(marker.startswith(text[pos:]) for marker in ("[CALL_ID]", "[ARGS]")):
            return [], None  # the name, the call id or a marker is still coming
        else:
            return None, None
        args = skip_ws(text, pos)
        if args == len(text):
            return (None, None) if finished else ([ToolCall(name, "")], None)
        if text[args] != "{":
            return None, None
        try:
            end = scan_object(text, args)[1]
        except JSONMalformed:
            return None, None
        if end is None and finished:
            return None, None
        return [ToolCall(name, text[args:end if end is not None else len(text)].rstrip())], end
