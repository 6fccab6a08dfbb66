"""Bench fixtures: a fake OpenAI streaming server on 127.0.0.1, run in a thread.

The fake streams exactly `max_tokens` chunks a few milliseconds apart, so the load
generator's arithmetic (TTFT, ITL, token counts, failures) can be checked without a
model. A prompt whose first token id is FAIL_TOKEN gets an HTTP 500.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator

import pytest

from tests._uvicorn import serve_in_thread

FAIL_TOKEN = 999_999
CHUNK_DELAY_S = 0.004


def fake_openai_app(received: list[dict[str, Any]]) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(request: Request) -> Any:
        body = await request.json()
        received.append(body)
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and prompt[0] == FAIL_TOKEN:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        n = int(body["max_tokens"])
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())

        async def events() -> Any:
            for i in range(n):
                await asyncio.sleep(CHUNK_DELAY_S)
                chunk = {"id": "c", "object": "text_completion", "model": body["model"],
                         "choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
                yield f"data: {json.dumps({'id': 'c', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])


class FakeServer:
    """What a test needs of the fake: its URL, the request bodies it got, its constants."""

    fail_token = FAIL_TOKEN
    chunk_delay_s = CHUNK_DELAY_S

    def __init__(self, url: str, received: list[dict[str, Any]]) -> None:
        self.url = url
        self.received = received


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    received: list[dict[str, Any]] = []
    with serve_in_thread(fake_openai_app(received), start_timeout=20) as url:
        yield FakeServer(url, received)
