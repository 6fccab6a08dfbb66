"""Scanning JSON that may be unfinished: where each value of a model's partial output
starts and ends, and whether what is there can still become valid JSON.

Tool-call parsers read a completion while it streams: `json.loads` cannot tell "not
JSON" from "not finished yet", and these scanners can (`JSONIncomplete` against
`JSONMalformed`). Regex-based and depth-capped, so hostile text costs linear time.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

class JSONIncomplete(Exception):
    """The text ends inside a value that could still be completed."""


class JSONMalformed(ValueError):
    """The text is not, and can never become, valid JSON at this position."""


MAX_JSON_DEPTH = 128  # deeper nesting is refused rather than recursed into
_WS = re.compile(r"[ \t\n\r]*")
_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]++|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*+"')
_STRING_START = re.compile(r'"(?:[^"\\\x00-\x1f]++|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*+(?:\\(?:u[0-9a-fA-F]{0,3})?)?\Z')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = re.compile(r"[-+.eE0-9]+")
_NUMBER_START = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:(?<=[0-9])\.[0-9]*)?(?:(?<=[0-9])[eE][+-]?[0-9]*)?\Z")
_LITERALS = ("true", "false", "null")


def skip_ws(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not JSON whitespace."""
    return _WS.match(text, pos).end()


def scan_json(text: str, pos: int = 0, depth: int = 0) -> int:
    """The end of the JSON value that starts at `pos` (after whitespace).

    Raises JSONIncomplete when the text ends first, JSONMalformed when it cannot be JSON.
    """
    pos = skip_ws(text, pos)
    if pos >= len(text):
        raise JSONIncomplete()
    c = text[pos]
    if c == "{":
        end = scan_object(text, pos, depth)[1]
    elif c == "[":
        end = scan_array(text, pos, depth)[1]
    elif c == '"':
        return scan_string(text, pos)
    elif c == "-" or c.isdigit():
        return _scan_number(text, pos)
    else:
        for literal in _LITERALS:
            if text.startswith(literal, pos):
                return pos + len(literal)
            if literal.startswith(text[pos:]):
                raise JSONIncomplete()
        raise JSONMalformed(f"unexpected {c!r} at {pos}")
    if end is None:
        raise JSONIncomplete()
    return end


def scan_string(text: str, pos: int) -> int:
    """The end of the JSON string that starts at `pos` (a double quote)."""
    match = _STRING.match(text, pos)
    if match:
        return match.end()
    if _STRING_START.match(text, pos):
        raise JSONIncomplete()
    raise JSONMalformed(f"bad string at {pos}")


def _scan_number(text: str, pos: int) -> int:
    run = _NUMBER_CHARS.match(text, pos).end()
    if run == len(text):  # more digits may follow
        if _NUMBER_START.match(text, pos):
            raise JSONIncomplete()
        raise JSONMalformed(f"bad number at {pos}")
    match = _NUMBER.match(text, pos)
    if match is None or match.end() != run:
        raise JSONMalformed(f"bad number at {pos}")
    return run


@dataclass
class JSONField:
    """One member of a scanned object: its key, and where its value starts and ends in the
    text (`end` None while the value is unfinished)."""

    key: str
    start: int
    end: int | None = None

    def raw(self, text: str) -> str:
        """The value's text so far (trailing whitespace dropped, so that it only grows)."""
        return text[self.start:self.end if self.end is not None else len(text)].rstrip()


def scan_object(text: str, pos: int, depth: int = 0) -> tuple[list[JSONField], int | None]:
    """The members of the object at `pos` (an opening brace) and the object's end, None
    while unfinished: the members then are those begun so far, the last maybe unfinished.

    Raises JSONMalformed as soon as the text cannot be an object."""
    if depth >= MAX_JSON_DEPTH:
        raise JSONMalformed("JSON nested too deeply")
    members: list[JSONField] = []
    try:
        pos = _expect_more(text, pos + 1)
        if text[pos] == "}":
            return members, pos + 1
        while True:
            if text[pos] != '"':
                raise JSONMalformed(f"expected a key at {pos}")
            key_end = scan_string(text, pos)
            key = json.loads(text[pos:key_end])
            pos = _expect_more(text, key_end)
            if text[pos] != ":":
                raise JSONMalformed(f"expected ':' at {pos}")
            member = JSONField(key, skip_ws(text, pos + 1))
            members.append(member)
            member.end = scan_json(text, member.start, depth + 1)
            pos = _expect_more(text, member.end)
            if text[pos] == "}":
                return members, pos + 1
            if text[pos] != ",":
                raise JSONMalformed(f"expected ',' or '}}' at {pos}")
            pos = _expect_more(text, pos + 1)
    except JSONIncomplete:
        return members, None


def scan_array(text: str, pos: int, depth: int = 0) -> tuple[list[tuple[int, int | None]], int | None]:
    """The (start, end) of each item of the array at `pos` (an opening bracket), and the
    array's end; ends are None while unfinished, as in `scan_object`."""
    if depth >= MAX_JSON_DEPTH:
        raise JSONMalformed("JSON nested too deeply")
    items: list[tuple[int, int | None]] = []
    try:
        pos = _expect_more(text, pos + 1)
        if text[pos] == "]":
            return items, pos + 1
        while True:
            start = pos
            items.append((start, None))
            end = scan_json(text, start, depth + 1)
            items[-1] = (start, end)
            pos = _expect_more(text, end)
            if text[pos] == "]":
                return items, pos + 1
            if text[pos] != ",":
                raise JSONMalformed(f"expected ',' or ']' at {pos}")
            pos = _expect_more(text, pos + 1)
    except JSONIncomplete:
        return items, None


def _expect_more(text: str, pos: int) -> int:
    pos = skip_ws(text, pos)
    if pos >= len(text):
        raise JSONIncomplete()
    return pos

