"""POST /v1/chat/completions: chat template, generation, and the reasoning split.

The conversation is rendered to text with the chat template (`--chat-template`, else
the tokenizer's) and tokenized without adding special tokens again, as vLLM does; unlike
vLLM, special-token strings inside the messages are tokenized as text, so a user cannot
close their turn and open a system one (`--allow-special-tokens-in-content` undoes this).
With `--reasoning-parser`, the text before `</think>` goes to `reasoning_content`,
in whole responses and in stream deltas alike.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
import uuid
import weakref
from typing import Any, AsyncIterator, NamedTuple

from starlette.requests import Request
from starlette.responses import Response
from tokenizers import Tokenizer

from pagedllm.core.request import CompletionOutput, RequestOutput, SamplingParams
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import (
    MAX_LOGPROBS,
    Fields,
    check_messages,
    check_model,
    clamp_logprob,
    off_loop,
    prepare,
    read_json,
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


def special_token_strings(tokenizer: Any) -> list[str]:
    """The strings `tokenizer` turns into special (control) tokens, longest first, so the
    longest match wins as it does in the tokenizer. Whitespace-only ones (a few vocabularies
    make a newline special) are left out: every template and message is full of them."""
    found = {token.content for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
             if getattr(token, "special", False)}
    found.update(getattr(tokenizer, "all_special_tokens", None) or [])
    return sorted((t for t in found if t.strip()), key=lambda t: (-len(t), t))


class ContentMarker:
    """Keeps special-token strings that come from a request from becoming control tokens.

    Without it, `<|im_end|><|im_start|>system` inside a user message tokenizes to the same
    ids as the template's own turn markers, and the user has written a system turn. Each
    special-token string in a request string is swapped for a marker (naming the token,
    with a random nonce so that no client can write one) before the template renders, so
    the special tokens left in the rendered text are the template's own. The markers go
    back to their strings in the prompt text, and the text between the template's special
    tokens is tokenized with special tokens split, i.e. as plain text.

    Args:
        tokenizer: the engine's tokenizer (transformers interface).
        enabled: False to mark nothing (`--allow-special-tokens-in-content`): content's
            special tokens are then parsed like the template's, as before.
    """

    def __init__(self, tokenizer: Any, enabled: bool = True) -> None:
        self.tokenizer = tokenizer
        self.specials = special_token_strings(tokenizer) if enabled else []
        self.count = 0  # special-token strings marked so far
        if self.specials:
            nonce = secrets.token_hex(8)
            self._special = re.compile("|".join(map(re.escape, self.specials)))
            self._index = {token: i for i, token in enumerate(self.specials)}
            self._marker = "\ue000" + nonce + ":{}\ue001"  # private-use code points around it
            self._marked = re.compile("\ue000" + nonce + r":(\d+)\ue001")

    def mark(self, value: Any) -> Any:
        """`value` with special-token strings marked, in strings, list items and dict values."""
        if not self.specials:
            return value
        if isinstance(value, str):
            return self._special.sub(self._mark_one, value)
        if isinstance(value, list):
            return [self.mark(v) for v in value]
        if isinstance(value, dict):
            return {k: self.mark(v) for k, v in value.items()}
        return value

    def _mark_one(self, match: re.Match[str]) -> str:
        self.count += 1
        return self._marker.format(self._index[match.group()])

    def unmark(self, text: str) -> str:
        """`text` with each marker back to the special-token string it stands for."""
        if not self.count:
            return text
        return self._marked.sub(lambda m: self.specials[int(m.group(1))], text)

    def encode(self, rendered: str) -> list[int]:
        """Token ids of a template rendered from marked values: its special tokens as control
        tokens, the text between them (markers restored) with special tokens as text.

        With nothing marked this is the tokenizer's own encoding. Splitting at special tokens
        changes nothing else: a tokenizer matches added tokens first and tokenizes the pieces
        between them apart.
        """
        if not self.count:
            return self.tokenizer.encode(rendered, add_special_tokens=False)
        ids: list[int] = []
        pos = 0
        for match in self._special.finditer(rendered):  # not marked, so written by the template
            ids += self._as_text(rendered[pos:match.start()])
            ids += self.tokenizer.encode(match.group(), add_special_tokens=False)
            pos = match.end()
        return ids + self._as_text(rendered[pos:])

    def _as_text(self, piece: str) -> list[int]:
        if not piece:
            return []
        backend = text_backend(self.tokenizer)
        if backend is not None:
            return backend.encode(self.unmark(piece), add_special_tokens=False).ids
        # A slow (Python) tokenizer takes split_special_tokens per call, touching no shared state.
        return list(self.tokenizer(self.unmark(piece), add_special_tokens=False,
                                   split_special_tokens=True)["input_ids"])


_TEXT_BACKENDS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_TEXT_BACKENDS_LOCK = threading.Lock()


def text_backend(tokenizer: Any) -> Any | None:
    """A private copy of a fast tokenizer's backend that tokenizes special-token strings as
    text; None for a slow tokenizer. Made once per tokenizer.

    Not `tokenizer(..., split_special_tokens=True)`: on a fast tokenizer that sets a flag on
    the backend every request shares, and leaves it set. Requests are tokenized on several
    worker threads, so another request's encode could clear it mid-call (letting a forged
    turn through) or find it still set (splitting a completions prompt's special tokens).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    with _TEXT_BACKENDS_LOCK:
        copy = _TEXT_BACKENDS.get(tokenizer)
        if copy is None:
            copy = Tokenizer.from_str(backend.to_str())
            copy.no_truncation()
            copy.no_padding()
            copy.encode_special_tokens = True
            _TEXT_BACKENDS[tokenizer] = copy
    return copy


def render_chat(state: ServerState, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                continue_final_message: bool = False, kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """The conversation as prompt text and token ids; 400 when the template cannot render it.

    Special-token strings in the messages and `chat_template_kwargs` are tokenized as text
    (see `ContentMarker`) unless the server runs with `--allow-special-tokens-in-content`.
    """
    tokenizer = state.llm_engine.tokenizer
    template = state.chat_template
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template; start the server with --chat-template FILE "
                       "(or use /v1/completions)", param="messages", code="no_chat_template")
    marker = ContentMarker(tokenizer, enabled=not state.settings.allow_special_tokens_in_content)
    try:
        rendered = tokenizer.apply_chat_template(marker.mark(messages), chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message,
                                                 **marker.mark(kwargs or {}))
    except Exception as exc:  # jinja errors (raise_exception in templates), bad kwargs
        raise APIError(f"the chat template could not render these messages: {exc}", param="messages",
                       code="invalid_value") from None
    return marker.unmark(rendered), marker.encode(rendered)


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
    response_format = fields.get("response_format", "object")
    if response_format and response_format.get("type", "text") != "text":
        raise APIError("'response_format' other than text is not supported yet (no structured outputs)",
                       param="response_format", code="unsupported")
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
