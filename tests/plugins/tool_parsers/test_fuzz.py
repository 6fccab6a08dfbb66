"""Every parser on text made of its own syntax's pieces, valid or not: no exception, the
content only grows as the text does, and a finished parse is the whole-text parse."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.core.contracts.tools import ToolSpec
from pagedllm.plugins.tool_parsers import pagedllm_tool_parsers

PIECES = ["<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=n>", "</parameter>",
          "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", '{"name": "f", "arguments": ', '{"name": "g"',
          '"parameters": ', "{", "}", "[", "]", "(", ")", "f(", "x=1", ", ", ";", ":", '"', "\\", "'", "a", "7",
          " ", "\n", "é", "true", "null"]
TOOLS = [ToolSpec("f", parameters={"type": "object", "properties": {"n": {"type": "integer"}}})]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=30), name=st.sampled_from(sorted(pagedllm_tool_parsers())))
def test_any_text(pieces: list[str], name: str) -> None:
    cls = pagedllm_tool_parsers()[name]
    text = "".join(pieces)
    whole = cls(None, TOOLS).parse(text, finished=True)
    parser = cls(None, TOOLS)
    content = ""
    for end in range(len(text) + 1):
        parsed = parser.parse(text[:end], finished=False)
        assert parsed.content.startswith(content)
        content = parsed.content
    final = parser.parse(text, finished=True)
    assert final.content.startswith(content) and final == whole
    for call in whole.calls:
        assert call.name and isinstance(json.loads(call.arguments), dict)
