"""POST /tokenize and /detokenize (vLLM's extras): let a client see exactly the token ids
the server would generate from, chat template included, without generating.

Neither needs an API key, and both are all CPU work: everything after the body is read
(field checks, tokenizing or decoding, and rendering the JSON answer) runs on a request
worker, within the same size limits as the generating endpoints, so that no client can
stall the event loop with them.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.server.body import off_loop, read_json
from pagedllm.server.chat import REFUSED_CHAT_FIELDS, parse_messages
from pagedllm.server.chat_template import render_chat
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import (
    CHARS_PER_TOKEN,
    Fields,
    check_count,
    check_messages,
    check_model,
    check_text_len,
)
from pagedllm.server.state import ServerState, state_of
from pagedllm.server.tools import read_tools


async def tokenize(request: Request) -> Response:
    """A prompt, or messages rendered with the chat template, as token ids."""
    state = state_of(request)
    fields = Fields(await read_json(request, state.settings.max_request_body_bytes))
    return await off_loop(tokenize_fields, state, fields)


def tokenize_fields(state: ServerState, fields: Fields) -> Response:
    """The /tokenize answer to a parsed body (on a request worker)."""
    check_model(fields, state.model_names)
    tokenizer = state.llm_engine.tokenizer
    max_model_len = state.llm_engine.max_model_len
    if fields.data.get("messages") is not None:
        fields.reject_unsupported(REFUSED_CHAT_FIELDS)
        messages = fields.get("messages", "any")
        check_messages(messages, max_model_len)
        tools = read_tools(fields.data["tools"])[1] if fields.data.get("tools") else None
        fields.seen.add("tools")
        _, ids = render_chat(state, parse_messages(messages),
                             fields.get("add_generation_prompt", "bool", True),
                             fields.get("continue_final_message", "bool", False),
                             fields.get("chat_template_kwargs", "object"), tools=tools)
        if fields.get("add_special_tokens", "bool", False):
            # what the tokenizer adds around a text (Llama: BOS), added to the ids as they are:
            # re-encoding the decoded text would turn special-token strings that came from
            # message content back into control tokens
            added = tokenizer.encode("", add_special_tokens=True)
            if added and ids[:len(added)] != added:
                ids = added + ids
    else:
        prompt = fields.get("prompt", "str", required=True)
        check_text_len(len(prompt), max_model_len, "prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=fields.get("add_special_tokens", "bool", True))
    body: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                            "token_strs": None}
    if fields.get("return_token_strs", "bool", False):
        body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(body)


async def detokenize(request: Request) -> Response:
    """Token ids back to text; 400 for ids outside the vocabulary."""
    state = state_of(request)
    fields = Fields(await read_json(request, state.settings.max_request_body_bytes))
    return await off_loop(detokenize_fields, state, fields)


def detokenize_fields(state: ServerState, fields: Fields) -> Response:
    """The /detokenize answer to a parsed body (on a request worker); at most as many ids as
    the longest text /tokenize accepts could give."""
    check_model(fields, state.model_names)
    check_count(fields.data.get("tokens"), CHARS_PER_TOKEN * state.llm_engine.max_model_len, "tokens", "token ids")
    ids = fields.get("tokens", "int_list", required=True)
    vocab = state.llm_engine.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens",
                       code="invalid_value")
    return JSONResponse({"prompt": state.llm_engine.tokenizer.decode(ids)})
