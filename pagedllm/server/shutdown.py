"""Graceful shutdown: on SIGTERM or SIGINT, stop admitting, let the requests in flight
finish, end the rest with an error, then exit 0.

uvicorn's own handling closes the listening socket at once, gives requests a grace
period, then cancels them: a stream just stops (no [DONE], no error event), a whole
response is never sent, and the process re-raises the signal (exit status -15). Here
the signal only starts `Lifecycle.drain`:

1. every new request is answered 503 (OpenAI-shaped, `Connection: close`), /health
   included, so a load balancer takes the server out of rotation; the socket stays
   open meanwhile, so a client gets an answer rather than a refused connection;
2. the requests in flight get up to `--shutdown-timeout` seconds to finish;
3. the engine ends the rest with a 503 error: a stream sends it as an error event
   followed by [DONE] (what any stream failing after its 200 sends; the openai client
   raises it as an APIError), a whole response is a 503;
4. uvicorn shuts down, the CLI stops the engine, and the process exits 0.

A second signal cuts the wait of step 2 short; a third exits at once, as uvicorn does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.core.engine import AsyncLLMEngine
from pagedllm.server.errors import APIError, error_response

logger = logging.getLogger("pagedllm.server")

# How long the requests ended at the shutdown timeout get to send their error; a client
# that reads nothing cannot take it, and uvicorn cancels what is left after its own grace.
ENDING_GRACE_S = 5.0
UVICORN_GRACE_S = 2
# after the engine died on its own, how long /health answers 503 before the server exits
DEAD_ENGINE_GRACE_S = 2.0


def shutdown_error() -> APIError:
    """The error of a request still running when the shutdown timeout is over."""
    return APIError("the server shut down before this request finished (--shutdown-timeout); retry it",
                    503, code="server_shutting_down")


class Lifecycle:
    """Whether the server still admits requests, and how many it is serving (counted by
    `Admission`)."""

    def __init__(self) -> None:
        self.draining = False
        self.hurried = False
        self.in_flight = 0

    async def drain(self, engine: AsyncLLMEngine, timeout: float) -> None:
        """Refuse new requests; give those in flight `timeout` seconds (less if `hurried`
        is set meanwhile); end the rest with `shutdown_error` and let them send it."""
        self.draining = True
        logger.info("shutting down: new requests get 503; %d in flight get up to %g s to finish "
                    "(--shutdown-timeout)", self.in_flight, timeout)
        await self._wait_idle(timeout, hurry=True)
        if self.in_flight:
            streams = engine.abort_all(shutdown_error)
            logger.warning("shutting down: ending the %d request(s) still in flight (%d engine stream(s)) "
                           "with a 503 error", self.in_flight, streams)
            await self._wait_idle(ENDING_GRACE_S, hurry=False)
        if self.in_flight:
            logger.warning("shutting down: %d request(s) could not be answered", self.in_flight)

    async def _wait_idle(self, seconds: float, hurry: bool) -> None:
        deadline = time.monotonic() + seconds
        while self.in_flight and time.monotonic() < deadline and not (hurry and self.hurried):
            await asyncio.sleep(0.05)


class Admission:
    """ASGI middleware: counts the requests in flight and, once draining, answers 503.

    Args:
        app: the application.
        lifecycle: the server's `Lifecycle`.
    """

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining:
            response = error_response("the server is shutting down and takes no new requests; retry on "
                                      "another instance", 503, code="server_shutting_down")
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        self.lifecycle.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, where a signal starts `Lifecycle.drain` and the exit follows it.

    By the time uvicorn's own shutdown runs, only stragglers are left for its grace
    period to cancel; the signal is not re-raised afterwards, so the process exits 0.

    Args:
        config: the uvicorn configuration.
        lifecycle: the app's `Lifecycle`.
        engine: the engine whose remaining requests the drain ends.
        timeout: `--shutdown-timeout`.
    """

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, engine: AsyncLLMEngine,
                 timeout: float) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.engine = engine
        self.timeout = timeout
        self.signals = 0
        self._drain: asyncio.Task | None = None
        self.dead_since: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler: runs between two bytecodes of the main thread, so it only
        sets flags; `on_tick` acts on them."""
        self.signals += 1
        if self.signals == 2:
            self.lifecycle.hurried = True
        elif self.signals > 2:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        dead = self.engine.dead_error
        if dead is not None and not self.should_exit:
            # the engine stopped on its own (a rank failed): /health answers 503 meanwhile,
            # then the server exits, non-zero (run_server), so a supervisor restarts it
            if self.dead_since is None:
                self.dead_since = time.monotonic()
                logger.error("the engine is dead (%s): exiting in %.0f s", dead, DEAD_ENGINE_GRACE_S)
            elif time.monotonic() - self.dead_since >= DEAD_ENGINE_GRACE_S:
                self.should_exit = True
        if self.signals and self._drain is None:
            self._drain = asyncio.create_task(self.lifecycle.drain(self.engine, self.timeout))
        elif self._drain is not None and self._drain.done() and not self.should_exit:
            if not self._drain.cancelled() and self._drain.exception() is not None:
                logger.error("shutting down: the drain failed", exc_info=self._drain.exception())
            self.should_exit = True
        return await super().on_tick(counter)
