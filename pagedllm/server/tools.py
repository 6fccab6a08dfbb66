"""Tool calling on /v1/chat/completions: the request's `tools` / `tool_choice` /
`parallel_tool_calls`, the calls in assistant messages, and the calls in the answer.

How each `tool_choice` is met, as in vLLM:

- "none": the tools reach the chat template (unless `--exclude-tools-when-tool-choice-none`),
  the answer is text;
- "auto" (the default when tools are given): the answer is read by the
  `--tool-call-parser` (needs `--enable-auto-tool-choice`); calls found become
  `tool_calls` and finish_reason "tool_calls";
- "required" and a named function are enforced, not hoped for: the output is
  constrained by structured outputs to a JSON array of {"name", "parameters"} (each
  name paired with its own schema), or to the named function's arguments, and that
  JSON is read directly.

Parsers come from the plugin manager (`pagedllm_tool_parsers`) and from
`--tool-parser-plugin FILE`, a Python file loaded at start-up that defines them: either
a `@hookimpl def pagedllm_tool_parsers(): return {"name": Class}` function, or
`ToolParser` subclasses with their `name` set.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.contracts.tools import ParsedTools, ToolCall, ToolParser, ToolSpec
from pagedllm.core.json_scan import JSONMalformed, scan_array, scan_object, skip_ws
from pagedllm.core.plugins import get_registry
from pagedllm.core.request import StructuredOutputsParams
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import Fields, check_count

logger = logging.getLogger("pagedllm.server")

MAX_TOOLS = 256  # each is rendered into the prompt and, when forced, compiled into a grammar
MAX_TOOL_NAME = 256
CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                    '(or send "tool_choice": "none", "required" or a named function)')


# ------------------------------------------------------------ parsers by name


def available_tool_parsers(plugin_file: str | None = None) -> dict[str, type[ToolParser]]:
    """Every parser by name: the plugins' and those of `--tool-parser-plugin` (which win)."""
    parsers = dict(get_registry().tool_parsers)
    if plugin_file:
        for name, cls in load_tool_parser_plugin(plugin_file).items():
            if name in parsers and parsers[name] is not cls:
                logger.info("--tool-parser-plugin %s replaces the tool parser %r", plugin_file, name)
            parsers[name] = cls
    return parsers


def resolve_tool_parser(name: str | None, plugin_file: str | None = None) -> type[ToolParser] | None:
    """The parser class `--tool-call-parser NAME` means; ValueError listing those there are."""
    parsers = available_tool_parsers(plugin_file)
    if name is None:
        return None
    if name not in parsers:
        raise ValueError(f"unknown --tool-call-parser {name!r}; available: {', '.join(sorted(parsers)) or '(none)'}"
                         " (--tool-parser-plugin FILE adds more)")
    return parsers[name]


@functools.lru_cache(maxsize=8)
def load_tool_parser_plugin(path: str) -> dict[str, type[ToolParser]]:
    """The parsers a `--tool-parser-plugin` file defines (loaded once per path)."""
    if not os.path.isfile(path):
        raise ValueError(f"--tool-parser-plugin {path!r} is not a file")
    module_name = "pagedllm_tool_parser_plugin_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--tool-parser-plugin {path!r} cannot be loaded as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
        hook = getattr(module, "pagedllm_tool_parsers", None)
        found = dict(hook() or {}) if callable(hook) else {}
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ValueError(f"--tool-parser-plugin {path!r} failed to load: {exc!r}") from exc
    for value in vars(module).values():
        if (inspect.isclass(value) and issubclass(value, ToolParser) and value.__module__ == module_name
                and value.name and not inspect.isabstract(value)):
            found.setdefault(value.name, value)
    for name, cls in found.items():
        if not (isinstance(name, str) and inspect.isclass(cls) and issubclass(cls, ToolParser)):
            raise ValueError(f"--tool-parser-plugin {path!r}: {name!r} is not a ToolParser subclass")
    if not found:
        raise ValueError(f"--tool-parser-plugin {path!r} defines no tool parser: give it ToolParser subclasses "
                         "with a `name`, or a `@hookimpl def pagedllm_tool_parsers()` returning {name: class}")
    return found


