"""POST /tokenize and /detokenize (vLLM's extras): let a client see exactly the token ids
the server would generate from, chat template included, without generating."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.server.chat import REFUSED_CHAT_FIELDS, parse_messages, render_chat
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import Fields, check_model, read_json
from pagedllm.server.state import state_of


async def tokenize(request: Request) -> Response:
    """A prompt, or messages rendered with the chat template, as token ids."""
    state = state_of(request)
    fields = Fields(await read_json(request, state.settings.max_request_body_bytes))
    check_model(fields, state.model_names)
    tokenizer = state.llm_engine.tokenizer
    if fields.data.get("messages") is not None:
        fields.reject_unsupported(REFUSED_CHAT_FIELDS)
        _, ids = render_chat(state, parse_messages(fields.get("messages", "any")),
                             fields.get("add_generation_prompt", "bool", True),
                             fields.get("continue_final_message", "bool", False),
                             fields.get("chat_template_kwargs", "object"))
        if fields.get("add_special_tokens", "bool", False):
            ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=True)
    else:
        prompt = fields.get("prompt", "str", required=True)
        ids = tokenizer.encode(prompt, add_special_tokens=fields.get("add_special_tokens", "bool", True))
    body: dict[str, Any] = {"count": len(ids), "max_model_len": state.llm_engine.max_model_len, "tokens": ids,
                            "token_strs": None}
    if fields.get("return_token_strs", "bool", False):
        body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(body)


async def detokenize(request: Request) -> Response:
    """Token ids back to text; 400 for ids outside the vocabulary."""
    state = state_of(request)
    fields = Fields(await read_json(request, state.settings.max_request_body_bytes))
    check_model(fields, state.model_names)
    ids = fields.get("tokens", "int_list", required=True)
    vocab = state.llm_engine.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens",
                       code="invalid_value")
    return JSONResponse({"prompt": state.llm_engine.tokenizer.decode(ids)})
