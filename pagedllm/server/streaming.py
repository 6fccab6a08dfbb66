"""Driving engine streams from a request: SSE framing, fan-in, and abort on disconnect.

The engine aborts a request (and frees its KV blocks) when the consumer of its
`generate()` iterator stops iterating — but only once that iterator is closed or
cancelled. Everything here exists to make sure one of the two always happens:
`SSEResponse` closes its body iterator however the response ends, the body iterators
close the engine iterators they wrap (`aclosing`), `merge` cancels its pump tasks,
and `until_disconnected` cancels a non-streaming generation whose client has gone.
`respond` puts these together for the generating endpoints, which only say what
their chunks and their whole answer look like.

Nothing here buffers more than a few outputs for a client that reads slowly: each
engine stream holds only its newest output, `merge` waits for its consumer, and
`SSEResponse` waits for uvicorn to drain the socket. A stream whose client accepts
nothing for `--stream-stall-timeout` seconds is ended and its request aborted:
pausing it is not possible, since a paused request would still hold its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedllm.core.engine import AsyncLLMEngine
from pagedllm.core.request import RequestOutput, SamplingParams
from pagedllm.server.errors import error_body, from_engine_error
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.state import state_of

logger = logging.getLogger("pagedllm.server")
T = TypeVar("T")
DONE = "data: [DONE]\n\n"


# Characters JSON leaves raw that many line readers still split on (Python's str.splitlines,
# which httpx's iter_lines uses; JavaScript's old line terminators): escaped, an event stays
# one line for every client. JSON escapes \n, \r and the other control characters itself.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event_json(payload: dict[str, Any]) -> str:
    """A payload as one line of compact JSON, non-ASCII text kept as is except line breaks."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {event_json(payload)}\n\n"


def sse_error(exc: BaseException) -> str:
    """The event a stream ends with when its request fails after the 200 was sent."""
    err = from_engine_error(exc)
    return sse(error_body(err.message, err.status_code, err.param, err.code))


class ClientStalled(Exception):
    """A write to the client did not complete within the stall timeout."""


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always closes its body iterator.

    Starlette stops iterating when the client disconnects (it cancels the sending task),
    but a generator cancelled while suspended in `send` is left open; closing it here
    runs its `finally`, which aborts the engine request. uvicorn's `send` waits while
    the socket's buffers are full; one that waits `stall_timeout` seconds (the client
    has read nothing meanwhile) ends the response the same way, and uvicorn closes the
    connection of a response left incomplete.

    Args:
        content: the events.
        stall_timeout: seconds one write may wait for the client; 0 waits forever.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], stall_timeout: float = 0) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.stall_timeout = stall_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, self._bounded(send) if self.stall_timeout > 0 else send)
        except ClientStalled:
            client = scope.get("client") or ("?", 0)
            logger.warning("stream to %s:%s stalled: the client accepted nothing for %g s; ended it and "
                           "aborted its request (--stream-stall-timeout)", client[0], client[1], self.stall_timeout)
        except OSError:
            pass  # the client went away mid-write; nothing left to tell it
        finally:
            closer = getattr(self.body_iterator, "aclose", None)
            if closer is not None:
                await closer()

    def _bounded(self, send: Send) -> Send:
        # asyncio.timeout (3.11+) arms a timer per write; wait_for also wraps each write in
        # a task: ~3x the event loop's time per event, which runs on the cores the model
        # steps on
        timeout = getattr(asyncio, "timeout", None)

        async def bounded(message: dict[str, Any]) -> None:
            try:
                if timeout is not None:
                    async with timeout(self.stall_timeout):
                        await send(message)
                else:
                    await asyncio.wait_for(send(message), self.stall_timeout)
            except asyncio.TimeoutError:
                raise ClientStalled() from None

        return bounded


