"""The llama3_json parser: the answer is JSON calls separated by ';'."""

from __future__ import annotations

import pytest

from pagedllm.plugins.tool_parsers.llama3_json import Llama3JsonToolParser
from tests.plugins.tool_parsers._stream import calls_of, parse_streamed


def parse(text: str):
    return parse_streamed(Llama3JsonToolParser, text)


def test_one_call() -> None:
    out = parse('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert calls_of(out) == [("get_weather", {"city": "Paris"})] and out.content == ""


def test_calls_separated_by_semicolons_after_the_python_tag() -> None:
    out = parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}')
    assert calls_of(out) == [("a", {"x": 1}), ("b", {})]


def test_text_after_the_calls_is_content() -> None:
    out = parse('{"name": "a", "parameters": {}}\nThat is all.')
    assert calls_of(out) == [("a", {})] and out.content == "That is all."


@pytest.mark.parametrize("text", [
    "The answer is {x}.",
    '{"answer": 42}',
    '{"name": "a", "parameters": [1]}',
    "  Hello there  ",
])
def test_anything_else_is_content(text: str) -> None:
    out = parse(text)
    assert out.content == text and not out.calls


def test_a_call_cut_short_is_content() -> None:
    text = '{"name": "a", "parameters": {"x": 1}'
    out = Llama3JsonToolParser(None).parse(text, finished=True)
    assert out.content == text and not out.calls


def test_a_malformed_second_call_leaves_the_first() -> None:
    out = Llama3JsonToolParser(None).parse('{"name": "a", "parameters": {}}; {"name": "b", "oops": 1}', True)
    assert calls_of(out) == [("a", {})] and out.content == '; {"name": "b", "oops": 1}'
