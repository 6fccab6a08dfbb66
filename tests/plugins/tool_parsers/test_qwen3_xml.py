"""The qwen3_xml parser: Qwen3-Coder's `<function=...><parameter=...>` calls, values typed
by the tool's schema."""

from __future__ import annotations

import pytest

from pagedllm.core.contracts.tools import ToolSpec
from pagedllm.plugins.tool_parsers.qwen3_xml import Qwen3XMLToolParser
from tests.plugins.tool_parsers._stream import calls_of, parse_streamed

TOOLS = [ToolSpec("book", parameters={"type": "object", "properties": {
    "city": {"type": "string"}, "nights": {"type": "integer"}, "budget": {"type": "number"},
    "breakfast": {"type": "boolean"}, "rooms": {"type": "array"}, "extras": {"type": "object"},
    "note": {"type": ["string", "null"]}, "zip": {"type": "string"}}})]


def call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parse(text: str, tools=TOOLS):
    return parse_streamed(Qwen3XMLToolParser, text, tools)


def test_values_follow_the_schema_types() -> None:
    text = "I will book it.\n" + call("book", city="Paris", nights="3", budget="99.5", breakfast="True",
                                      rooms='[{"beds": 2}]', extras="{'late': True}", note="null", zip="07001")
    out = parse(text)
    assert out.content == "I will book it."
    assert calls_of(out) == [("book", {"city": "Paris", "nights": 3, "budget": 99.5, "breakfast": True,
                                       "rooms": [{"beds": 2}], "extras": {"late": True}, "note": None,
                                       "zip": "07001"})]


def test_without_a_schema_values_are_text() -> None:
    assert calls_of(parse(call("other", n="3", multi="line one\nline two"), tools=None)) == [
        ("other", {"n": "3", "multi": "line one\nline two"})]


def test_a_value_that_does_not_read_as_its_type_stays_text() -> None:
    assert calls_of(parse(call("book", nights="three"))) == [("book", {"nights": "three"})]


def test_several_calls_and_missing_closing_tags() -> None:
    text = ("<tool_call>\n<function=book>\n<parameter=city>\nRome\n<parameter=nights>\n2\n</function>\n"
            "</tool_call>\n<tool_call>\n<function=noargs>\n</tool_call>")
    assert calls_of(parse(text)) == [("book", {"city": "Rome", "nights": 2}), ("noargs", {})]


@pytest.mark.parametrize("text", [
    "<tool_call>\njust text\n</tool_call>",
    "<tool_call>\n<function=book>\nstray text\n</function>\n</tool_call>",
    "<tool_call>\n<function=bad name>\n</function>\n</tool_call>",
    "<tool_call>\n</tool_call>",
])
def test_malformed_is_content(text: str) -> None:
    out = Qwen3XMLToolParser(None, TOOLS).parse(text, finished=True)
    assert out.content == text and not out.calls


def test_arguments_grow_a_parameter_at_a_time() -> None:
    parser = Qwen3XMLToolParser(None, TOOLS)
    text = call("book", city="Paris", nights="3")
    cut = text.index("<parameter=nights>") + 12
    partial = parser.parse(text[:cut], finished=False)
    assert partial.calls[0].name == "book" and partial.calls[0].arguments == '{"city": "Paris"'
