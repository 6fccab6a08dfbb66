"""Small defects found by abusing the server: absurd sampling values, streamed text_offset with
stop strings, a chat prompt that fills the context, abort metrics, and /v1/models' `root`."""

from __future__ import annotations

import os
import re
import time
from types import SimpleNamespace
from typing import Any, Iterator

import httpx
import pytest

from pagedllm.core.config import DEFAULT_MODEL_FILE, EngineConfig
from pagedllm.core.engine import AsyncLLMEngine
from pagedllm.core.request import CompletionOutput, RequestOutput
from pagedllm.server.app import build_app
from pagedllm.server.metrics import ServerMetrics
from tests._uvicorn import serve_in_thread
from tests.server._healthy import assert_healthy

MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def server(start_server) -> Iterator[Any]:
    with start_server() as live:
        yield live


@pytest.mark.parametrize("endpoint,extra,param", [
    ("/v1/completions", {"temperature": 3.5e38, "min_tokens": 2}, "temperature"),
    ("/v1/completions", {"temperature": 1.0, "repetition_penalty": 1e-39}, "repetition_penalty"),
    ("/v1/chat/completions", {"temperature": 1e300, "min_tokens": 2}, "temperature"),
])
def test_absurd_sampling_values_are_400(server, endpoint: str, extra: dict[str, Any], param: str) -> None:
    """These used to sample token 0 every time (NaN in float32); now they are refused."""
    body = {"model": server.model, "max_tokens": 4, **extra,
            **({"prompt": "Hello"} if endpoint == "/v1/completions" else
               {"messages": [{"role": "user", "content": "Hello"}]})}
    with server.client() as http:
        response = http.post(endpoint, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and f"SamplingParams.{param} must be in" in error["message"], error
    assert_healthy(server)


def test_streamed_text_offset_matches_the_whole_answer_with_stop_strings(server) -> None:
    """A stop string makes the engine hold the text's tail back; offsets must not follow it."""
    body = {"model": server.model, "prompt": "The quick brown", "max_tokens": 24, "temperature": 0,
            "logprobs": 1, "stop": ["never-appears-0123456789"], "extra_body": {"ignore_eos": True}}
    with server.openai() as client:
        whole = client.completions.create(**body).choices[0].logprobs
        tokens: list[str] = []
        offsets: list[int] = []
        for chunk in client.completions.create(**body, stream=True):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                tokens += chunk.choices[0].logprobs.tokens
                offsets += chunk.choices[0].logprobs.text_offset
    assert len(whole.tokens) == 24 and tokens == whole.tokens
    assert offsets == whole.text_offset
    assert_healthy(server)


def chat_with_prompt_tokens(live: Any, target: int) -> list[dict[str, str]]:
    """Messages whose rendered prompt is exactly `target` tokens."""
    words = 1
    with live.client() as http:
        for _ in range(20):
            messages = [{"role": "user", "content": " ".join(["fox"] * words)}]
            count = http.post("/tokenize", json={"model": live.model, "messages": messages}).json()["count"]
            if count == target:
                return messages
            words = max(1, words + target - count)
    raise AssertionError(f"no message renders to exactly {target} tokens")


def test_chat_prompt_that_fills_the_context_is_400(server) -> None:
    full = chat_with_prompt_tokens(server, MAX_MODEL_LEN)
    with server.client() as http:
        response = http.post("/v1/chat/completions", json={"model": server.model, "messages": full})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages" and error["code"] == "context_length_exceeded", error
        assert f"{MAX_MODEL_LEN} tokens" in error["message"]

        room_for_one = chat_with_prompt_tokens(server, MAX_MODEL_LEN - 1)
        response = http.post("/v1/chat/completions", json={"model": server.model, "messages": room_for_one})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["total_tokens"] == MAX_MODEL_LEN
    assert_healthy(server)


def success_total(http: httpx.Client, reason: str) -> float:
    text = http.get("/metrics").text
    pattern = rf'^pagedllm:request_success_total\{{[^}}]*finished_reason="{reason}"[^}}]*\}} (\S+)$'
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_dropped_stream_counts_as_abort(server) -> None:
    with server.client() as http:
        before = success_total(http, "abort")
        body = {"model": server.model, "prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "n": 2,
                "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break  # leave after the first event: the connection closes with the stream unread
    server.wait_idle()
    with server.client() as http:
        deadline = time.monotonic() + 10
        while success_total(http, "abort") < before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert success_total(http, "abort") == before + 2, "both sequences of the dropped stream were aborted"
    assert_healthy(server)


def test_finish_tracker_counts_each_sequence_once(server) -> None:
    metrics = ServerMetrics(server.engine, "tracked")

    def count(reason: str) -> float:
        return metrics.registry.get_sample_value("pagedllm:request_success_total",
                                                 {"model_name": "tracked", "finished_reason": reason})

    tracker = metrics.finishes(3)
    partial = RequestOutput("r", None, [1], [CompletionOutput(0, "a", [5], finish_reason="stop"),
                                             CompletionOutput(1, "", []), CompletionOutput(2, "b", [6])],
                            finished=False)
    tracker.observe(partial)
    tracker.observe(partial)  # the same finished sequence again: not counted twice
    assert (count("stop"), count("abort")) == (1, 0)
    tracker.close()
    tracker.close()
    assert (count("stop"), count("length"), count("abort")) == (1, 0, 2)
    assert_healthy(server)


def test_models_root_is_the_model_as_given(server, server_model_path: str) -> None:
    with server.client() as http:
        card = http.get("/v1/models").json()["data"][0]
    assert card["root"] == server_model_path
    assert_healthy(server)


@pytest.mark.slow
def test_models_root_of_the_bundled_default_is_its_file_name() -> None:
    """No model given: `root` names the bundled file, never the site-packages path it was found at."""
    engine = AsyncLLMEngine.from_config(EngineConfig.from_kwargs(kv_cache_memory=32 << 20, max_model_len=256,
                                                                 device="cpu"))
    try:
        with serve_in_thread(build_app(engine)) as url:
            with httpx.Client(base_url=url, timeout=30) as http:
                card = http.get("/v1/models").json()["data"][0]
            assert card["root"] == card["id"] == DEFAULT_MODEL_FILE
            assert not os.path.isabs(card["root"])
            assert_healthy(SimpleNamespace(model=card["id"], client=lambda: httpx.Client(base_url=url, timeout=30)))
    finally:
        engine.shutdown()
