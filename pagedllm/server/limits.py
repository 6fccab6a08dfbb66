"""Connection limits: how long a client may take to send a request, and how many
connections it may hold.

uvicorn closes a kept-alive connection left idle between requests (`timeout_keep_alive`),
but sets no deadline on the request itself: a fresh connection that sends nothing,
half a header line or half a body stays open forever, each one a socket and (once its
headers are in) a task (slowloris). So:

- `GuardedH11Protocol` is uvicorn's h11 protocol plus a header deadline: the request
  line and headers must be in within `--header-timeout` seconds of the connection
  opening, or of the first byte of the next request on a kept-alive connection (else
  a 408 if part of a request came, and the connection is closed); and a cap: a request
  on a connection past `--max-connections` gets a 503 and its connection is closed.
  uvicorn's own `limit_concurrency` answers in plain text; this one in OpenAI's shape.
- `BodyTimeout` is an ASGI middleware: the body must be read in full within
  `--body-timeout` seconds of the headers; past it, the read raises a 408 `APIError`,
  which the endpoint answers, and the connection is closed.

Headers are capped in size by h11 (`MAX_HEADER_BYTES`: an OpenAI-shaped 400 beyond, as
for any bytes that are not HTTP), bodies by `--max-request-body-bytes`. The protocol is h11 even where httptools is installed, so
that the limits hold whatever is installed; websockets are off (no route uses them).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.server.errors import APIError, error_body, error_response
from pagedllm.server.state import ServerSettings

logger = logging.getLogger("pagedllm.server")
MAX_HEADER_BYTES = 16 << 10  # a request line and headers (h11's default, given to uvicorn explicitly)


def guarded_protocol(settings: ServerSettings) -> type[H11Protocol]:
    """uvicorn's `http` protocol class, with the header deadline and connection cap of `settings`."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "header_timeout": settings.header_timeout, "max_connections": settings.max_connections})


async def _over_capacity(scope: Scope, receive: Receive, send: Send) -> None:
    response = error_response("the server has too many open connections (--max-connections); retry later",
                              503, code="too_many_connections")
    response.headers.update({"Connection": "close", "Retry-After": "1"})
    await response(scope, receive, send)


def _raw_response(status: int, reason: str, body: dict[str, Any]) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for when h11 has no request to answer."""
    payload = json.dumps(body).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}"
            f"\r\nconnection: close\r\n\r\n").encode() + payload


class GuardedH11Protocol(H11Protocol):
    """See the module docstring; `guarded_protocol` sets the two limits."""

    header_timeout: float = 10.0
    max_connections: int = 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes h11 cannot parse as a request, in OpenAI's shape."""
        message = f"not a valid HTTP/1.1 request, or its headers are over {MAX_HEADER_BYTES >> 10} KiB"
        self.transport.write(_raw_response(400, "Bad Request", error_body(message, 400, code="invalid_http")))
        self.transport.close()

    def handle_events(self) -> None:
        # The app a request on this connection goes to: uvicorn reads `self.app` when its headers are in.
        self.app = _over_capacity if len(self.connections) > self.max_connections else self.config.loaded_app
        super().handle_events()

    def _watch_headers(self) -> None:
        """Keep the header deadline armed exactly while the connection waits for a request's
        headers and nothing else has a deadline on it: not while a request runs (the body
        and stall timeouts cover it), not while uvicorn's keep-alive timer runs."""
        busy = self.cycle is not None and not self.cycle.response_complete
        if busy or self.timeout_keep_alive_task is not None or self.transport.is_closing():
            self._cancel_header_timer()
        elif self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        started, _ = self.conn.trailing_data
        if started and self.conn.their_state is h11.IDLE:  # part of a request came: say why it ends
            message = f"the request headers did not arrive within {self.header_timeout:g} s (--header-timeout)"
            self.transport.write(_raw_response(408, "Request Timeout",
                                               error_body(message, 408, code="request_timeout")))
        logger.debug("closed a connection from %s: no request headers within %g s", self.client,
                     self.header_timeout)
        self.transport.close()


class BodyTimeout:
    """ASGI middleware: a request's body must be read within `timeout` seconds of its headers.

    A read past the deadline raises a 408 `APIError` in the endpoint reading it (which
    answers it like any other); the answer carries `Connection: close`, since the rest
    of the body would still be on the connection.

    Args:
        app: the application.
        timeout: `--body-timeout`.
    """

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        reading = True
        timed_out = False

        async def timed_receive() -> Message:
            nonlocal reading, timed_out
            if not reading:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                timed_out = True
                raise APIError(f"the request body did not arrive within {self.timeout:g} s (--body-timeout)",
                               408, code="request_timeout") from None
            reading = message["type"] == "http.request" and message.get("more_body", False)
            return message

        async def closing_send(message: Message) -> None:
            if timed_out and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, timed_receive, closing_send)
