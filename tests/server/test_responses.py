"""POST /v1/responses with the official openai client against a live server (the bundled
SmolLM2), each answer checked against /v1/chat/completions at temperature 0, and every
object and stream event checked against the installed openai package's types."""

from __future__ import annotations

import asyncio
import json
import typing
from typing import Any, AsyncIterator, Iterator

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from pagedllm.core.request import CompletionOutput, RequestOutput
from pagedllm.server.app import ServerSettings
from pagedllm.server.reasoning import DeepSeekR1ReasoningParser
from pagedllm.server.responses import ResponseBuilder, ResponseEvents

pytestmark = pytest.mark.slow

# Each stream event type -> the openai model that describes it.
EVENT_TYPES = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
               for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smol(start_server: Any, smollm2_path: str) -> Iterator[Any]:
    # no prefix cache: the tests compare a Responses answer with the chat answer to the same
    # prompt, and a prefix hit would prefill the second one's last few tokens alone, where the
    # CPU may take another kernel (few rows: integer VNNI; many rows: bf16 AMX tiles) whose
    # other float sums flipped a near tie on a Xeon with AMX ("I'm a" / "I'm your")
    with start_server(model=smollm2_path, kv_cache_memory=128 << 20, max_model_len=1024,
                      enable_prefix_caching=False) as live:
        yield live


@pytest.fixture(scope="module")
def client(smol: Any) -> Iterator[openai.OpenAI]:
    with smol.openai() as c:
        yield c


def chat_answer(client: openai.OpenAI, model: str, messages: list[dict[str, str]], max_tokens: int) -> Any:
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)


def checked_response(data: dict[str, Any]) -> Response:
    """The response object, validated (not just constructed) as openai's Response model."""
    return Response.model_validate(data)


