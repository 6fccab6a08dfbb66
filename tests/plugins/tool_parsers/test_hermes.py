"""The hermes parser: `<tool_call>{json}</tool_call>` regions."""

from __future__ import annotations

import pytest

from pagedllm.plugins.tool_parsers.hermes import HermesToolParser
from tests.plugins.tool_parsers._stream import calls_of, parse_streamed

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def parse(text: str):
    return parse_streamed(HermesToolParser, text)


def test_a_call_after_some_text() -> None:
    out = parse("Let me check.\n" + WEATHER)
    assert out.content == "Let me check."
    assert calls_of(out) == [("get_weather", {"city": "Paris", "days": 3})]


def test_several_calls_and_text_around_them() -> None:
    out = parse(f"{WEATHER}\n{TIME}\nI asked both.")
    assert calls_of(out) == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]
    assert out.content == "I asked both."


def test_arguments_are_the_models_json_text() -> None:
    out = parse('<tool_call>{"name": "f", "arguments": {"q": "caf\\u00e9 <b>", "n": [1, 2.5e3]}}</tool_call>')
    assert out.calls[0].arguments == '{"q": "caf\\u00e9 <b>", "n": [1, 2.5e3]}'


@pytest.mark.parametrize("body", [
    '{"arguments": {"x": 1}, "name": "f"}',  # the name after the arguments
    '{"name": "f", "parameters": {"x": 1}}',  # the other key
])
def test_key_order_and_parameters_key(body: str) -> None:
    assert calls_of(parse(f"<tool_call>{body}</tool_call>")) == [("f", {"x": 1})]


def test_missing_arguments_are_an_empty_object() -> None:
    assert calls_of(parse('<tool_call>{"name": "f"}</tool_call>')) == [("f", {})]


def test_text_without_calls_is_returned_as_it_was() -> None:
    text = "a < b, and <tool> or <tool_ is not a call.  \n"
    assert parse(text).content == text and not parse(text).calls


@pytest.mark.parametrize("region", [
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>',
    '<tool_call>{"name": "f", "other": 1}</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
    "<tool_call></tool_call>",
])
def test_a_malformed_region_is_content(region: str) -> None:
    text = f"before {region} after"
    out = HermesToolParser(None).parse(text, finished=True)
    assert out.content == text and not out.calls


def test_malformed_from_its_first_character_streams_as_content() -> None:
    text = "<tool_call>oops</tool_call> then a call " + WEATHER
    out = parse(text)
    assert out.content == "<tool_call>oops</tool_call> then a call"
    assert [c.name for c in out.calls] == ["get_weather"]


def test_an_unclosed_last_call_counts_when_its_json_is_whole() -> None:
    out = parse('<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert calls_of(out) == [("f", {"a": 1})] and out.content == ""


def test_a_call_cut_short_is_content() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": '
    out = HermesToolParser(None).parse(text, finished=True)
    assert out.content == text and not out.calls


def test_a_stream_holds_back_what_could_become_a_call() -> None:
    parser = HermesToolParser(None)
    assert parser.parse("Sure <tool_", finished=False).content == "Sure"
    assert parser.parse("Sure <tool_", finished=True).content == "Sure <tool_"
    partial = parser.parse('Sure <tool_call>{"name": "get_weather", "arguments": {"city": "Pa', finished=False)
    assert partial.content == "Sure"
    assert partial.calls[0].name == "get_weather" and partial.calls[0].arguments == '{"city": "Pa'
