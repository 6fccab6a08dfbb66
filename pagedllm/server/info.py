"""GET /health, /version, /metrics and /v1/models: what probes, scrapers and clients ask
about the server, answered without touching the engine's queue."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import pagedllm
from pagedllm.server.metrics import CONTENT_TYPE
from pagedllm.server.state import model_as_given, state_of


async def health(request: Request) -> Response:
    """200 while the engine thread runs, 503 once it has stopped."""
    if not state_of(request).engine.is_alive:
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    return Response(status_code=200)


async def version(request: Request) -> Response:
    return JSONResponse({"version": pagedllm.__version__})


async def models(request: Request) -> Response:
    """OpenAI's model list, with vLLM's `root` and `max_model_len`.

    `root` is the model as given (`state.model_as_given`), never a path the server resolved
    itself: that would tell every client where the server is installed.
    """
    state = state_of(request)
    llm_engine = state.llm_engine
    root = model_as_given(llm_engine)
    return JSONResponse({"object": "list", "data": [
        {"id": name, "object": "model", "created": state.created, "owned_by": "pagedllm",
         "root": root, "parent": None, "max_model_len": llm_engine.max_model_len,
         "permission": []} for name in state.model_names]})


async def metrics(request: Request) -> Response:
    """Prometheus text format (see `metrics.py`)."""
    return Response(state_of(request).metrics.render(), media_type=CONTENT_TYPE)
