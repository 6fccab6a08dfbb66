"""Qwen3-Coder's XML tool calls (vLLM's `qwen3_xml` / `qwen3_coder`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are bare text, so they are turned into JSON with the type the tool's
parameter schema gives them (integer, number, boolean, object, array, null), as text
when no schema says otherwise or the value does not read as its type. The arguments
grow one whole parameter at a time while a stream runs.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Iterator

from pagedllm.core.contracts.tools import ToolCall, ToolSpec
from pagedllm.plugins.tool_parsers.base import PENDING, Region, Segment, SegmentParser, tagged_regions
from pagedllm.plugins.tool_parsers.pythonic import as_json

FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_NAME = re.compile(r"[^<>\s]+")
_INTEGER = re.compile(r"-?\d+")


class Qwen3XMLToolParser(SegmentParser):
    """Lenient where Qwen3-Coder is known to slip: a missing `</parameter>` ends at the
    next parameter or `</function>`, and a missing `</function>` at `</tool_call>`. Any
    other text inside a region makes it content."""

    name = "qwen3_xml"

    def segments(self, text: str, finished: bool) -> Iterator[Segment]:
        return tagged_regions(text, "<tool_call>", "</tool_call>", finished, self.parse_body)

    def parse_body(self, body: str, complete: bool) -> Region:
        calls: list[ToolCall] = []
        pos = 0
        while True:
            pos = _skip_blanks(body, pos)
            if pos == len(body):
                break
            if not body.startswith(FUNCTION, pos):
                if not complete and FUNCTION.startswith(body[pos:]):
                    break
                return None
            close = body.find(">", pos)
            name_text = body[pos + len(FUNCTION):close if close >= 0 else len(body)]
            if not _NAME.fullmatch(name_text or "x"):
                return None
            if close < 0:
                if complete:
                    return None
                break
            call, pos = self._function(body, close + 1, name_text, complete)
            if call is None:
                return None
            calls.append(call)
            if pos is None:
                break
        if not calls:
            return None if complete else PENDING
        return calls

    def _function(self, body: str, pos: int, name: str, complete: bool) -> tuple[ToolCall | None, int | None]:
        """The call whose parameters start at `pos`, and where it ends (None: still open)."""
        tool = self.tool(name)
        members: list[str] = []
        while True:
            pos = _skip_blanks(body, pos)
            rest = body[pos:]
            if rest.startswith(FUNCTION_END) or (complete and not rest):
                end = pos + len(FUNCTION_END) if rest else pos
                return ToolCall(name, "{" + ", ".join(members) + "}"), end
            if rest.startswith(PARAMETER):
                close = body.find(">", pos)
                if close < 0:
                    if complete or not _NAME.fullmatch(rest[len(PARAMETER):] or "x"):
                        return None, None
                    return ToolCall(name, "{" + ", ".join(members)), None
                key = body[pos + len(PARAMETER):close]
                if not _NAME.fullmatch(key):
                    return None, None
                start = close + 1
                ends = [(i, tag) for tag in (PARAMETER_END, PARAMETER, FUNCTION_END)
                        if (i := body.find(tag, start)) >= 0]
                if not ends and not complete:
                    return ToolCall(name, "{" + ", ".join(members)), None
                end, tag = min(ends) if ends else (len(body), "")
                value = convert(_trim(body[start:end]), key, tool)
                members.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
                pos = end + len(PARAMETER_END) if tag == PARAMETER_END else end
                continue
            if not complete and (FUNCTION_END.startswith(rest) or PARAMETER.startswith(rest)):
                return ToolCall(name, "{" + ", ".join(members)), None
            return None, None


def _skip_blanks(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _trim(value: str) -> str:
    """The value without the one newline the format puts on each side of it."""
    return value.removeprefix("\n").removesuffix("\n")


def schema_types(tool: ToolSpec | None, key: str) -> list[str]:
    """The JSON types the tool's schema allows for parameter `key` (empty: unknown)."""
    properties = ((tool.parameters or {}).get("properties") or {}) if tool is not None else {}
    schema = properties.get(key)
    if not isinstance(schema, dict):
        return []
    kinds = schema.get("type")
    if isinstance(kinds, str):
        return [kinds]
    if isinstance(kinds, list):
        return [k for k in kinds if isinstance(k, str)]
    found = []
    for option in schema.get("anyOf") or schema.get("oneOf") or []:
        if isinstance(option, dict) and isinstance(option.get("type"), str):
            found.append(option["type"])
    if "enum" in schema and not found:
        found = sorted({_json_type(v) for v in schema["enum"]})
    return found


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if value is None:
        return "null"
    return "string" if isinstance(value, str) else "object"


def convert(value: str, key: str, tool: ToolSpec | None) -> Any:
    """`value` as the JSON value its schema type says; the text itself otherwise."""
    kinds = schema_types(tool, key)
    text = value.strip()
    for kind in sorted(kinds, key=lambda k: k == "string"):  # a string only when nothing else reads
        if kind == "null" and text.lower() in ("null", "none"):
            return None
        if kind == "integer" and _INTEGER.fullmatch(text):
            return int(text)
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(text) if _INTEGER.fullmatch(text) else number
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("object", "array"):
            parsed = _structured(text)
            if isinstance(parsed, dict if kind == "object" else list):
                return parsed
        if kind == "string":
            return value
    return value


def _structured(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return as_json(ast.literal_eval(text))  # a model may write Python literals: {'a': True}
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None
