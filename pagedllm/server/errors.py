"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause is raised as `APIError` with a 4xx status and turned
into that body by `handle_errors`. Any other exception is logged with its traceback and
mapped by `from_engine_error`: a ValueError (input the engine refused) is a 400, the rest
(a server bug, an engine failure) a 500; either way it fails only the request that hit it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Awaitable, Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.core.executor import EngineDeadError

logger = logging.getLogger("pagedllm.server")

# OpenAI's error `type` per status; the `code` says which kind of mistake it was.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error the client should see, with the OpenAI fields it is reported with.

    Args:
        message: what went wrong and, where possible, what to change.
        status_code: the HTTP status (4xx for the client's mistakes).
        param: the request field at fault, if one is.
        code: a short machine-readable reason (`context_length_exceeded`, ...).
    """

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code


def error_body(message: str, status_code: int, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The JSON object of an error; also sent as an SSE event when a stream fails."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status_code, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(message: str, status_code: int, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, param, code), status_code=status_code)


def api_error_response(exc: APIError) -> JSONResponse:
    return error_response(exc.message, exc.status_code, exc.param, exc.code)


def from_engine_error(exc: BaseException) -> APIError:
    """Map an exception a request's stream raised: the engine rejects bad input with
    ValueError (a 400); a dead engine (a rank failed) is a 503; any other failure is the
    engine's (a 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(str(exc), 400, code="invalid_value")
    if isinstance(exc, EngineDeadError):  # a rank is gone: the server is about to exit
        return APIError(str(exc), 503, code="engine_dead")
    return APIError(f"the engine failed on this request: {exc}", 500, code="engine_error")


Endpoint = Callable[[Request], Awaitable[Response]]


def handle_errors(endpoint: Endpoint) -> Endpoint:
    """Wrap an endpoint so every exception becomes an OpenAI-shaped response.

    `app.route` applies it to every endpoint as the route table is built. A wrapper
    rather than Starlette exception handlers, so that an unexpected error is answered
    and logged once here, and never reaches the server loop.
    """

    @functools.wraps(endpoint)
    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except APIError as exc:
            return api_error_response(exc)
        except Exception as exc:
            logger.exception("%s %s failed", request.method, request.url.path)
            return api_error_response(from_engine_error(exc))

    return wrapped


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no such route) and 405 (wrong method), in OpenAI's shape."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    if status == 404:
        detail = f"no route {request.method} {request.url.path}; see / (the chat page), /v1/models, " \
                 "/v1/completions, /v1/chat/completions, /v1/responses"
    headers = getattr(exc, "headers", None)
    response = error_response(str(detail), status, code="not_found" if status == 404 else None)
    if headers:
        response.headers.update(headers)
    return response


EXCEPTION_HANDLERS = {HTTPException: http_exception_handler}
