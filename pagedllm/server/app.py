"""The OpenAI-compatible Starlette app: the route table, `build_app` and `run_server`.

`build_app(engine, settings)` wires an already running `AsyncLLMEngine` to the
routes; it owns no engine, so tests can build several apps over one engine and the
CLI decides the engine's lifetime. Every endpoint is wrapped in `handle_errors` here,
where the table is built, so that no endpoint can answer an error in another shape.
The limits on slow clients (`limits.py`) and the graceful shutdown (`shutdown.py`)
are put together here too: their middleware in `build_app`, their uvicorn parts in
`uvicorn_options` and `run_server`. `/` serves the browser chat page (`static/`), open
without the API key: the page asks for the key and sends it on its /v1 requests.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from pagedllm.core.engine import AsyncLLMEngine
from pagedllm.server.auth import APIKeyMiddleware
from pagedllm.server.chat import create_chat_completion
from pagedllm.server.completions import create_completion
from pagedllm.server.errors import EXCEPTION_HANDLERS, Endpoint, handle_errors
from pagedllm.server.info import health, metrics, models, version
from pagedllm.server.limits import MAX_HEADER_BYTES, BodyTimeout, guarded_protocol
from pagedllm.server.responses import create_response
from pagedllm.server.shutdown import UVICORN_GRACE_S, Admission, DrainingServer
from pagedllm.server.state import ServerSettings, ServerState, load_chat_template
from pagedllm.server.tokenize import detokenize, tokenize

__all__ = ["ROUTES", "ServerSettings", "build_app", "load_chat_template", "run_server", "uvicorn_options"]

logger = logging.getLogger("pagedllm.server")


STATIC_DIR = Path(__file__).parent / "static"
# The chat page loads only its own files and talks only to this server.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def route(path: str, endpoint: Endpoint, method: str) -> Route:
    """A route whose endpoint answers every exception with an OpenAI-shaped error."""
    return Route(path, handle_errors(endpoint), methods=[method])


async def chat_page(request: Request) -> Response:
    """GET /: the browser chat page (static/). Open without the API key: the page asks for
    it and sends it on its /v1 requests."""
    return FileResponse(STATIC_DIR / "index.html", headers=PAGE_HEADERS)


ROUTES = [
    route("/", chat_page, "GET"),
    route("/health", health, "GET"),
    route("/version", version, "GET"),
    route("/metrics", metrics, "GET"),
    route("/tokenize", tokenize, "POST"),
    route("/detokenize", detokenize, "POST"),
    route("/v1/models", models, "GET"),
    route("/v1/completions", create_completion, "POST"),
    route("/v1/chat/completions", create_chat_completion, "POST"),
    route("/v1/responses", create_response, "POST"),
]
# The chat page's script and style; not in ROUTES, which holds the endpoints (each wrapped
# in `handle_errors`): a missing file is Starlette's 404, in OpenAI's shape all the same.
STATIC = Mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


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
    state = ServerState.create(engine, settings or ServerSettings())
    middleware = [Middleware(Admission, lifecycle=state.lifecycle),
                  Middleware(BodyTimeout, timeout=state.settings.body_timeout)]
    if api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=api_key))
    app = Starlette(routes=[*ROUTES, STATIC], middleware=middleware, exception_handlers=EXCEPTION_HANDLERS)
    app.state.pagedllm = state
    return app


def uvicorn_options(settings: ServerSettings) -> dict[str, Any]:
    """The `uvicorn.Config` arguments that apply the connection limits of `settings`."""
    return {"http": guarded_protocol(settings), "ws": "none", "timeout_keep_alive": settings.keep_alive_timeout,
            "h11_max_incomplete_event_size": MAX_HEADER_BYTES, "timeout_graceful_shutdown": UVICORN_GRACE_S}


def run_server(app: Starlette, settings: ServerSettings) -> None:
    """Serve `app` with uvicorn until SIGTERM or SIGINT and the drain after it (blocking).

    Raises SystemExit(3) if the app did not start, as `uvicorn.run` does."""
    import uvicorn

    state: ServerState = app.state.pagedllm
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.uvicorn_log_level,
                            **uvicorn_options(settings))
    url = f"http://{settings.host}:{settings.port}"
    local = settings.host in ("127.0.0.1", "localhost", "::1")
    logger.info("serving %s at %s (chat page: %s/ ; OpenAI API under %s/v1; docs: /v1/models, /health, "
                "/metrics)%s", ", ".join(state.model_names), url, url, url,
                "; this machine only: --host 0.0.0.0 listens on every interface (vLLM's default)" if local else "")
    server = DrainingServer(config, state.lifecycle, state.engine, settings.shutdown_timeout)
    server.run()
    if not server.started:
        raise SystemExit(3)
    if state.engine.dead_error is not None:
        logger.error("exiting: %s", state.engine.dead_error)
        raise SystemExit(1)