def raw_events(smol: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE events of a streamed request, each checked: `event:` names its type and its
    data validates as the openai model of that type."""
    events = []
    with smol.client() as http, http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for block in r.read().decode().split("\n\n"):
            if not block.strip():
                continue
            name, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert name == f"event: {event['type']}"
            EVENT_TYPES[event["type"]].model_validate(event)
            events.append(event)
    return events


def test_string_input_answers_as_chat_does(smol: Any, client: openai.OpenAI) -> None:
    resp = client.responses.create(model=smol.model, input=QUESTION, max_output_tokens=30, temperature=0)
    chat = chat_answer(client, smol.model, [{"role": "user", "content": QUESTION}], 30)
    assert resp.output_text == chat.choices[0].message.content and "Paris" in resp.output_text
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == smol.model
    assert resp.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [c.type for c in message.content] == ["output_text"] and message.content[0].annotations == []
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    with smol.client() as http:
        data = http.post("/v1/responses", json={"input": QUESTION, "max_output_tokens": 30, "temperature": 0}).json()
    assert checked_response(data).output[0].content[0].text == resp.output_text


def test_instructions_are_a_system_message(smol: Any, client: openai.OpenAI) -> None:
    instructions = "You are a pirate. Answer like one."
    resp = client.responses.create(model=smol.model, instructions=instructions, input=QUESTION,
                                   max_output_tokens=30, temperature=0)
    chat = chat_answer(client, smol.model, [{"role": "system", "content": instructions},
                                            {"role": "user", "content": QUESTION}], 30)
    assert resp.output_text == chat.choices[0].message.content
    assert resp.instructions == instructions and resp.usage.input_tokens == chat.usage.prompt_tokens
    plain = client.responses.create(model=smol.model, input=QUESTION, max_output_tokens=30, temperature=0)
    assert plain.usage.input_tokens != resp.usage.input_tokens  # the template's default system prompt was replaced


def test_list_input_with_parts_and_an_assistant_turn(smol: Any, client: openai.OpenAI) -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "My name is Ada."},
                                     {"type": "input_text", "text": "I live in Paris."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada!"}]},
        {"role": "user", "content": "What is my name?"},
    ]
    resp = client.responses.create(model=smol.model, input=items, max_output_tokens=20, temperature=0)
    chat = chat_answer(client, smol.model, [{"role": "user", "content": "My name is Ada.\nI live in Paris."},
                                            {"role": "assistant", "content": "Hello Ada!"},
                                            {"role": "user", "content": "What is my name?"}], 20)
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_deltas_add_up_to_the_final_text(smol: Any, client: openai.OpenAI) -> None:
    body = {"model": smol.model, "input": QUESTION, "max_output_tokens": 30, "temperature": 0}
    events = raw_events(smol, body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) >= 2
    text = "".join(e["delta"] for e in deltas)
    final = checked_response(events[-1]["response"])
    whole = client.responses.create(**body)
    assert text == final.output[0].content[0].text == events[-4]["text"] == whole.output_text
    assert {e["item_id"] for e in deltas} == {final.output[0].id}
    assert final.id == events[0]["response"]["id"] and events[0]["response"]["status"] == "in_progress"
    assert final.usage.output_tokens == whole.usage.output_tokens

    with client.responses.stream(**body) as stream:  # the openai client's own stream helper
        helper_text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assert stream.get_final_response().output_text == helper_text == text
    streamed = list(client.responses.create(**body, stream=True))
    assert streamed[-1].type == "response.completed" and streamed[-1].response.output_text == text


def test_max_output_tokens_makes_an_incomplete_response(smol: Any, client: openai.OpenAI) -> None:
    resp = client.responses.create(model=smol.model, input="Tell me a long story.", max_output_tokens=3,
                                   temperature=0)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.output[0].status == "incomplete"
    assert resp.max_output_tokens == 3
    events = raw_events(smol, {"input": "Tell me a long story.", "max_output_tokens": 3, "temperature": 0})
    last = events[-1]
    assert last["type"] == "response.completed" and last["response"]["status"] == "incomplete"
    assert last["response"]["output"][0]["content"][0]["text"] == resp.output_text


def test_text_format_is_echoed_and_bad_ones_are_refused(smol: Any, client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True}
    resp = client.responses.create(model=smol.model, input=QUESTION, max_output_tokens=4, text={"format": fmt})
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "city"
    for bad in ({"type": "xml"}, {"type": "json_schema", "name": "x"}, {"type": "json_schema", "schema": {}},
                "json"):
        with smol.client() as http:
            r = http.post("/v1/responses", json={"input": "hi", "text": {"format": bad}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text", bad
    with smol.client() as http:
        r = http.post("/v1/responses", json={"input": "hi", "text": {"format": {"type": "json_object"}},
                                             "structured_outputs": {"regex": "a+"}})
    assert r.status_code == 400 and "one output constraint" in r.json()["error"]["message"]


def structured_outputs_enforced(smol: Any) -> bool:
    return any("structured" in type(f).__module__ for f in smol.engine.engine.logits_factories)


def test_json_schema_format_output_validates(smol: Any, client: openai.OpenAI) -> None:
    if not structured_outputs_enforced(smol):
        pytest.skip("no structured-outputs logits processor is registered yet (pagedllm.plugins.structured_outputs)")
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "country": {"type": "string", "maxLength": 40}},
              "required": ["city", "country"], "additionalProperties": False}
    resp = client.responses.create(model=smol.model, input="Name a city in Europe and its country, as JSON.",
                                   max_output_tokens=80, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "place", "schema": schema,
                                                    "strict": True}})
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)
    # (an open-ended "a JSON object about Paris" makes SmolLM2 nest keys until the length cut)
    obj = client.responses.create(model=smol.model, input="Give a JSON object with the keys name and age of a person.",
                                  max_output_tokens=80, temperature=0, text={"format": {"type": "json_object"}})
    assert obj.status == "completed"
    assert isinstance(json.loads(obj.output_text), dict)


@pytest.mark.parametrize("body,param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"n": 2}, "n"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input"),
    ({"input": [{"role": "tool", "content": "1"}]}, "input"),
    ({"model": "gpt-9"}, "model"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(smol: Any, body: dict[str, Any], param: str) -> None:
    with smol.client() as http:
        r = http.post("/v1/responses", json={"input": "hi", **body})
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]


def test_the_client_sees_the_refused_field_and_store_false_is_fine(smol: Any, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=smol.model, input="hi", store=True)
    assert caught.value.param == "store" and "whole conversation" in caught.value.message
    resp = client.responses.create(model=smol.model, input="hi", store=False, max_output_tokens=2,
                                   reasoning={"effort": "low"}, metadata={"k": "v"})
    assert resp.store is False and resp.metadata == {"k": "v"} and resp.reasoning.effort == "low"


def test_the_route_needs_the_api_key(server: Any) -> None:
    """The default test server (tiny model) requires a key on /v1 routes, this one included."""
    with server.client(with_key=False) as http:
        assert http.post("/v1/responses", json={"input": "hi"}).status_code == 401
    with server.client() as http:
        assert http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}).status_code == 200


def test_reasoning_parser_gives_a_reasoning_item(start_server: Any) -> None:
    """The tiny random model never writes </think>, so with deepseek_r1 all its text is reasoning."""
    with start_server(ServerSettings(reasoning_parser="deepseek_r1")) as live, live.openai() as c:
        resp = c.responses.create(model=live.model, input="Hello", max_output_tokens=6, temperature=0)
        chat = chat_answer(c, live.model, [{"role": "user", "content": "Hello"}], 6)
        events = raw_events(live, {"input": "Hello", "max_output_tokens": 6, "temperature": 0})
        with c.responses.stream(model=live.model, input="Hello", max_output_tokens=6, temperature=0) as stream:
            helped = stream.get_final_response()  # the client's helper takes a reasoning item too
    reasoning, message = resp.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == chat.choices[0].message.reasoning_content
    assert message.type == "message" and resp.output_text == ""
    assert resp.usage.output_tokens_details.reasoning_tokens == resp.usage.output_tokens == 6
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == reasoning.content[0].text
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]
    assert [i.type for i in helped.output] == ["reasoning", "message"] and helped.output[0].content == reasoning.content


class WordTokenizer:
    """Encodes each whitespace-separated word as one id (enough for counting reasoning tokens)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]