class _End:
    pass


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several streams as (stream index, item), in arrival order.

    Each stream is pumped by its own task; leaving this generator early (or an error in
    any stream) cancels every pump, which closes — and so aborts — its engine request.
    The queue holds one item per stream: a pump waits for a slow consumer instead of
    piling items up (the engine streams it reads keep only their newest output).
    """
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async with aclosing(stream) as it:
                async for item in it:
                    await queue.put((index, item))
        except Exception as exc:
            await queue.put((index, exc))
            return
        await queue.put((index, _End()))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, _End):
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def timed(stream: AsyncIterator[RequestOutput], metrics: ServerMetrics, n: int) -> AsyncIterator[RequestOutput]:
    """Pass a request's outputs through, recording TTFT, inter-token and e2e latency, and how
    each of its `n` sequences ended: those closed before they finished count as aborted."""
    start = last = time.monotonic()
    num_tokens = 0
    finishes = metrics.finishes(n)
    try:
        async with aclosing(stream) as outputs:
            async for out in outputs:
                now = time.monotonic()
                total = sum(len(c.token_ids) for c in out.outputs)
                new = total - num_tokens
                if new > 0:
                    if num_tokens == 0:
                        metrics.ttft.observe(now - start)
                    else:
                        for _ in range(new):
                            metrics.itl.observe((now - last) / new)
                    num_tokens, last = total, now
                if out.finished:
                    metrics.e2e.observe(now - start)
                finishes.observe(out)
                yield out
    finally:
        finishes.close()


def generate_all(engine: AsyncLLMEngine, metrics: ServerMetrics, request_id: str,
                 prompts: list[tuple[str | None, list[int]]],
                 params: list[SamplingParams]) -> list[AsyncIterator[RequestOutput]]:
    """One engine stream per prompt (ids `<request_id>-<i>`); nothing starts until iterated."""
    return [timed(engine.generate(text, p, f"{request_id}-{i}", prompt_token_ids=ids), metrics, p.n)
            for i, ((text, ids), p) in enumerate(zip(prompts, params))]


async def collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Each stream's final output, in stream order. A failed stream raises APIError (400
    for input the engine refused, 500 for an engine failure, which the engine has logged)."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async with aclosing(merge(streams)) as merged:
            async for index, out in merged:
                finals[index] = out
    except Exception as exc:
        raise from_engine_error(exc) from exc
    return [f for f in finals if f is not None]


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (and so aborting its engine requests) if the client leaves.

    The body must have been read already: after it, the only message the server can
    receive is `http.disconnect`.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


Chunks = Callable[[AsyncIterator[tuple[int, RequestOutput]]], AsyncIterator[dict[str, Any]]]
Answer = Callable[[list[RequestOutput]], dict[str, Any]]


async def respond(request: Request, streams: list[AsyncIterator[RequestOutput]], stream: bool,
                  chunks: Chunks, answer: Answer) -> Response:
    """The response of a generating endpoint: SSE when `stream`, else one JSON object.

    Args:
        request: the request, whose body has been read.
        streams: the engine streams of its prompts (see `generate_all`).
        stream: whether the client asked for server-sent events.
        chunks: the stream's JSON chunks, given the merged (stream index, output) pairs.
        answer: the JSON answer, given each stream's final output in stream order.

    A whole answer whose client leaves first is 499 (nginx's "client closed request"),
    which nobody reads but the access log.
    """
    if stream:
        return SSEResponse(event_stream(streams, chunks),
                           stall_timeout=state_of(request).settings.stream_stall_timeout)
    try:
        finals = await until_disconnected(request, collect(streams))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(answer(finals))


async def event_stream(streams: list[AsyncIterator[RequestOutput]], chunks: Chunks) -> AsyncIterator[str]:
    """SSE events of `chunks` over the merged streams, then [DONE]. The status line has gone
    out already, so a failure is reported in an error event before [DONE]."""
    try:
        async with aclosing(merge(streams)) as merged, aclosing(chunks(merged)) as payloads:
            async for payload in payloads:
                yield sse(payload)
    except Exception as exc:
        yield sse_error(exc)
    yield DONE
