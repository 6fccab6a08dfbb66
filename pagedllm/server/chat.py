"""POST /v1/chat/completions: chat template, generation, and the reasoning split.

The conversation is rendered to text with the chat template (`--chat-template`, else
the tokenizer's) and tokenized without adding special tokens again, as vLLM does; unlike
vLLM, special-token strings inside the messages are tokenized as text, so a user cannot
close their turn and open a system one (`--allow-special-tokens-in-content` undoes this).
With `--reasoning-parser`, the text before `</think>` goes to `reasoning_content`,
in whole responses and in stream deltas alike.
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
    sampling_fields,
    stream_options,
    top_entries,
    usage,
)
from pagedllm.server.reasoning import ReasoningDelta
from pagedllm.server.state import ServerState, state_of
from pagedllm.server.streaming import generate_all, respond

ROLES = ("system", "developer", "user", "assistant", "tool")
REFUSED_CHAT_FIELDS = {
    "tools": "tool calling is not built", "tool_choice": "tool calling is not built",
    "functions": "tool calling is not built",
    # A template is code: one from a request could loop long enough to stall every stream.
    "chat_template": "the server's template is used; set it at start-up with --chat-template",
}


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """OpenAI messages -> the plain {"role", "content": str} dicts a chat template expects.

    Text content parts are joined with newlines (vLLM's choice); other part types
    (images, audio) are rejected since no multimodal model is supported.
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


def read_chat_request(state: ServerState, fields: Fields) -> ChatRequest:
    """Check every field, then render and tokenize the conversation: CPU work, run on a
    request worker (`off_loop`). The cheap checks come first, so a request refused for a
    field costs no rendering."""
    model = check_model(fields, state.model_names)
    raw_messages = fields.get("messages", "any", required=True)
    check_messages(raw_messages, state.llm_engine.max_model_len)
    messages = parse_messages(raw_messages)
    fields.reject_unsupported(REFUSED_CHAT_FIELDS)
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
    fields.log_unknown("/v1/chat/completions")
    text, ids = render_chat(state, messages, add_generation_prompt, continue_final, template_kwargs)
    params = prepare(state.llm_engine, [(text, ids)], values, max_tokens, field, "messages")
    return ChatRequest(model, text, ids, params, k, stream, include_usage)


async def create_chat_completion(request: Request) -> Response:
    """One conversation, `n` choices; whole or streamed (see `_chunks`)."""
    state = state_of(request)
    fields = Fields(await read_json(request, state.settings.max_request_body_bytes))
    model, text, ids, params, k, stream, include_usage = await off_loop(read_chat_request, state, fields)

    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = generate_all(state.engine, state.metrics, request_id, [(text, ids)], params)
    head = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model}
    chunk_head = {**head, "object": "chat.completion.chunk"}
    return await respond(request, streams, stream,
                         chunks=lambda outputs: _chunks(state, outputs, chunk_head, params[0].n, k, include_usage),
                         answer=lambda finals: _answer(state, finals, head, k))


def _answer(state: ServerState, finals: list[RequestOutput], head: dict[str, Any], k: int | None) -> dict[str, Any]:
    """The whole chat.completion object, reasoning split off when a parser is set."""
    choices = []
    for c in finals[0].outputs:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if state.reasoning is not None:
            reasoning, content = state.reasoning.split(c.text, finished=True)
            message.update(content=content or None, reasoning_content=reasoning or None)
        choices.append({"index": c.index, "message": message,
                        "logprobs": None if k is None else chat_logprobs(c, 0, k),
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {**head, "choices": choices, "usage": usage(finals)}


async def _chunks(state: ServerState, outputs: AsyncIterator[tuple[int, RequestOutput]], head: dict[str, Any],
                  n: int, k: int | None, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    """Stream chunks: a role chunk per choice, content (and reasoning) deltas, finish, usage."""
    extra = {"usage": None} if include_usage else {}
    for index in range(n):
        yield {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}], **extra}
    sent_text = [0] * n
    sent_tokens = [0] * n
    done = [False] * n
    splitters = [ReasoningDelta(state.reasoning) for _ in range(n)] if state.reasoning is not None else None
    final: RequestOutput | None = None
    async for _, out in outputs:
        final = out
        for c in out.outputs:
            i = c.index
            if done[i]:
                continue
            finished = c.finish_reason is not None
            delta: dict[str, Any] = {}
            if splitters is not None:
                reasoning, content = splitters[i].update(c.text, finished)
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if content:
                    delta["content"] = content
            elif len(c.text) > sent_text[i]:
                delta["content"] = c.text[sent_text[i]:]
            new_tokens = len(c.token_ids) > sent_tokens[i]
            if not delta and not finished and not (k is not None and new_tokens):
                continue
            logprobs = chat_logprobs(c, sent_tokens[i], k) if k is not None else None
            sent_text[i], sent_tokens[i], done[i] = len(c.text), len(c.token_ids), finished
            yield {**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}], **extra}
    if include_usage and final is not None:
        yield {**head, "choices": [], "usage": usage([final])}
