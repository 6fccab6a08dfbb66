"""Slow readers: a stream buffers O(1) outputs whatever its length, and a stream whose client
accepts nothing for --stream-stall-timeout seconds is ended and its request aborted (KV freed)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Iterator

import pytest

from pagedllm.core.request import SamplingParams
from pagedllm.server.app import ServerSettings, build_app
from pagedllm.server.streaming import merge
from tests.server._healthy import assert_healthy
from tests.server.test_stream import STREAMS, slow_steps  # noqa: F401  (slow_steps: a fixture)

STALL_S = 0.5


@pytest.fixture(scope="module")
def server(start_server) -> Iterator[Any]:
    with start_server() as live:
        yield live


async def wait_for(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_stream_nobody_reads_holds_only_its_newest_output(server) -> None:
    """The engine runs a request to its end while its consumer waits; the consumer then gets
    one output, the finished one (a queue would hand it every step's cumulative copy)."""
    engine = server.engine
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)

    async def run() -> tuple[Any, list[Any]]:
        stream = engine.generate(None, params, "unread", prompt_token_ids=[5, 6, 7])
        first = await stream.__anext__()
        await wait_for(lambda: not engine.engine.has_unfinished_requests())
        return first, [out async for out in stream]

    first, rest = asyncio.run(run())
    assert not first.finished
    assert len(rest) == 1, f"{len(rest)} outputs were buffered"
    assert rest[0].finished and len(rest[0].outputs[0].token_ids) == 64
    server.wait_idle()
    assert_healthy(server)


def test_merge_waits_for_a_slow_consumer() -> None:
    """merge's pumps stop when its queue holds an item per stream, instead of draining their
    streams into it."""
    pulled = [0, 0]

    async def source(i: int) -> AsyncIterator[int]:
        for k in range(1000):
            pulled[i] += 1
            yield k

    async def run() -> list[int]:
        merged = merge([source(0), source(1)])
        await merged.__anext__()
        for _ in range(100):  # give the pumps every chance to run on
            await asyncio.sleep(0)
        counts = list(pulled)
        await merged.aclose()
        return counts

    counts = asyncio.run(run())
    assert sum(counts) <= 6, counts


def asgi_scope(path: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {}}


async def call_with_a_client_that_stops_reading(app: Any, path: str, body: dict[str, Any],
                                                 bodies_taken: int) -> list[dict[str, Any]]:
    """Call `app` as uvicorn would for a client whose socket buffers fill after `bodies_taken`
    body messages: from then on `send` waits (uvicorn's flow control) for ever."""
    sent: list[dict[str, Any]] = []
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict[str, Any]:
        if request:
            return request.pop()
        await asyncio.Event().wait()  # the client never disconnects
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if sum(m["type"] == "http.response.body" for m in sent) >= bodies_taken:
            await asyncio.Event().wait()
        sent.append(message)

    await asyncio.wait_for(app(asgi_scope(path), receive, send), timeout=60)
    return sent


@pytest.mark.parametrize("path,body", STREAMS, ids=["completion", "two-prompts-n2", "chat"])
def test_a_stalled_stream_is_ended_and_its_request_aborted(server, slow_steps: None, path: str,
                                                           body: dict[str, Any]) -> None:
    core = server.engine.engine
    server.wait_idle()
    free_before = core.block_manager.num_free_blocks
    generated_before = core.stats.num_generation_tokens
    app = build_app(server.engine, ServerSettings(stream_stall_timeout=STALL_S))
    request = {**body, "model": server.model, "max_tokens": 400, "ignore_eos": True, "stream": True}
    sent = asyncio.run(call_with_a_client_that_stops_reading(app, path, request, bodies_taken=3))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert not any(m.get("more_body") is False for m in sent), "the response must be left unfinished"
    server.wait_idle(timeout=10)
    assert len(core.scheduler.running) == 0 and core.block_manager.num_free_blocks == free_before
    # Aborted, not run to max_tokens: 10 ms steps, and the stall ends it after 0.5 s.
    assert core.stats.num_generation_tokens - generated_before < 400, "the request ran to its end"
    assert_healthy(server)


def test_stall_timeout_zero_waits_for_the_client(server) -> None:
    """--stream-stall-timeout 0: a slow client is waited for; its stream ends normally."""
    app = build_app(server.engine, ServerSettings(stream_stall_timeout=0))

    async def run() -> list[dict[str, Any]]:
        request = {"model": server.model, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "stream": True}
        task = asyncio.ensure_future(call_with_a_client_that_stops_reading(app, "/v1/completions", request, 1))
        await asyncio.sleep(STALL_S * 4)
        assert not task.done(), "the stream was ended without a stall timeout"
        task.cancel()
        return []

    asyncio.run(run())
    server.wait_idle(timeout=10)
    assert_healthy(server)
