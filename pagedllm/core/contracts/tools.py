"""Tool-call parsers: text in, tool calls out.

A parser reads a model's completion text (the chat template told the model about the
tools) and finds the calls in it, in the model family's own syntax (Hermes'
`<tool_call>{...}</tool_call>`, Llama 3's bare JSON, Mistral's `[TOOL_CALLS]`, Qwen3's
XML, pythonic `[f(x=1)]`). The contract is text only, so a parser package need not
import the server: the server turns `ParsedTools` into OpenAI's message and stream
shapes. Parsing is of the cumulative text, as the reasoning parsers do: a stream asks
again with more text and sends what grew.

Most formats carry JSON, often unfinished while a stream runs: `pagedllm.core.json_scan`
(`scan_json`, `scan_object`, `scan_array`) says where a value ends, or that the text so
far is a valid start of one (`JSONIncomplete`), or that it can never be (`JSONMalformed`),
without decoding anything.
"""

from __future__ import annotations

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
