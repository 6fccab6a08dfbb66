"""API-key check for the OpenAI routes, as vLLM does it.

With a key configured (`--api-key`, else PAGEDLLM_API_KEY / VLLM_API_KEY), every
request under /v1 must carry `Authorization: Bearer <key>`; the operational routes
(/health, /metrics, /version, /tokenize, /detokenize) stay open so that probes and
scrapers need no secret. A pure ASGI middleware, so streaming responses pass through
untouched.
"""

from __future__ import annotations

import hmac
import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.core import envs
from pagedllm.server.errors import error_response

logger = logging.getLogger("pagedllm.server")
PROTECTED_PREFIX = "/v1"


def resolve_api_key(flag_value: str | None) -> str | None:
    """The key to require: the flag wins over the environment; logs which decided."""
    if flag_value:
        logger.info("API key required (from --api-key)")
        return flag_value
    value = envs.get("PAGEDLLM_API_KEY")
    if value:
        logger.info("API key required (from %s)", envs.source("PAGEDLLM_API_KEY"))
        return value
    return None


class APIKeyMiddleware:
    """Answer 401 to /v1 requests without the right bearer token.

    Args:
        app: the application to protect.
        api_key: the key clients must send.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX) \
                or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value
                break
        # Constant-time comparison: the key must not leak through response timing.
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        message = ("missing Authorization header: send 'Authorization: Bearer <api key>'" if not given
                   else "invalid API key")
        response = error_response(message, 401, code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)
