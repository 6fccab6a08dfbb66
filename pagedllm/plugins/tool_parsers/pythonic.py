"""Pythonic tool calls: a Python list of calls with keyword arguments,
`[get_weather(city="Paris"), get_time()]` (Llama 3.2 / 4 and others; vLLM's `pythonic`).

The list is read with `ast` and its argument values with `ast.literal_eval`, never run.
A list is judged when it closes, so while it streams it is held back whole; one with
positional arguments, expressions or values JSON cannot carry is content.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Iterator

from pagedllm.core.contracts.tools import ToolCall
from pagedllm.plugins.tool_parsers.base import HELD, Segment, SegmentParser

_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_MAY_START = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?\Z")
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


class PythonicToolParser(SegmentParser):
    name = "pythonic"

    def segments(self, text: str, finished: bool) -> Iterator[Segment]:
        pos = 0
        while True:
            match = _START.search(text, pos)
            if match is None:
                tail = text[pos:]
                bracket = tail.rfind("[")
                if not finished and bracket >= 0 and _MAY_START.match(tail, bracket):
                    yield tail[:bracket]
                    yield HELD
                else:
                    yield tail
                return
            begin = match.start()
            yield text[pos:begin]
            try:
                end = list_end(text, begin)
            except ValueError:
                end = -1
            if end is None:  # still open
                if finished:
                    yield text[begin:]
                else:
                    yield HELD
                return
            calls = parse_calls(text[begin:end]) if end > 0 else None
            if calls is None:  # not a list of calls: the bracket is content, read on after it
                yield text[begin]
                pos = begin + 1
                continue
            yield calls
            pos = end


_PLAIN = re.compile(r"[^\"'()\[\]{}]+")  # runs with no quote or bracket, skipped at once
_STRING_BODY = {q: re.compile(r"(?:[^\\\n%s]|\\.)*" % q[0] if len(q) == 1 else r"(?:[^\\%s]|\\.|%s(?!%s))*"
                              % (q[0], q[0], q[1:]), re.DOTALL) for q in ("'", '"', "'''", '"""')}


def list_end(text: str, pos: int) -> int | None:
    """The end of the bracketed Python expression at `pos`, skipping strings; None while it
    is open; ValueError for a bracket closed by the wrong kind."""
    stack: list[str] = []
    i = pos
    while i < len(text):
        c = text[i]
        if c in "\"'":
            quote = c * 3 if text.startswith(c * 3, i) else c
            i = _STRING_BODY[quote].match(text, i + len(quote)).end()
            if i >= len(text) or text[i] == "\\" or (len(quote) == 3 and not text.startswith(quote, i)):
                return None  # open, or a backslash that ends the text
            if text[i] == "\n":
                raise ValueError("newline in a string")
            i += len(quote)
            continue
        if c in _CLOSERS:
            stack.append(_CLOSERS[c])
        elif c in ")]}":
            if not stack or stack.pop() != c:
                raise ValueError("unbalanced brackets")
            if not stack:
                return i + 1
        else:
            i = _PLAIN.match(text, i).end()
            continue
        i += 1
    return None


def parse_calls(source: str) -> list[ToolCall] | None:
    """The calls in `[f(a=1), g()]`, None if it is anything else."""
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = dotted_name(node.func)
        if name is None:
            return None
        arguments: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None or keyword.arg in arguments:  # **kwargs, or a repeated name
                return None
            try:
                arguments[keyword.arg] = as_json(ast.literal_eval(keyword.value))
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def as_json(value: Any) -> Any:
    """A literal as a JSON value (tuples become arrays); TypeError if JSON has no such value."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError("not a finite number")
        return value
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("object keys must be strings")
        return {k: as_json(v) for k, v in value.items()}
    raise TypeError(f"{type(value).__name__} is not a JSON value")
