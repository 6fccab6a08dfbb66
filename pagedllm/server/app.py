"""The OpenAI-compatible Starlette app: settings, routes table, middleware.

`build_app(engine, settings)` wires an already running `AsyncLLMEngine` to the
routes; it owns no engine, so tests can build several apps over one engine and the
CLI decides the engine's lifetime. `ServerSettings` fields carry the same metadata as
the engine's config dataclasses, so `pagedllm serve --help` is generated from both.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import pagedllm
from pagedllm.core.config import opt
from pagedllm.core.engine import AsyncLLMEngine, LLMEngine
from pagedllm.server.auth import APIKeyMiddleware
from pagedllm.server.chat import REFUSED_CHAT_FIELDS, create_chat_completion, parse_messages, render_chat
from pagedllm.server.completions import create_completion
from pagedllm.server.errors import EXCEPTION_HANDLERS, APIError, handle_errors
from pagedllm.server.metrics import CONTENT_TYPE, ServerMetrics
from pagedllm.server.protocol import Fields, check_model, read_json
from pagedllm.server.reasoning import REASONING_PARSERS, DeepSeekR1ReasoningParser, get_reasoning_parser

logger = logging.getLogger("pagedllm.server")


@dataclass
class ServerSettings:
    """The HTTP server's options (the engine's are in `EngineConfig`)."""

    host: str = opt("127.0.0.1", "Address to listen on; 0.0.0.0 for every interface (vLLM's "
                    "choice when no host is given).", "server")
    port: int = opt(8000, "Port to listen on.", "server")
    api_key: str | None = opt(None, "Require 'Authorization: Bearer KEY' on /v1 routes "
                              "(default: env PAGEDLLM_API_KEY or VLLM_API_KEY; none).", "server")
    chat_template: str | None = opt(None, "Chat template: a file path or an inline Jinja string "
                                    "(default: the tokenizer's).", "server")
    reasoning_parser: str | None = opt(None, "Split <think>…</think> into reasoning_content "
                                       "(default: off).", "server", choices=sorted(REASONING_PARSERS))
    enable_reasoning: bool = opt(False, "Deprecated vLLM spelling: --reasoning-parser alone enables "
                                 "reasoning.", "server")
    max_request_body_bytes: int = opt(16 << 20, "Largest request body accepted (413 beyond).", "server")
    uvicorn_log_level: str = opt("info", "Log level of uvicorn's access and error logs.", "server",
                                 choices=["critical", "error", "warning", "info", "debug", "trace"])


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: the contents of a file, or the value itself if it is inline Jinja."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither an existing file nor an inline Jinja template")


@dataclass
class ServerState:
    """What every handler needs, stored on `app.state.pagedllm`."""

    engine: AsyncLLMEngine
    settings: ServerSettings
    model_names: list[str]
    metrics: ServerMetrics
    chat_template: str | None
    reasoning: DeepSeekR1ReasoningParser | None
    created: int

    @property
    def core(self) -> LLMEngine:
        """The synchronous LLMEngine (tokenizer, limits, stats); read-only from handlers."""
        return self.engine.engine


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.pagedllm
    if not state.engine.is_alive:
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    return Response(status_code=200)


async def version(request: Request) -> Response:
    return JSONResponse({"version": pagedllm.__version__})


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.pagedllm
    return JSONResponse({"object": "list", "data": [
        {"id": name, "object": "model", "created": state.created, "owned_by": "pagedllm",
         "root": state.core.model_path, "parent": None, "max_model_len": state.core.max_model_len,
         "permission": []} for name in state.model_names]})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.pagedllm
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@handle_errors
async def tokenize(request: Request) -> Response:
    """vLLM's /tokenize: a prompt, or messages rendered with the chat template."""
    state: ServerState = request.app.state.pagedllm
    fields = Fields(await read_json(request, state.settings.max_request_body_bytes))
    check_model(fields, state.model_names)
    tokenizer = state.core.tokenizer
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
    body: dict[str, Any] = {"count": len(ids), "max_model_len": state.core.max_model_len, "tokens": ids,
                            "token_strs": None}
    if fields.get("return_token_strs", "bool", False):
        body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(body)


@handle_errors
async def detokenize(request: Request) -> Response:
    state: ServerState = request.app.state.pagedllm
    fields = Fields(await read_json(request, state.settings.max_request_body_bytes))
    check_model(fields, state.model_names)
    ids = fields.get("tokens", "int_list", required=True)
    vocab = state.core.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens",
                       code="invalid_value")
    return JSONResponse({"prompt": state.core.tokenizer.decode(ids)})


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/version", version, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/completions", create_completion, methods=["POST"]),
    Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
]


def served_model_names(engine: AsyncLLMEngine) -> list[str]:
    """`--served-model-name`, else the model as given on the command line (as vLLM does),
    else — the bundled default model — its file name, which is shorter to type than its path."""
    model = engine.engine.config.model
    return [model.served_model_name or model.model or os.path.basename(engine.engine.model_path)]


def build_app(engine: AsyncLLMEngine, settings: ServerSettings | None = None,
              api_key: str | None = None) -> Starlette:
    """The Starlette app serving `engine`.

    Args:
        engine: a started AsyncLLMEngine; the app never shuts it down.
        settings: server options (defaults when None).
        api_key: the resolved key to require on /v1 routes (see `auth.resolve_api_key`);
            None leaves them open. Kept apart from `settings.api_key` so that the
            environment is read once, by the caller.
    """
    settings = settings or ServerSettings()
    names = served_model_names(engine)
    state = ServerState(engine=engine, settings=settings, model_names=names,
                        metrics=ServerMetrics(engine, names[0]),
                        chat_template=load_chat_template(settings.chat_template),
                        reasoning=get_reasoning_parser(settings.reasoning_parser) if settings.reasoning_parser
                        else None, created=int(time.time()))
    middleware = [Middleware(APIKeyMiddleware, api_key=api_key)] if api_key else []
    app = Starlette(routes=ROUTES, middleware=middleware, exception_handlers=EXCEPTION_HANDLERS)
    app.state.pagedllm = state
    return app


def run_server(app: Starlette, settings: ServerSettings) -> None:
    """Serve `app` with uvicorn until interrupted (blocking)."""
    import uvicorn

    url = f"http://{settings.host}:{settings.port}"
    logger.info("serving %s at %s (OpenAI API under %s/v1; docs: /v1/models, /health, /metrics)",
                ", ".join(app.state.pagedllm.model_names), url, url)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.uvicorn_log_level,
                timeout_graceful_shutdown=5)