# ------------------------------------------------------------ the request


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tool fields.

    mode: "none", "auto", "required" or "function" (a named function, `function`).
    template_tools: the tools as the chat template gets them (None: not rendered).
    """

    tools: list[ToolSpec]
    template_tools: list[dict[str, Any]] | None
    mode: str
    function: str | None = None
    parallel: bool = True
    parser: type[ToolParser] | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint that enforces "required" or a named function (None otherwise)."""
        if self.mode == "function":
            tool = next(t for t in self.tools if t.name == self.function)
            return StructuredOutputsParams(json=tool.parameters or EMPTY_PARAMETERS)
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel))
        return None

    def apply(self, values: dict[str, Any], has_structured_outputs: bool) -> dict[str, Any]:
        """The SamplingParams values with what these tools need; 400 when a forced choice
        meets another output constraint, or nothing here can enforce it."""
        forced = self.structured_outputs()
        if forced is not None:
            names = dict(values.get("_param_names") or {})
            if values.get("structured_outputs") is not None:
                given = names.get("structured_outputs", "structured_outputs")
                raise APIError(f"'tool_choice' {self.describe()} is enforced with structured outputs, so it cannot "
                               f"be combined with '{given}'; drop one of them", param=given, code="invalid_value")
            if not has_structured_outputs:
                raise APIError(f"'tool_choice' {self.describe()} needs structured outputs, and no structured-outputs "
                               "plugin is loaded here; use \"auto\" or \"none\"", param="tool_choice",
                               code="unsupported")
            values = {**values, "structured_outputs": forced,
                      "_param_names": {**names, "structured_outputs": "tools"}}
        if self.mode == "auto" and self.parser is not None and self.parser.keep_special_tokens:
            values = {**values, "skip_special_tokens": False}
        return values

    def describe(self) -> str:
        return f"naming {self.function!r}" if self.mode == "function" else json.dumps(self.mode)

    def stream(self, tokenizer: Any) -> ToolStream | None:
        """A tracker for one choice's calls; None when the answer is plain text."""
        if self.mode == "none":
            return None
        if self.mode == "function":
            parser: ToolParser = NamedFunctionParser(tokenizer, self.tools, self.function or "")
        elif self.mode == "required":
            parser = RequiredCallsParser(tokenizer, self.tools)
        else:
            assert self.parser is not None
            parser = self.parser(tokenizer, tools=self.tools)
        return ToolStream(parser, self.mode, self.parallel)


def read_tool_request(fields: Fields, parser: type[ToolParser] | None, auto_enabled: bool,
                      exclude_when_none: bool = False) -> ToolRequest | None:
    """The request's tools and tool_choice, checked (400 naming the field); None when it
    gives no tools.

    Args:
        parser: the `--tool-call-parser` class, if any.
        auto_enabled: `--enable-auto-tool-choice`.
        exclude_when_none: `--exclude-tools-when-tool-choice-none`.
    """
    raw = fields.get("tools", "any")
    choice = fields.get("tool_choice", "any")
    parallel = fields.get("parallel_tool_calls", "bool", True)
    if raw is None or raw == []:
        if choice is not None:
            raise APIError("'tool_choice' is only allowed when 'tools' are given", param="tool_choice",
                           code="invalid_value")
        return None
    tools, template_tools = read_tools(raw)
    mode, function = read_tool_choice(choice, [t.name for t in tools])
    if mode == "auto" and not (auto_enabled and parser is not None):
        raise APIError(AUTO_NEEDS_FLAGS, param="tool_choice", code="invalid_value")
    if mode == "none" and exclude_when_none:
        template_tools = None
    return ToolRequest(tools, template_tools, mode, function, parallel, parser if mode == "auto" else None)


