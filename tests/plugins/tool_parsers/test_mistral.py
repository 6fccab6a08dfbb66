"""The mistral parser: both `[TOOL_CALLS]` shapes."""

from __future__ import annotations

import re

import pytest

from pagedllm.plugins.tool_parsers.mistral import MistralToolParser
from tests.plugins.tool_parsers._stream import calls_of, parse_streamed


def parse(text: str):
    return parse_streamed(MistralToolParser, text)


def test_the_array_shape() -> None:
    out = parse('Checking. [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]')
    assert calls_of(out) == [("a", {"x": 1}), ("b", {})] and out.content == "Checking."


def test_the_name_args_shape_repeated() -> None:
    out = parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}')
    assert calls_of(out) == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_the_name_args_shape_with_a_call_id() -> None:
    assert calls_of(parse('[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"k": [true, null]}')) == [("f", {"k": [True, None]})]


@pytest.mark.parametrize("text", [
    "[TOOL_CALLS] oops",
    "[TOOL_CALLS][]",
    '[TOOL_CALLS][{"name": "a", "arguments": 1}]',
    '[TOOL_CALLS]f[ARGS]["x"]',
    '[TOOL_CALLS]f[ARGS]{"x": ',
    "plain text, [TOOL_CALL not quite",
])
def test_malformed_is_content(text: str) -> None:
    out = MistralToolParser(None).parse(text, finished=True)
    assert out.content == text and not out.calls


def test_it_keeps_special_tokens_and_makes_nine_character_ids() -> None:
    parser = MistralToolParser(None)
    assert MistralToolParser.keep_special_tokens
    ids = {parser.make_call_id() for _ in range(20)}
    assert len(ids) == 20 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
