"""Concurrency and cancellation: requests batch together; a client that leaves frees its blocks."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Iterator

import httpx
import openai
import pytest

NUM_CONCURRENT = 64


@pytest.fixture(scope="module")
def server(start_server) -> Iterator[Any]:
    with start_server() as live:
        yield live


@pytest.fixture
def slow_steps(server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make each engine step take >= 10 ms, so a long request cannot finish before its
    client leaves, whatever the machine's speed."""
    worker = server.engine.engine.worker
    real_execute = worker.execute

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.01)
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(worker, "execute", slow)


def test_concurrent_streams_complete_and_share_steps(server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str | None, int]:
        stream = await client.completions.create(
            model=server.model, prompt=f"Hello world {i}", max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        finish, tokens = None, 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return finish, tokens

    async def run_all() -> list[tuple[str | None, int]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                      timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_CONCURRENT)))

    steps_before = server.engine.engine.stats.num_steps
    results = asyncio.run(run_all())
    assert results == [("length", 16)] * NUM_CONCURRENT
    stats = server.engine.engine.stats
    num_steps = stats.num_steps - steps_before
    # Served one at a time this would take 64 * 16 steps; batched, far fewer.
    assert num_steps < NUM_CONCURRENT * 16 / 4, num_steps
    assert stats.max_seqs_in_step >= NUM_CONCURRENT // 4
    with server.client() as http:
        metrics = http.get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("pagedllm:max_num_seqs_per_step"))
    assert float(line.split()[-1]) >= NUM_CONCURRENT // 4
    server.wait_idle()


STREAMS = [
    ("/v1/completions", {"prompt": "Hello world"}),
    ("/v1/completions", {"prompt": ["Hello world", "The quick brown fox"], "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
]


@pytest.mark.parametrize("path,body", STREAMS, ids=["completion", "two-prompts-n2", "chat"])
def test_disconnecting_stream_aborts_and_frees_blocks(server, slow_steps: None, path: str,
                                                      body: dict[str, Any]) -> None:
    core = server.engine.engine
    server.wait_idle()
    free_before = core.block_manager.num_free_blocks
    generated_before = core.stats.num_generation_tokens
    request = {**body, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with server.client() as http, http.stream("POST", path, json=request) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 4:
                break
        assert core.num_running >= 1
        assert core.block_manager.num_free_blocks < free_before
    # leaving the block closed the connection mid-stream
    server.wait_idle(timeout=5)
    assert core.block_manager.num_free_blocks == free_before
    assert core.stats.num_generation_tokens - generated_before < 100


def test_disconnecting_client_of_a_whole_response_frees_blocks(server, slow_steps: None) -> None:
    core = server.engine.engine
    server.wait_idle()
    free_before = core.block_manager.num_free_blocks
    generated_before = core.stats.num_generation_tokens
    with server.client(timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 400, "ignore_eos": True})
    server.wait_idle(timeout=5)
    assert core.block_manager.num_free_blocks == free_before
    assert core.stats.num_generation_tokens - generated_before < 200