def fake_outputs(pieces: list[str], finish: str) -> list[RequestOutput]:
    """Cumulative engine outputs: piece i is token i."""
    outs, text = [], ""
    for i, piece in enumerate(pieces):
        text += piece
        done = i == len(pieces) - 1
        c = CompletionOutput(0, text, list(range(i + 1)), finish_reason=finish if done else None)
        outs.append(RequestOutput("r", None, [7, 8, 9], [c], finished=done))
    return outs


def stream_events(builder: ResponseBuilder, outputs: list[RequestOutput]) -> list[dict[str, Any]]:
    async def merged() -> AsyncIterator[tuple[int, RequestOutput]]:
        for out in outputs:
            yield 0, out

    async def run() -> list[dict[str, Any]]:
        return [e async for e in ResponseEvents(builder).events(merged())]

    return asyncio.run(run())


@pytest.mark.parametrize("finish,status", [("stop", "completed"), ("length", "incomplete")])
def test_events_with_reasoning_then_answer_parse_as_openai_events(finish: str, status: str) -> None:
    pieces = ["<think>", "Let me", " see.", "</th", "ink>", "The answer", " is 4."]
    builder = ResponseBuilder("m", {"tool_choice": "auto"}, DeepSeekR1ReasoningParser(), WordTokenizer())
    outputs = fake_outputs(pieces, finish)
    events = stream_events(builder, outputs)
    for e in events:
        EVENT_TYPES[e["type"]].model_validate(e)
    types = [e["type"] for e in events]
    assert types == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     "response.reasoning_text.delta", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    final = checked_response(events[-1]["response"])
    assert final.status == status and final.output_text == "The answer is 4."
    assert final.output[0].content[0].text == "Let me see."
    assert final.output[0].status == "completed" and final.output[1].status == status
    assert [e["output_index"] for e in events if e["type"].endswith(".delta")] == [0, 0, 1, 1]
    whole = builder.final(outputs[-1])
    assert whole["output"] == events[-1]["response"]["output"] and whole["status"] == status
    assert whole["usage"]["input_tokens"] == 3 and whole["usage"]["output_tokens"] == len(pieces)
    # The tokenizer cannot find the tag's ids among the output's: an estimate, never more than all
    assert 0 < whole["usage"]["output_tokens_details"]["reasoning_tokens"] <= len(pieces)


def test_a_failure_mid_stream_is_an_error_event_then_response_failed() -> None:
    builder = ResponseBuilder("m", {"tool_choice": "auto"}, None, WordTokenizer())

    async def failing() -> AsyncIterator[RequestOutput]:
        for out in fake_outputs(["Hello", " there"], "stop")[:1]:
            yield out
        raise ValueError("the grammar rejected every token")

    async def run() -> list[str]:
        return [frame async for frame in ResponseEvents(builder).sse([failing()])]

    frames = asyncio.run(run())
    events = [json.loads(f.split("\ndata: ", 1)[1]) for f in frames]
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["message"] == "the grammar rejected every token" and events[-2]["code"] == "invalid_value"
    failed = checked_response(events[-1]["response"])
    assert failed.status == "failed" and failed.error.message == "the grammar rejected every token"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
