"""POST /v1/responses: OpenAI's Responses API over the chat pipeline, without state.

The `input` (a string, or message items) becomes chat messages, `instructions` a system
message before them; from there on it is /v1/chat/completions: the same template, the
same sampling fields (vLLM's extras included), the same engine streams. `text.format`
constrains the output like chat's `response_format`. What needs a store of past
responses (`store: true`, `previous_response_id`, `conversation`, `background`) and what
is not built (tools, logprobs) is a 400 naming the field.

The answer has a `reasoning` output item when a reasoning parser split some text off,
then one `message` item. A stream sends OpenAI's typed events (`event:` and `data:` lines,
each with a `sequence_number`) and ends, as vLLM's does, with `response.completed`
carrying the whole response, whose `status` tells whether it is complete (`incomplete`
when `max_output_tokens` cut it). OpenAI sends `response.incomplete` then; the openai
client's stream helper only finishes on `response.completed`.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, NamedTuple

from starlette.requests import Request
from starlette.responses import Response

from pagedllm.core.request import CompletionOutput, RequestOutput, SamplingParams, StructuredOutputsParams
from pagedllm.server.body import off_loop, read_json
from pagedllm.server.chat import parse_messages
from pagedllm.server.chat_template import render_chat
from pagedllm.server.errors import APIError, from_engine_error
from pagedllm.server.protocol import Fields, check_messages, check_model, check_text_len, prepare, sampling_fields
from pagedllm.server.reasoning import ReasoningDelta, ReasoningParser
from pagedllm.server.state import ServerState, state_of
from pagedllm.server.streaming import SSEResponse, event_json, generate_all, merge, respond

INPUT_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")  # an assistant turn given back carries output_text parts
NO_STORE = "this server keeps no responses; send the whole conversation in 'input'"
REFUSED_FIELDS = {
    "store": NO_STORE,
    "previous_response_id": NO_STORE,
    "conversation": NO_STORE,
    "background": "background responses need a response store; this server keeps none",
    "tools": "tool calling is not built for /v1/responses",
    "prompt": "stored prompt templates are not supported; send the text in 'input'",
    "top_logprobs": "logprobs are not built for /v1/responses; /v1/chat/completions has them",
    "include": "no extra output (logprobs, encrypted reasoning) is built for /v1/responses",
    "response_format": "this is a chat field; /v1/responses takes 'text': {\"format\": {...}}",
}
IGNORED_FIELDS = ("user", "safety_identifier", "prompt_cache_key", "service_tier", "parallel_tool_calls",
                  "max_tool_calls", "stream_options")
FORMATS = ("text", "json_object", "json_schema")


class ResponsesRequest(NamedTuple):
    """A checked /v1/responses request, its conversation rendered and tokenized."""

    model: str
    text: str
    ids: list[int]
    params: list[SamplingParams]
    stream: bool
    echo: dict[str, Any]  # request fields the response object repeats


def item_text(content: Any, where: str) -> str:
    """A message item's content as text: a string, or input_text / output_text parts joined
    with newlines (as chat joins its text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for piece in content:
            if not isinstance(piece, dict) or piece.get("type") not in TEXT_PARTS \
                    or not isinstance(piece.get("text"), str):
                kind = piece.get("type") if isinstance(piece, dict) else type(piece).__name__
                raise APIError(f"'{where}.content' parts must be {{\"type\": \"input_text\", \"text\": ...}}; got a "
                               f"{kind!r} part (only text is supported)", param="input", code="invalid_value")
            texts.append(piece["text"])
        return "\n".join(texts)
    raise APIError(f"'{where}.content' must be a string or an array of input_text parts", param="input",
                   code="invalid_type")


def input_messages(value: Any, instructions: str | None) -> list[dict[str, Any]]:
    """`instructions` and `input` -> chat messages (checked by chat's `parse_messages`)."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(value, str):
        return messages + [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise APIError("'input' must be a string or a non-empty array of message items", param="input",
                       code="invalid_type")
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"'{where}' must be an object", param="input", code="invalid_type")
        kind = item.get("type", "message")
        if kind != "message":
            raise APIError(f"'{where}' is a {kind!r} item; only message items are supported (no tool calls, "
                           "no reasoning items)", param="input", code="unsupported")
        role = item.get("role")
        if role not in INPUT_ROLES:
            raise APIError(f"'{where}.role' must be one of {', '.join(INPUT_ROLES)}, got {role!r}", param="input",
                           code="invalid_value")
        messages.append({"role": role, "content": item_text(item.get("content"), where)})
    return parse_messages(messages)


def text_format(fields: Fields) -> tuple[StructuredOutputsParams | None, dict[str, Any]]:
    """`text.format` -> the output constraint, and the `text` object the response repeats."""
    text = fields.get("text", "object") or {}
    fmt = text.get("format", {"type": "text"})
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in FORMATS:
        raise APIError(f"'text.format.type' must be one of {', '.join(FORMATS)}, got {json.dumps(kind)}",
                       param="text", code="invalid_value")
    echo = {**text, "format": fmt}
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True), echo
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict) or not isinstance(fmt.get("name"), str):
            raise APIError("'text.format' of type json_schema needs 'name' (a string) and 'schema' (an object)",
                           param="text", code="invalid_value")
        return StructuredOutputsParams(json=fmt["schema"]), echo
    return None, echo


def choice_field(fields: Fields, name: str, allowed: tuple[str, ...], why: str) -> str | None:
    """A field of which only the values in `allowed` can be honoured (any other is a 400)."""
    fields.seen.add(name)
    value = fields.data.get(name)
    if value is not None and value not in allowed:
        raise APIError(f"'{name}' {json.dumps(value)[:80]} is not supported: {why}; accepted: "
                       f"{', '.join(allowed)}", param=name, code="unsupported")
    return value


def read_responses_request(state: ServerState, fields: Fields) -> ResponsesRequest:
    """Check every field, then render and tokenize the conversation (on a request worker)."""
    model = check_model(fields, state.model_names)
    max_len = state.llm_engine.max_model_len
    raw_input = fields.get("input", "any", required=True)
    instructions = fields.get("instructions", "str")
    if isinstance(raw_input, list):
        check_messages(raw_input, max_len)
    check_text_len(len(instructions or "") + (len(raw_input) if isinstance(raw_input, str) else 0), max_len, "input")
    fields.reject_unsupported(REFUSED_FIELDS)
    tool_choice = choice_field(fields, "tool_choice", ("auto", "none"), "tool calling is not built")
    truncation = choice_field(fields, "truncation", ("disabled",), "inputs are never truncated")
    reasoning = fields.get("reasoning", "object")
    metadata = fields.get("metadata", "object")
    stream = fields.get("stream", "bool", False)
    max_tokens = fields.get("max_output_tokens", "int")
    structured, text_echo = text_format(fields)
    values = sampling_fields(fields)
    if values["n"] != 1:
        raise APIError("'n' must be 1: a response has one output", param="n", code="invalid_value")
    if structured is not None:
        if values["structured_outputs"] is not None:
            raise APIError(f"give one output constraint; got text.format and "
                           f"{values['_param_names']['structured_outputs']}", param="text", code="invalid_value")
        values.update(structured_outputs=structured,
                      _param_names={**values["_param_names"], "structured_outputs": "text"})
    fields.seen.update(IGNORED_FIELDS)
    fields.log_unknown("/v1/responses")
    messages = input_messages(raw_input, instructions)
    try:
        text, ids = render_chat(state, messages)
    except APIError as exc:
        exc.param = "input" if exc.param == "messages" else exc.param
        raise
    params = prepare(state.llm_engine, [(text, ids)], values, max_tokens, "max_output_tokens", "input")
    echo = {"instructions": instructions, "max_output_tokens": max_tokens, "temperature": values["temperature"],
            "top_p": values["top_p"], "text": text_echo, "reasoning": reasoning, "metadata": metadata or {},
            "tool_choice": tool_choice or "auto", "truncation": truncation or "disabled"}
    return ResponsesRequest(model, text, ids, params, stream, echo)


async def create_response(request: Request) -> Response:
    """One conversation, one output; whole or streamed as typed events (see `ResponseEvents`)."""
    state = state_of(request)
    fields = Fields(await read_json(request, state.settings.max_request_body_bytes))
    req = await off_loop(read_responses_request, state, fields)
    tokenizer = state.llm_engine.tokenizer
    reasoning = state.reasoning(tokenizer) if state.reasoning is not None else None  # one output: one parser
    builder = ResponseBuilder(req.model, req.echo, reasoning, tokenizer)
    streams = generate_all(state.engine, state.metrics, builder.id, [(req.text, req.ids)], req.params)
    if req.stream:
        return SSEResponse(ResponseEvents(builder).sse(streams), stall_timeout=state.settings.stream_stall_timeout)
    # respond's own stream framing is chat's (data lines, [DONE]): a stream is framed above.
    return await respond(request, streams, False, chunks=ResponseEvents(builder).events,
                         answer=lambda finals: builder.final(finals[0]))


class ResponseBuilder:
    """The response object and its output items, for one request (ids fixed at creation)."""

    def __init__(self, model: str, echo: dict[str, Any], reasoning: ReasoningParser | None,
                 tokenizer: Any) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_ids = {"reasoning": f"rs_{uuid.uuid4().hex}", "message": f"msg_{uuid.uuid4().hex}"}
        self.created_at = int(time.time())
        self.model = model
        self.echo = echo
        self.reasoning = reasoning
        self.tokenizer = tokenizer

    def envelope(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object in a given state."""
        return {"id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
                "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "output": output, "usage": usage, "parallel_tool_calls": False, "tools": [], "store": False,
                "background": False, "previous_response_id": None, **self.echo}

    def item(self, kind: str, text: str | None, status: str) -> dict[str, Any]:
        """A `message` or `reasoning` output item; `text` None leaves its content empty (just added)."""
        head = {"type": kind, "id": self.item_ids[kind], "status": status}
        parts = [] if text is None else [part(kind, text)]
        if kind == "message":
            return {**head, "role": "assistant", "content": parts}
        return {**head, "summary": [], "content": parts}

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a finished output."""
        return self.reasoning.split(text, finished=True) if self.reasoning is not None else ("", text)

    def usage(self, final: RequestOutput, reasoning: str) -> dict[str, Any]:
        c = final.outputs[0]
        inputs, outputs = len(final.prompt_token_ids), len(c.token_ids)
        return {"input_tokens": inputs, "output_tokens": outputs, "total_tokens": inputs + outputs,
                # cache_write_tokens: OpenAI bills explicit prompt-cache writes; there are none here
                "input_tokens_details": {"cached_tokens": final.num_cached_tokens, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(c, reasoning)}}

    def reasoning_tokens(self, c: CompletionOutput, reasoning: str) -> int:
        """The output tokens up to the end of the reasoning: up to the end tag's tokens where
        the model generated them, else all of them (no end tag), else an estimate."""
        if not reasoning or self.reasoning is None:
            return 0
        end = self.reasoning.end_tag
        if not end or end not in c.text:
            return len(c.token_ids)
        tag = list(self.tokenizer.encode(end, add_special_tokens=False))
        ids = c.token_ids
        for start in range(len(ids) - len(tag) + 1):
            if ids[start:start + len(tag)] == tag:
                return start + len(tag)
        return min(len(ids), len(self.tokenizer.encode(reasoning, add_special_tokens=False)))

    def final(self, final: RequestOutput) -> dict[str, Any]:
        """The whole response of a finished request."""
        c = final.outputs[0]
        reasoning, content = self.split(c.text)
        status = finish_status(c.finish_reason)
        item_status = "completed" if status == "completed" else "incomplete"
        # As when streamed: the reasoning item is complete once the answer has begun.
        output = ([self.item("reasoning", reasoning, "completed" if content else item_status)] if reasoning
                  else []) + [self.item("message", content, item_status)]
        return self.envelope(status, output, self.usage(final, reasoning))


def part(kind: str, text: str) -> dict[str, Any]:
    """The content part of an item of `kind`."""
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "reasoning_text", "text": text}


def finish_status(finish_reason: str | None) -> str:
    """A response's status from how its sequence ended."""
    return {"stop": "completed", "length": "incomplete"}.get(finish_reason or "", "cancelled")


DELTA_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


class ResponseEvents:
    """The typed events of one streamed response, numbered as they are made.

    Items are opened when their first text arrives (the reasoning item first, when a
    parser splits some off) and closed when the next one opens or the request ends;
    the message item is always sent, empty if nothing came."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder = builder
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # items closed so far
        self.open_kind: str | None = None
        self.open_text = ""

    def event(self, kind: str, **body: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **body}
        self.sequence += 1
        return event

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.builder.item_ids[self.open_kind or ""], "output_index": len(self.output),
                "content_index": 0}

    def open(self, kind: str) -> list[dict[str, Any]]:
        self.open_kind, self.open_text = kind, ""
        where = self._where()
        return [self.event("response.output_item.added", output_index=where["output_index"],
                           item=self.builder.item(kind, None, "in_progress")),
                self.event("response.content_part.added", **where, part=part(kind, ""))]

    def delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = [] if self.open_kind == kind else self.close("completed") + self.open(kind)
        self.open_text += text
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self.event(f"{DELTA_EVENTS[kind]}.delta", **self._where(), delta=text, **extra)]

    def close(self, status: str) -> list[dict[str, Any]]:
        if self.open_kind is None:
            return []
        kind, text, where = self.open_kind, self.open_text, self._where()
        extra = {"logprobs": []} if kind == "message" else {}
        item = self.builder.item(kind, text, status)
        events = [self.event(f"{DELTA_EVENTS[kind]}.done", **where, text=text, **extra),
                  self.event("response.content_part.done", **where, part=part(kind, text)),
                  self.event("response.output_item.done", output_index=where["output_index"], item=item)]
        self.output.append(item)
        self.open_kind = None
        return events

    async def events(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict[str, Any]]:
        """Every event of the response, from the engine outputs of its one sequence."""
        b = self.builder
        yield self.event("response.created", response=b.envelope("in_progress", []))
        yield self.event("response.in_progress", response=b.envelope("in_progress", []))
        splitter = ReasoningDelta(b.reasoning) if b.reasoning is not None else None
        sent = 0
        final: RequestOutput | None = None
        async for _, out in outputs:
            final = out
            c = out.outputs[0]
            finished = c.finish_reason is not None
            if splitter is not None:
                reasoning, content = splitter.update(c.text, finished)
            else:
                reasoning, content, sent = "", c.text[sent:], len(c.text)
            for kind, text in (("reasoning", reasoning), ("message", content)):
                if text:
                    for event in self.delta(kind, text):
                        yield event
        if final is None:
            return
        status = finish_status(final.outputs[0].finish_reason)
        item_status = "completed" if status == "completed" else "incomplete"
        if self.open_kind != "message":
            for event in self.close(item_status) + self.open("message"):
                yield event
        for event in self.close(item_status):
            yield event
        reasoning = next((i["content"][0]["text"] for i in self.output if i["type"] == "reasoning"), "")
        yield self.event("response.completed", response=b.envelope(status, self.output, b.usage(final, reasoning)))

    async def sse(self, streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        """The events framed as SSE (`event:` names the type). A failure after the 200 went out
        is an `error` event, then `response.failed` with what had been generated."""
        try:
            async with aclosing(merge(streams)) as merged, aclosing(self.events(merged)) as events:
                async for event in events:
                    yield frame(event)
        except Exception as exc:
            err = from_engine_error(exc)
            yield frame(self.event("error", code=err.code, message=err.message, param=err.param))
            error = {"code": "server_error" if err.status_code >= 500 else "invalid_prompt", "message": err.message}
            yield frame(self.event("response.failed", response=self.builder.envelope("failed", self.output,
                                                                                       error=error)))


def frame(event: dict[str, Any]) -> str:
    """One server-sent event, named by its type as OpenAI's are."""
    return f"event: {event['type']}\ndata: {event_json(event)}\n\n"
