"""The contract's JSON scanner: ends of values, prefixes that may still become JSON,
and text that never can."""

from __future__ import annotations

import json

import pytest

from pagedllm.core.json_scan import JSONIncomplete, JSONMalformed, scan_json, scan_object

VALUES = ['{"a": [1, -2.5e+3, true, false, null], "b": {"c": "x\\"y\\u00e9"}}', "[]", "{}", '"\\n"', "0", "-0.5"]


@pytest.mark.parametrize("value", VALUES)
def test_every_prefix_is_incomplete_and_the_whole_ends_where_it_should(value: str) -> None:
    json.loads(value)
    padded = value + " ,"
    assert scan_json(padded, 0) == len(value)
    for end in range(len(value)):
        if value[:end].strip() and value[:end].strip("-0123456789.eE+") == "" and end:
            continue  # a number prefix ending the text: may go on
        with pytest.raises(JSONIncomplete):
            scan_json(value[:end], 0)


@pytest.mark.parametrize("text", ['{"a" 1}', "{'a': 1}", '{"a": 01}', "[1,]", '"\x01"', "tru e", "{,}", "[1 2]",
                                  '"\\x"', "-", "1.e5"])
def test_malformed(text: str) -> None:
    with pytest.raises(JSONMalformed):
        scan_json(text + " ", 0)


def test_members_of_an_unfinished_object() -> None:
    text = '{"name": "f", "arguments": {"x": [1, '
    members, end = scan_object(text, 0)
    assert end is None
    assert [(m.key, m.end is not None) for m in members] == [("name", True), ("arguments", False)]
    assert members[1].raw(text) == '{"x": [1,'


def test_nesting_is_bounded() -> None:
    with pytest.raises(JSONMalformed):
        scan_json("[" * 1000 + "]" * 1000)