def read_tools(value: Any) -> tuple[list[ToolSpec], list[dict[str, Any]]]:
    """OpenAI's `tools` -> (ToolSpecs, the tools in the shape chat templates read)."""
    if not isinstance(value, list):
        raise APIError("'tools' must be an array of {\"type\": \"function\", \"function\": {...}}", param="tools",
                       code="invalid_type")
    check_count(value, MAX_TOOLS, "tools", "tools")
    specs: list[ToolSpec] = []
    shown: list[dict[str, Any]] = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise APIError(f"'{where}' must be an object", param="tools", code="invalid_type")
        if tool.get("type", "function") != "function":
            raise APIError(f"'{where}.type' must be \"function\", got {json.dumps(tool.get('type'))[:40]}",
                           param="tools", code="invalid_value")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(f"'{where}.function' must be an object with a 'name'", param="tools", code="invalid_type")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_TOOL_NAME:
            raise APIError(f"'{where}.function.name' must be a non-empty string of at most {MAX_TOOL_NAME} "
                           "characters", param="tools", code="invalid_value")
        if any(s.name == name for s in specs):
            raise APIError(f"'{where}.function.name' {name!r} is given twice", param="tools", code="invalid_value")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise APIError(f"'{where}.function.description' must be a string", param="tools", code="invalid_type")
        parameters = function.get("parameters")
        if parameters is not None and (not isinstance(parameters, dict)
                                       or parameters.get("type", "object") != "object"):
            raise APIError(f"'{where}.function.parameters' must be a JSON schema of an object "
                           "({\"type\": \"object\", \"properties\": {...}})", param="tools", code="invalid_value")
        specs.append(ToolSpec(name, description, parameters))
        entry = {"name": name, **({"description": description} if description is not None else {}),
                 **({"parameters": parameters} if parameters is not None else {})}
        shown.append({"type": "function", "function": entry})
    return specs, shown


def read_tool_choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    """`tool_choice` -> (mode, function name); absent means "auto", as OpenAI has it."""
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in CHOICES:
            raise APIError(f"'tool_choice' must be one of {', '.join(CHOICES)} or {{\"type\": \"function\", "
                           f"\"function\": {{\"name\": ...}}}}, got {json.dumps(value)[:40]}", param="tool_choice",
                           code="invalid_value")
        return value, None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type", "function") != "function" or not isinstance(name, str):
        raise APIError("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}", param="tool_choice", code="invalid_value")
    if name not in names:
        raise APIError(f"'tool_choice' names the function {name!r}, which is not in 'tools' "
                       f"({', '.join(names)})", param="tool_choice", code="invalid_value")
    return "function", name


def required_schema(tools: list[ToolSpec], parallel: bool) -> dict[str, Any]:
    """The JSON schema of `tool_choice: "required"`: an array of calls, each one of
    {"name": that tool, "parameters": its schema}; one call only unless parallel.

    Each tool's `$defs` / `definitions` move to the root, where its `#/$defs/...`
    references now point; two tools defining one name differently is a 400."""
    shared: dict[str, dict[str, Any]] = {}
    options = []
    for tool in tools:
        parameters = dict(tool.parameters or EMPTY_PARAMETERS)
        for key in ("$defs", "definitions"):
            for name, schema in (parameters.pop(key, None) or {}).items():
                if shared.setdefault(key, {}).setdefault(name, schema) != schema:
                    raise APIError(f"two tools define the schema {key}/{name} differently; rename one",
                                   param="tools", code="invalid_value")
        options.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool.name]},
                                                         "parameters": parameters},
                        "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}, **shared}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def message_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, in the shape chat templates expect (arguments
    as an object); 400 naming 'messages' when malformed."""
    if not isinstance(value, list):
        raise APIError(f"'{where}.tool_calls' must be an array", param="messages", code="invalid_type")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise APIError(f"'{at}' must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                           "\"arguments\": ...}}", param="messages", code="invalid_value")
        name, arguments, call_id = function.get("name"), function.get("arguments"), call.get("id")
        if not isinstance(name, str) or not name:
            raise APIError(f"'{at}.function.name' must be a non-empty string", param="messages",
                           code="invalid_value")
        if call_id is not None and not isinstance(call_id, str):
            raise APIError(f"'{at}.id' must be a string", param="messages", code="invalid_type")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise APIError(f"'{at}.function.arguments' must be JSON text of an object", param="messages",
                               code="invalid_value") from None
        if not isinstance(arguments, dict):
            raise APIError(f"'{at}.function.arguments' must be a JSON object (or its text)", param="messages",
                           code="invalid_value")
        calls.append({**({"id": call_id} if call_id else {}), "type": "function",
                      "function": {"name": name, "arguments": arguments}})
    return calls


# ------------------------------------------------------------ the answer


class NamedFunctionParser(ToolParser):
    """A named `tool_choice`: the whole (constrained) output is that function's arguments."""

    def __init__(self, tokenizer: Any, tools: list[ToolSpec], function: str) -> None:
        super().__init__(tokenizer, tools)
        self.function = function

    def parse(self, text: str, finished: bool) -> ParsedTools:
        arguments = text.strip()
        return ParsedTools("", [ToolCall(self.function, arguments)] if arguments or finished else [])


