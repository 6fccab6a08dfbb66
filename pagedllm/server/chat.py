"""POST /v1/chat/completions: chat template, generation, and the reasoning split.

The conversation is rendered to text with the chat template (`--chat-template`, else
the tokenizer's) and tokenized without adding special tokens again, as vLLM does; unlike
vLLM, special-token strings inside the messages are tokenized as text, so a user cannot
close their turn and open a system one (`--allow-special-tokens-in-content` undoes this).
With `--reasoning-parser`, the reasoning the parser splits off (e.g. the text before
`</think>`; one parser per choice) goes to `reasoning_content` (and `reasoning`, vLLM's
newer name), in whole responses and in stream deltas alike. Tool
calling (`tools`, `tool_choice`) is `tools.py`'s: here its calls become
`message.tool_calls` and stream deltas, read from the content part of the answer.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, NamedTuple

from starlette.requests import Request
from starlette.responses import Response

from pagedllm.core.request import CompletionOutput, RequestOutput, SamplingParams
from pagedllm.server.body import off_loop, read_json
from pagedllm.server.chat_template import render_chat
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import (
    MAX_LOGPROBS,
    Fields,
    check_messages,
    check_model,
    clamp_logprob,
    prepare,
    prompt_logprobs_json,
    sampling_fields,
    stream_options,
    top_entries,
    usage,
)
from pagedllm.server.reasoning import ReasoningParser
from pagedllm.server.state import ServerState, state_of
from pagedllm.server.streaming import generate_all, respond
from pagedllm.server.tools import ToolRequest, ToolStream, message_tool_calls, read_tool_request

ROLES = ("system", "developer", "user", "assistant", "tool")
REFUSED_CHAT_FIELDS = {
    "functions": "the deprecated functions API; send 'tools' (and 'tool_choice')",
    "function_call": "the deprecated functions API; send 'tool_choice' with 'tools'",
    # A template is code: one from a request could loop long enough to stall every stream.
    "chat_template": "the server's template is used; set it at start-up with --chat-template",
}


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """OpenAI messages -> the {"role", "content": str, ...} dicts a chat template expects.

    Text content parts are joined with newlines (vLLM's choice); other part types
    (images, audio) are rejected since no multimodal model is supported. An assistant
    message may carry `tool_calls` (its content then may be null), passed on with their
    arguments as objects, which templates need, and `reasoning_content` / `reasoning`
    (as `reasoning_content`); a tool message needs the `tool_call_id` it answers.
    """
    if not isinstance(value, list) or not value:
        raise APIError("'messages' must be a non-empty array of messages", param="messages", code="invalid_type")
    messages = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise APIError(f"'{where}' must be an object", param="messages", code="invalid_type")
        role = msg.get("role")
        if role not in ROLES:
            raise APIError(f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}", param="messages",
                           code="invalid_value")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise APIError(f"'{where}.content' parts must be {{\"type\": \"text\", \"text\": ...}}; "
                                   f"got a {kind!r} part (only text is supported)", param="messages",
                                   code="invalid_value")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise APIError(f"'{where}.content' must be a string or an array of text parts", param="messages",
                           code="invalid_type")
        entry = {"role": role, "content": content}
        if isinstance(msg.get("name"), str):
            entry["name"] = msg["name"]
        if role == "assistant":
            if msg.get("tool_calls") not in (None, []):
                entry["tool_calls"] = message_tool_calls(msg["tool_calls"], where)
            reasoning = msg.get("reasoning_content", msg.get("reasoning"))
            if isinstance(reasoning, str):
                entry["reasoning_content"] = reasoning
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise APIError(f"'{where}.tool_call_id' must be the id of the tool call this message answers",
                               param="messages", code="invalid_value")
            entry["tool_call_id"] = call_id
        messages.append(entry)
    return messages


def chat_logprobs(out: CompletionOutput, start: int, k: int) -> dict[str, Any]:
    """OpenAI's chat logprobs object for `out`'s tokens from index `start` on."""
    def entry(text: str | None, logprob: float) -> dict[str, Any]:
        text = text or ""
        return {"token": text, "logprob": clamp_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, record in zip(out.token_ids[start:], (out.logprobs or [])[start:]):
        chosen = record[token_id]
        content.append({**entry(chosen.decoded_token, chosen.logprob),
                        "top_logprobs": [entry(lp.decoded_token, lp.logprob) for _, lp in top_entries(record, k)]})
    return {"content": content}


class ChatRequest(NamedTuple):
    """A checked /v1/chat/completions request, its conversation rendered and tokenized."""

    model: str
    text: str
    ids: list[int]
    params: list[SamplingParams]
    k: int | None  # how many alternatives per token, if logprobs were asked for
    stream: bool
    include_usage: bool
    tools: ToolRequest | None  # the request's tools, if it gave any


def read_chat_request(state: ServerState, fields: Fields) -> ChatRequest:
    """Check every field, then render and tokenize the conversation: CPU work, run on a
    request worker (`off_loop`). The cheap checks come first, so a request refused for a
    field costs no rendering."""
    model = check_model(fields, state.model_names)
    raw_messages = fields.get("messages", "any", required=True)
    check_messages(raw_messages, state.llm_engine.max_model_len)
    messages = parse_messages(raw_messages)
    fields.reject_unsupported(REFUSED_CHAT_FIELDS)
    settings = state.settings
    tools = read_tool_request(fields, state.tool_parser, settings.enable_auto_tool_choice,
                              settings.exclude_tools_when_tool_choice_none)
    add_generation_prompt = fields.get("add_generation_prompt", "bool", True)
    continue_final = fields.get("continue_final_message", "bool", False)
    if add_generation_prompt and continue_final:
        raise APIError("'continue_final_message' needs 'add_generation_prompt': false", param="continue_final_message",
                       code="invalid_value")
    template_kwargs = fields.get("chat_template_kwargs", "object")
    want_logprobs = fields.get("logprobs", "bool", False)
    top = fields.int_in("top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
    stream = fields.get("stream", "bool", False)
    include_usage = stream_options(fields, stream)
    field = "max_completion_tokens" if fields.data.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = fields.get(field, "int")
    fields.seen.update(("max_tokens", "max_completion_tokens", "user"))
    k = (top or 0) if want_logprobs else None  # how many alternatives per token, if any
    values = {**sampling_fields(fields), "logprobs": k}
    if tools is not None:
        values = tools.apply(values, has_structured_outputs=bool(state.llm_engine.logits_factories))
    fields.log_unknown("/v1/chat/completions")
    text, ids = render_chat(state, messages, add_generation_prompt, continue_final, template_kwargs,
                            tools=tools.template_tools if tools is not None else None)
    params = prepare(state.llm_engine, [(text, ids)], values, max_tokens, field, "messages")
    return ChatRequest(model, text, ids, params, k, stream, include_usage, tools)


async def create_chat_completion(request: Request) -> Response:
    """One conversation, `n` choices; whole or streamed (see `_chunks`)."""
    state = state_of(request)
    fields = Fields(await read_json(request, state.settings.max_request_body_bytes))
    chat = await off_loop(read_chat_request, state, fields)
    params, k = chat.params, chat.k

    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = generate_all(state.engine, state.metrics, request_id, [(chat.text, chat.ids)], params)
    head = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": chat.model}
    chunk_head = {**head, "object": "chat.completion.chunk"}
    return await respond(request, streams, chat.stream,
                         chunks=lambda outputs: _chunks(state, outputs, chunk_head, params[0].n, k,
                                                        chat.include_usage, chat.tools),
                         answer=lambda finals: _answer(state, finals, head, k, chat.tools))


class ChoiceText:
    """One choice's answer as it grows: the reasoning split off (with a reasoning parser),
    then the tool calls read from the content (with tools), and what is new of each."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolStream | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.sent_reasoning = 0
        self.sent_content = 0
        self.any_calls = False

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far."""
        if self.reasoning is None:
            return "", text
        return self.reasoning.split(text, finished)

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The stream deltas for what `text` adds: reasoning and content first, then one
        delta per tool-call item (a call's header, then its argument fragments)."""
        reasoning, content = self.split(text, finished)
        delta: dict[str, Any] = {}
        if len(reasoning) > self.sent_reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning[self.sent_reasoning:]
            self.sent_reasoning = len(reasoning)
        items: list[dict[str, Any]] = []
        if self.tools is not None:
            new_content, items = self.tools.update(content, finished)
        else:
            new_content = content[self.sent_content:]
            self.sent_content = max(self.sent_content, len(content))
        if new_content:
            delta["content"] = new_content
        self.any_calls = self.any_calls or bool(items)
        return ([delta] if delta else []) + [{"tool_calls": [item]} for item in items]

    def finish_reason(self, reason: str | None) -> str | None:
        return self.tools.finish_reason(reason, self.any_calls) if self.tools is not None else reason

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole answer's message and finish_reason."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reasoning, content = self.split(text, finished=True)
        if self.reasoning is not None:
            message.update(content=content or None, reasoning_content=reasoning or None, reasoning=reasoning or None)
        if self.tools is not None:
            message["content"], calls = self.tools.message(content)
            if calls:
                message["tool_calls"] = calls
                self.any_calls = True
        return message, self.finish_reason(reason)


def _choice_text(state: ServerState, tools: ToolRequest | None) -> ChoiceText:
    tokenizer = state.llm_engine.tokenizer
    reasoning = state.reasoning(tokenizer) if state.reasoning is not None else None
    return ChoiceText(reasoning, tools.stream(tokenizer) if tools is not None else None)


def _answer(state: ServerState, finals: list[RequestOutput], head: dict[str, Any], k: int | None,
            tools: ToolRequest | None) -> dict[str, Any]:
    """The whole chat.completion object: reasoning split off and tool calls read when set."""
    choices = []
    for c in finals[0].outputs:
        message, finish_reason = _choice_text(state, tools).message(c.text, c.finish_reason)
        choices.append({"index": c.index, "message": message,
                        "logprobs": None if k is None else chat_logprobs(c, 0, k),
                        "finish_reason": finish_reason, "stop_reason": c.stop_reason})
    extra = {"prompt_logprobs": prompt_logprobs_json(finals[0])} if finals[0].prompt_logprobs is not None else {}
    return {**head, "choices": choices, "usage": usage(finals), **extra}


async def _chunks(state: ServerState, outputs: AsyncIterator[tuple[int, RequestOutput]], head: dict[str, Any],
                  n: int, k: int | None, include_usage: bool,
                  tools: ToolRequest | None) -> AsyncIterator[dict[str, Any]]:
    """Stream chunks: a role chunk per choice, content, reasoning and tool-call deltas,
    finish, usage. Logprobs ride on the first chunk of an output, finish_reason on its last."""
    extra = {"usage": None} if include_usage else {}
    for index in range(n):
        yield {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}], **extra}
    sent_tokens = [0] * n
    done = [False] * n
    texts = [_choice_text(state, tools) for _ in range(n)]
    final: RequestOutput | None = None
    async for _, out in outputs:
        final = out
        for c in out.outputs:
            i = c.index
            if done[i]:
                continue
            finished = c.finish_reason is not None
            deltas = texts[i].deltas(c.text, finished)
            new_tokens = len(c.token_ids) > sent_tokens[i]
            if not deltas and not finished and not (k is not None and new_tokens):
                continue
            logprobs = chat_logprobs(c, sent_tokens[i], k) if k is not None else None
            sent_tokens[i], done[i] = len(c.token_ids), finished
            deltas = deltas or [{}]
            for j, delta in enumerate(deltas):
                last = j == len(deltas) - 1
                yield {**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs if j == 0 else None,
                                            "finish_reason": texts[i].finish_reason(c.finish_reason) if last
                                            else None,
                                            "stop_reason": c.stop_reason if last else None}], **extra}
    if include_usage and final is not None:
        yield {**head, "choices": [], "usage": usage([final])}
