"""Llama 3.1 / 3.2 JSON tool calls: the whole answer is `{"name": ..., "parameters":
{...}}`, maybe after `<|python_tag|>`, several calls separated by `;` (vLLM's
`llama3_json`). An answer that does not start with one is content."""

from __future__ import annotations

from typing import Iterator

from pagedllm.core.json_scan import JSONMalformed, scan_object, skip_ws
from pagedllm.plugins.tool_parsers.base import HELD, PENDING, Segment, SegmentParser, json_call


class Llama3JsonToolParser(SegmentParser):
    """Calls only at the start of the answer; text after the last call is content, and so
    is everything from a call that is malformed on."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def segments(self, text: str, finished: bool) -> Iterator[Segment]:
        pos = skip_ws(text, 0)
        if text.startswith(self.python_tag, pos):
            pos = skip_ws(text, pos + len(self.python_tag))
        elif not finished and self.python_tag.startswith(text[pos:]):
            yield HELD  # nothing yet, or the start of the tag
            return
        if pos == len(text):
            yield HELD if not finished else text
            return
        content_from = 0  # where the text goes back to being content if a call is malformed
        while True:
            if text[pos] != "{":
                yield text[content_from:]
                return
            try:
                members, end = scan_object(text, pos)
            except JSONMalformed:
                yield text[content_from:]
                return
            call = json_call(text, members, end is not None) if end is not None or not finished else None
            if call is None:
                yield text[content_from:]
                return
            if call is PENDING:
                yield HELD
                return
            yield [call]
            if end is None:
                return
            after = skip_ws(text, end)
            if after == len(text) or (text[after] == ";" and skip_ws(text, after + 1) == len(text)):
                if finished:
                    yield text[end:]
                else:
                    yield HELD  # a ';' and another call may follow
                return
            if text[after] != ";":
                yield text[end:]
                return
            content_from, pos = end, skip_ws(text, after + 1)