class RequiredCallsParser(ToolParser):
    """`tool_choice: "required"`: the output is a JSON array of {"name", "parameters"}.
    Output that is not (cut short before its first call, or unconstrained) is content."""

    def parse(self, text: str, finished: bool) -> ParsedTools:
        start = skip_ws(text, 0)
        if start == len(text) or text[start] != "[":
            return ParsedTools(text if finished else "")
        calls = []
        try:
            items, _ = scan_array(text, start)
            for item_start, item_end in items:
                if text[item_start] != "{":
                    raise JSONMalformed("not a call")
                members, _ = scan_object(text, item_start)
                name = next((json.loads(text[m.start:m.end]) for m in members if m.key == "name"
                             and m.end is not None), None)
                arguments = next((m.raw(text) for m in members if m.key == "parameters"), "")
                if not isinstance(name, str) or not (arguments or item_end is not None):
                    break
                calls.append(ToolCall(name, arguments or "{}"))
        except JSONMalformed:
            return ParsedTools(text if finished else "")
        if finished and not calls:
            return ParsedTools(text)
        return ParsedTools("", calls)


@dataclass
class ToolStream:
    """One choice's tool calls as they are parsed, sent, and named (call ids).

    `update` takes the cumulative content (after any reasoning) and returns what is new:
    the content delta and OpenAI's tool-call delta items, a header per new call
    ({"index", "id", "type", "function": {"name", "arguments": ""}}) followed by
    argument fragments ({"index", "function": {"arguments": ...}}).
    """

    parser: ToolParser
    mode: str
    parallel: bool
    sent_content: int = 0
    ids: list[str] = field(default_factory=list)
    sent_arguments: list[str] = field(default_factory=list)
    _warned: bool = False

    def parse(self, content: str, finished: bool) -> ParsedTools:
        parsed = self.parser.parse(content, finished)
        if not self.parallel and self.mode == "auto":
            parsed = ParsedTools(parsed.content, parsed.calls[:1])
        return parsed

    def update(self, content: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        parsed = self.parse(content, finished)
        delta = parsed.content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(parsed.content))
        items: list[dict[str, Any]] = []
        for index, call in enumerate(parsed.calls):
            if index == len(self.ids):
                self.ids.append(self.parser.make_call_id())
                self.sent_arguments.append("")
                items.append({"index": index, "id": self.ids[index], "type": "function",
                              "function": {"name": call.name, "arguments": ""}})
            sent = self.sent_arguments[index]
            if len(call.arguments) > len(sent):
                if not call.arguments.startswith(sent):
                    self._warn(call)
                    continue
                items.append({"index": index, "function": {"arguments": call.arguments[len(sent):]}})
                self.sent_arguments[index] = call.arguments
        return delta, items

    def _warn(self, call: ToolCall) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("tool parser %r changed the arguments of a call it had sent (%r); the rest of them is "
                           "not streamed", type(self.parser).__name__, call.name)

    def message(self, content: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole answer's (content, tool_calls), content None when empty."""
        parsed = self.parse(content, finished=True)
        calls = [{"id": self.parser.make_call_id(), "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
        return (parsed.content or None) if calls else parsed.content, calls

    def finish_reason(self, reason: str | None, any_calls: bool) -> str | None:
        """"tool_calls" when calls came of "auto" or "required" (unless cut by length);
        a named function keeps "stop", as OpenAI and vLLM answer it."""
        if any_calls and self.mode in ("auto", "required") and reason not in (None, "length"):
            return "tool_calls"
        return reason
