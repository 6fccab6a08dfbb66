"""Tool-call parsers: text in, tool calls out.

A parser reads a model's completion text (the chat template told the model about the
tools) and finds the calls in it, in the model family's own syntax (Hermes'
`<tool_call>{...}</tool_call>`, Llama 3's bare JSON, Mistral's `[TOOL_CALLS]`, Qwen3's
XML, pythonic `[f(x=1)]`). The contract is text only, so a parser package need not
import the server: the server turns `ParsedTools` into OpenAI's message and stream
shapes. Parsing is of the cumulative text, as the reasoning parsers do: a stream asks
again with more text and sends what grew.

Most formats carry JSON, often unfinished while a stream runs, so the JSON scanner the
built-in parsers use is here too (`scan_json`, `scan_object`, `scan_array`): it says
where a value ends, or that the text so far is a valid start of one (`JSONIncomplete`),
or that it can never be (`JSONMalformed`), without decoding anything.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ToolCall:
    """One call: the function's name and its arguments as JSON text. While a stream is
    unfinished the arguments may be a prefix of the final text (they only grow)."""

    name: str
    arguments: str


@dataclass
class ParsedTools:
    """A completion split into the text meant for the user and the calls."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolSpec:
    """A tool the request offered: its name, description and JSON-schema parameters
    (None: no parameters given). Parsers whose syntax carries no types (Qwen3's XML
    parameters are bare text) read the schema to turn values into JSON."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolParser(ABC):
    """Finds tool calls in completion text. One instance per choice being parsed.

    Args:
        tokenizer: the model's tokenizer (transformers interface), for parsers that need
            to know its special tokens.
        tools: the tools the request offered, when the server knows them.

    Class-level facts:
        name: the `--tool-call-parser` name.
        keep_special_tokens: True when the syntax is made of special tokens (Mistral's
            `[TOOL_CALLS]`), which detokenization would otherwise drop: the server then
            generates with `skip_special_tokens=False`.
    """

    name: ClassVar[str] = ""
    keep_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Any, tools: list[ToolSpec] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools or [])

    @abstractmethod
    def parse(self, text: str, finished: bool) -> ParsedTools:
        """The content and calls in `text` so far. Unless `finished`, text that could
        still become a call is held back from `content`; `content` and every call's
        `arguments` only grow from one call to the next (a stream sends the growth)."""

    def tool(self, name: str) -> ToolSpec | None:
        """The offered tool called `name`, if any."""
        return next((t for t in self.tools if t.name == name), None)

    def make_call_id(self) -> str:
        """A fresh id for a call found (vLLM's shape); a format whose chat template checks
        ids (Mistral's: 9 letters or digits) overrides it."""
        return f"chatcmpl-tool-{secrets.token_hex(16)}"


# ---------------------------------------------------------------- JSON scanning


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

