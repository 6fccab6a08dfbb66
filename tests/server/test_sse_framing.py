"""Server-sent events stay one line each whatever text they carry: JSON leaves U+0085,
U+2028 and U+2029 raw, and line readers such as httpx's iter_lines (str.splitlines) split
on them, so a token decoding to one cut its event in two (seen as an unterminated string)."""

from __future__ import annotations

import json

import pytest

from pagedllm.server.responses import frame as sse_event
from pagedllm.server.streaming import sse


@pytest.mark.parametrize("text", ["a\u2028b", "x\x85y", "p\u2029q", "tab\tnew\nline\rret\x0bvt\x1cfs é 字"])
def test_an_event_is_one_line_and_round_trips(text):
    for event in (sse({"text": text}), sse_event({"type": "response.output_text.delta", "delta": text})):
        data = [line for line in event.splitlines() if line]
        assert len(data) == len([ln for ln in event.split("\n") if ln]), f"{event!r} breaks on a line separator"
        payload = json.loads(data[-1][len("data: "):])
        assert text in (payload.get("text"), payload.get("delta"))
