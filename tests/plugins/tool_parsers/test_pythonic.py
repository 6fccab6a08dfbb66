"""The pythonic parser: `[f(a=1), g()]`, read with ast, never run."""

from __future__ import annotations

import ast

import pytest

from pagedllm.plugins.tool_parsers.pythonic import PythonicToolParser
from tests.plugins.tool_parsers._stream import calls_of, parse_streamed


def parse(text: str):
    return parse_streamed(PythonicToolParser, text)


def test_a_list_of_calls() -> None:
    out = parse('[get_weather(city="Paris", days=3), get_time()]')
    assert calls_of(out) == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]
    assert out.content == ""


def test_literals_become_json() -> None:
    out = parse("[f(t=(1, 2), d={'a': [True, None]}, s='x]y', q='''it's'''), ns.tool.g(x=-1.5)]")
    assert calls_of(out) == [("f", {"t": [1, 2], "d": {"a": [True, None]}, "s": "x]y", "q": "it's"}),
                             ("ns.tool.g", {"x": -1.5})]


def test_text_around_the_list_is_content() -> None:
    out = parse('Let me look that up.\n[search(q="pagedllm")]\nDone.')
    assert calls_of(out) == [("search", {"q": "pagedllm"})] and out.content == "Let me look that up.\nDone."


@pytest.mark.parametrize("text", [
    "[1, 2, 3] and [a, b]",
    '[f("positional")]',
    "[f(x=open('/etc/passwd'))]",
    "[f(x=__import__('os').system('true'))]",
    "[f(**kw)]",
    "[f(x={1, 2})]",
    "[f(x=1, x=2)]",
    "[f(x=1]",
    "see [link](http://example.com) or [f(",
])
def test_anything_else_is_content(text: str) -> None:
    out = parse(text)
    assert out.content == text and not out.calls


def test_a_stream_holds_the_list_until_it_closes() -> None:
    parser = PythonicToolParser(None)
    assert parser.parse("Hi [get_wea", finished=False).content == "Hi"
    assert not parser.parse('Hi [get_weather(city="Pa', finished=False).calls


@pytest.mark.parametrize("value", ["a\\\\", "it's \\\"x\\\"", "line\\nbreak", "(]"])
def test_strings_with_escapes_and_brackets(value: str) -> None:
    source = f'[f(s="{value}", t=\'\'\'{value}\'\'\')]'
    expected = ast.literal_eval(f"\"{value}\"")
    assert calls_of(parse(source)) == [("f", {"s": expected, "t": ast.literal_eval(f"'''{value}'''")})]
