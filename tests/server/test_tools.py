"""Tool calling on /v1/chat/completions: the request checks and answer shapes (unit), and
a live SmolLM2 server with the hermes parser and a template that renders tools, driven
by the official `openai` client: auto on a few-shot continuation, tool messages, the bad
inputs, and required / named tool choice enforced by structured outputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import pytest

from pagedllm.core.contracts.tools import ToolSpec
from pagedllm.plugins.tool_parsers.hermes import HermesToolParser
from pagedllm.server.app import ServerSettings
from pagedllm.server.chat import ChoiceText
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import Fields
from pagedllm.server.reasoning import DeepSeekR1ReasoningParser
from pagedllm.server.tools import (
    AUTO_NEEDS_FLAGS,
    RequiredCallsParser,
    ToolRequest,
    load_tool_parser_plugin,
    read_tool_request,
    required_schema,
    resolve_tool_parser,
)

# A ChatML template that renders tools as Qwen2.5 and Hermes do (SmolLM2's own ignores them).
TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def hermes_call(city: str) -> str:
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s", "unit": "celsius"}}\n</tool_call>' % city


# A few-shot conversation SmolLM2-135M continues with a hermes call for Paris at temperature 0.
FEW_SHOT = [m for city in ("Rome", "Oslo", "Lima", "Cairo")
            for m in ({"role": "user", "content": f"Weather in {city}?"},
                      {"role": "assistant", "content": hermes_call(city)})] + [
    {"role": "user", "content": "Weather in Paris?"}]


# ------------------------------------------------------------------ unit: the request


def read(body: dict[str, Any], auto: bool = True) -> ToolRequest | None:
    return read_tool_request(Fields(body), HermesToolParser if auto else None, auto)


def test_tools_default_to_auto_and_reach_the_template_as_given() -> None:
    request = read({"tools": TOOLS})
    assert request is not None and request.mode == "auto" and request.parser is HermesToolParser
    assert request.template_tools == TOOLS
    assert [t.name for t in request.tools] == ["get_weather", "get_time"]
    assert read({}) is None and read({"tools": []}) is None


def test_auto_needs_the_flags() -> None:
    with pytest.raises(APIError) as info:
        read({"tools": TOOLS}, auto=False)
    assert info.value.param == "tool_choice" and info.value.message == AUTO_NEEDS_FLAGS
    assert read({"tools": TOOLS, "tool_choice": "none"}, auto=False).mode == "none"


def test_exclude_tools_when_tool_choice_none() -> None:
    request = read_tool_request(Fields({"tools": TOOLS, "tool_choice": "none"}), None, False, exclude_when_none=True)
    assert request.template_tools is None


@pytest.mark.parametrize("body, param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": 3}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tool_fields_are_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        read(body)
    assert info.value.status_code == 400 and info.value.param == param and info.value.message


def test_required_schema_pairs_each_name_with_its_schema() -> None:
    tools = [ToolSpec("a", parameters={"type": "object", "properties": {"x": {"$ref": "#/$defs/X"}},
                                       "$defs": {"X": {"type": "integer"}}}), ToolSpec("b")]
    schema = required_schema(tools, parallel=False)
    assert schema["maxItems"] == 1 and schema["$defs"] == {"X": {"type": "integer"}}
    jsonschema.validate([{"name": "a", "parameters": {"x": 1}}], schema)
    jsonschema.validate([{"name": "b", "parameters": {}}], schema)
    for bad in ([], [{"name": "a", "parameters": {"x": "1"}}], [{"name": "c", "parameters": {}}],
                [{"name": "b", "parameters": {}}, {"name": "b", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert "maxItems" not in required_schema(tools, parallel=True)


def test_forced_choice_sets_structured_outputs_and_refuses_another_constraint() -> None:
    named = read({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    values = named.apply({"structured_outputs": None, "_param_names": {}}, has_structured_outputs=True)
    assert values["structured_outputs"].json == SCHEMAS["get_time"]
    with pytest.raises(APIError) as info:
        named.apply({"structured_outputs": object(), "_param_names": {"structured_outputs": "response_format"}},
                    has_structured_outputs=True)
    assert info.value.param == "response_format"
    with pytest.raises(APIError) as info:
        named.apply({"structured_outputs": None}, has_structured_outputs=False)
    assert info.value.param == "tool_choice"
    assert read({"tools": TOOLS}).apply({"structured_outputs": None}, True)["structured_outputs"] is None


def test_required_output_streams_into_calls() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, ' \
           '{"name": "get_time", "parameters": {"zone": "UTC"}}]'
    stream = read({"tools": TOOLS, "tool_choice": "required"}).stream(None)
    items = []
    for end in range(len(text) + 1):
        content, new = stream.update(text[:end], finished=end == len(text))
        assert content == ""
        items += new
    headers = [i for i in items if "id" in i]
    assert [h["function"]["name"] for h in headers] == ["get_weather", "get_time"]
    arguments = ["".join(i["function"]["arguments"] for i in items if i["index"] == n) for n in (0, 1)]
    assert [json.loads(a) for a in arguments] == [{"city": "Paris", "unit": "celsius"}, {"zone": "UTC"}]
    assert RequiredCallsParser(None).parse("not json", finished=True).content == "not json"


def test_parallel_false_keeps_the_first_auto_call() -> None:
    stream = read({"tools": TOOLS, "parallel_tool_calls": False}).stream(None)
    content, calls = stream.message(hermes_call("Rome") + "\n" + hermes_call("Oslo"))
    assert content is None and len(calls) == 1 and json.loads(calls[0]["function"]["arguments"])["city"] == "Rome"


def test_calls_are_read_from_the_content_after_the_reasoning() -> None:
    text = "<think>The user wants <tool_call> weather.</think>Checking.\n" + hermes_call("Rome")
    tools = read({"tools": TOOLS})
    message, finish = ChoiceText(DeepSeekR1ReasoningParser(), tools.stream(None)).message(text, "stop")
    assert finish == "tool_calls" and message["content"] == "Checking."
    assert message["reasoning_content"] == message["reasoning"] == "The user wants <tool_call> weather."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    streaming = ChoiceText(DeepSeekR1ReasoningParser(), tools.stream(None))
    deltas = [d for end in range(len(text) + 1) for d in streaming.deltas(text[:end], end == len(text))]
    assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    items = [i for d in deltas for i in d.get("tool_calls", [])]
    assert items[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(i["function"]["arguments"] for i in items) == message["tool_calls"][0]["function"]["arguments"]
    assert streaming.finish_reason("stop") == "tool_calls" and streaming.finish_reason("length") == "length"


def test_a_plugin_file_adds_parsers(tmp_path: Path) -> None:
    plugin = tmp_path / "my_parsers.py"
    plugin.write_text(
        "from pagedllm.core.contracts.tools import ParsedTools, ToolCall, ToolParser\n"
        "from pagedllm.core.hookspecs import hookimpl\n\n"
        "class Shout(ToolParser):\n"
        "    name = 'shout'\n"
        "    def parse(self, text, finished):\n"
        "        return ParsedTools('', [ToolCall(text.strip(), '{}')]) if text.isupper() else ParsedTools(text)\n\n"
        "class Whisper(Shout):\n"
        "    name = ''\n\n"
        "@hookimpl\n"
        "def pagedllm_tool_parsers():\n"
        "    return {'whisper': Whisper}\n")
    found = load_tool_parser_plugin(str(plugin))
    assert sorted(found) == ["shout", "whisper"]
    assert resolve_tool_parser("shout", str(plugin)) is found["shout"]
    settings = ServerSettings(enable_auto_tool_choice=True, tool_call_parser="whisper", tool_parser_plugin=str(plugin))
    assert settings.tool_call_parser == "whisper"
    with pytest.raises(ValueError, match="available: .*hermes.*shout"):
        ServerSettings(tool_call_parser="nope", tool_parser_plugin=str(plugin))
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n")
    with pytest.raises(ValueError, match="defines no tool parser"):
        load_tool_parser_plugin(str(empty))
    with pytest.raises(ValueError, match="is not a file"):
        ServerSettings(tool_parser_plugin=str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ServerSettings(enable_auto_tool_choice=True)


# ------------------------------------------------------------------ live: SmolLM2 + hermes


@pytest.fixture(scope="module")
def smol(start_server, smollm2_path: str) -> Iterator[Any]:
    settings = ServerSettings(chat_template=TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="hermes")
    # no prefix cache: a request that reuses an earlier one's prompt blocks computes its last
    # prompt rows in another batch shape, which may take another kernel (the CPU's measured
    # crossovers) and flip a near-tie; the tests compare a whole answer with its stream
    with start_server(settings, model=smollm2_path, kv_cache_memory=128 << 20, max_model_len=2048,
                      enable_prefix_caching=False) as live:
        yield live


def collect_stream(chunks: Any) -> dict[int, dict[str, Any]]:
    """Per choice: its content, finish_reason, and calls rebuilt from the deltas (checking
    OpenAI's order: a header with id, type and name first, then argument fragments)."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            got = choices.setdefault(choice.index, {"content": "", "calls": {}, "finish_reason": None})
            got["content"] += choice.delta.content or ""
            for item in choice.delta.tool_calls or []:
                if item.index not in got["calls"]:
                    assert item.id and item.type == "function" and item.function.name
                    assert item.function.arguments == ""
                    got["calls"][item.index] = {"id": item.id, "name": item.function.name, "arguments": ""}
                else:
                    assert item.id is None and not item.function.name
                    got["calls"][item.index]["arguments"] += item.function.arguments
            if choice.finish_reason:
                got["finish_reason"] = choice.finish_reason
    return choices


@pytest.mark.slow
def test_auto_reads_a_hermes_call(smol: Any) -> None:
    with smol.openai() as client:
        out = client.chat.completions.create(model=smol.model, messages=FEW_SHOT, tools=TOOLS, max_tokens=60,
                                             temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}


@pytest.mark.slow
def test_auto_streams_the_call_for_every_choice(smol: Any) -> None:
    with smol.openai() as client:
        whole = client.chat.completions.create(model=smol.model, messages=FEW_SHOT, tools=TOOLS, max_tokens=60,
                                               temperature=0)
        chunks = list(client.chat.completions.create(model=smol.model, messages=FEW_SHOT, tools=TOOLS,
                                                     max_tokens=60, temperature=0, n=2, stream=True))
    choices = collect_stream(chunks)
    assert sorted(choices) == [0, 1]
    expected = whole.choices[0].message.tool_calls[0].function
    for got in choices.values():
        assert got["finish_reason"] == "tool_calls" and got["content"] == ""
        assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [(expected.name, expected.arguments)]
        assert got["calls"][0]["id"].startswith("chatcmpl-tool-")


@pytest.mark.slow
def test_tool_choice_none_answers_text(smol: Any) -> None:
    with smol.openai() as client:
        out = client.chat.completions.create(model=smol.model, messages=FEW_SHOT, tools=TOOLS, max_tokens=60,
                                             temperature=0, tool_choice="none")
    assert out.choices[0].finish_reason == "stop" and not out.choices[0].message.tool_calls
    assert out.choices[0].message.content.startswith("<tool_call>")


@pytest.mark.slow
def test_calls_and_tool_results_go_back_to_the_template(smol: Any) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call-1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call-1", "content": "Sunny, 21 C"}]
    with smol.client() as http:
        ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        prompt = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in prompt
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in prompt
    with smol.openai() as client:
        out = client.chat.completions.create(model=smol.model, messages=messages, tools=TOOLS, max_tokens=20,
                                             temperature=0, tool_choice="none")
    assert out.choices[0].message.content


@pytest.mark.slow
@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"name": "get_time"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": {"id": "c"}}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "21 C"}]}, "messages"),
])
def test_bad_input_is_a_400_and_the_server_stays_up(smol: Any, body: dict[str, Any], param: str) -> None:
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body}
    with smol.client() as http:
        r = http.post("/v1/chat/completions", json=request)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
        assert http.get("/health").status_code == 200


