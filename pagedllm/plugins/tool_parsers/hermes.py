"""Hermes / Qwen2.5 style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one call per tag pair, as many pairs as calls (vLLM's `hermes`)."""

from __future__ import annotations

from typing import Iterator

from pagedllm.plugins.tool_parsers.base import Segment, SegmentParser, json_object_call, tagged_regions


class HermesToolParser(SegmentParser):
    """Each `<tool_call>` region holds one JSON object with "name" and "arguments" (or
    "parameters"). A region with anything else in it is content, tags and all; the last
    region may lack its closing tag if its JSON is whole."""

    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def segments(self, text: str, finished: bool) -> Iterator[Segment]:
        return tagged_regions(text, self.start_tag, self.end_tag, finished, json_object_call)