def test_auto_without_the_flags_is_a_400(start_server) -> None:
    with start_server() as live, live.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]


# ------------------------------------------------------------------ live: enforced choices


@pytest.fixture
def enforcing(smol: Any) -> Any:
    if not smol.engine.engine.logits_factories:
        pytest.skip("no structured-outputs plugin is loaded: required / named tool choice cannot be enforced")
    return smol


QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time in Europe?"}]


def check_calls(calls: list[tuple[str, str]], allowed: list[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in allowed
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.slow
def test_without_structured_outputs_forced_choices_are_refused(smol: Any) -> None:
    if smol.engine.engine.logits_factories:
        pytest.skip("a structured-outputs plugin is loaded")
    with smol.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": QUESTION, "tools": TOOLS, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_valid_calls(enforcing: Any, parallel: bool) -> None:
    kwargs = dict(model=enforcing.model, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=120,
                  temperature=0, parallel_tool_calls=parallel)
    with enforcing.openai() as client:
        whole = client.chat.completions.create(**kwargs)
        streamed = collect_stream(client.chat.completions.create(**kwargs, stream=True))[0]
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    check_calls(calls, ["get_weather", "get_time"])
    assert parallel or len(calls) == 1
    assert streamed["finish_reason"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == calls


@pytest.mark.slow
def test_a_named_function_gives_its_arguments(enforcing: Any) -> None:
    kwargs = dict(model=enforcing.model, messages=QUESTION, tools=TOOLS, max_tokens=80, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    with enforcing.openai() as client:
        whole = client.chat.completions.create(**kwargs)
        streamed = collect_stream(client.chat.completions.create(**kwargs, stream=True))[0]
    (call,) = whole.choices[0].message.tool_calls
    check_calls([(call.function.name, call.function.arguments)], ["get_time"])
    assert whole.choices[0].finish_reason == "stop"  # OpenAI's and vLLM's answer to a named choice
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [("get_time", call.function.arguments)]


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_schema_structured_outputs_cannot_compile_is_a_400_naming_tools(enforcing: Any, choice: Any) -> None:
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}]
    with enforcing.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": QUESTION, "tools": bad, "tool_choice": choice,
                                                    "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
