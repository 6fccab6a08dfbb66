"""Requests built to hurt the server: CPU work that would hold the event loop, fields whose
cost grows with their size, strings that are not text, clients that leave mid-upload.
Each gets a 4xx (or nothing) and leaves the server answering everyone else."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any, Callable, Iterator

import pytest

from pagedllm.server.protocol import (
    CHARS_PER_TOKEN,
    MAX_CHOICES,
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
)
from tests.server._healthy import assert_healthy
from tests.server.test_errors import check_error

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(start_server) -> Iterator[Any]:
    """No API key (like /tokenize, which never needs one), default limits."""
    with start_server() as live:
        yield live


@pytest.fixture(scope="module")
def text_limit(server) -> int:
    return CHARS_PER_TOKEN * server.engine.engine.max_model_len


def on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def record_calls(monkeypatch: pytest.MonkeyPatch, obj: Any, name: str, calls: list[bool],
                 before: Callable[[], None] | None = None) -> None:
    """Wrap `obj.name` so each call appends whether it ran on an event loop's thread."""
    real = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(on_event_loop())
        if before is not None:
            before()
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapped)


# ---------------------------------------------------------------- item 1: off the event loop

def test_tokenizing_and_templates_run_off_the_event_loop(server, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = server.engine.engine.tokenizer
    encodes: list[bool] = []
    renders: list[bool] = []
    decodes: list[bool] = []
    record_calls(monkeypatch, tokenizer, "encode", encodes)
    record_calls(monkeypatch, tokenizer, "apply_chat_template", renders)
    record_calls(monkeypatch, tokenizer, "decode", decodes)  # the engine thread's decodes are off the loop too
    with server.client() as http:
        assert http.post("/tokenize", json={"prompt": "hello world"}).status_code == 200
        assert http.post("/tokenize", json={"messages": CHAT["messages"]}).status_code == 200
        assert http.post("/v1/completions", json={"prompt": ["hello", "world"], "max_tokens": 2}).status_code == 200
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
        with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status_code == 200 and any(line == "data: [DONE]" for line in r.iter_lines())
        assert http.post("/detokenize", json={"tokens": [5, 6, 7]}).status_code == 200
        assert http.post("/v1/completions", json={"prompt": [5, 6], "echo": True, "max_tokens": 1}).status_code == 200
        server.wait_idle()
    assert encodes and len(renders) == 3 and decodes
    assert not any(encodes), "a prompt was tokenized on the event loop"
    assert not any(renders), "a chat template was rendered on the event loop"
    assert not any(decodes), "token ids were decoded on the event loop"
    assert_healthy(server)


def test_health_answers_while_a_slow_tokenize_runs(server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tokenizer that holds the CPU for 2.5 s (pure Python, so it also holds the GIL
    between switches) must not hold up /health nor another request."""
    started = threading.Event()

    def spin() -> None:  # the first call only, on whichever thread tokenizes
        if not started.is_set():
            started.set()
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                pass

    record_calls(monkeypatch, server.engine.engine.tokenizer, "encode", [], before=spin)
    results: dict[str, Any] = {}

    def slow_request() -> None:
        with server.client() as http:
            results["tokenize"] = http.post("/tokenize", json={"prompt": "a slow one"})

    thread = threading.Thread(target=slow_request)
    thread.start()
    try:
        assert started.wait(20), "the slow tokenize never started"
        with server.client() as http:
            t0 = time.monotonic()
            health = http.get("/health")
            latency = time.monotonic() - t0
            assert health.status_code == 200
            assert latency < 1.0, f"/health took {latency:.2f} s while a tokenize ran"
            other = http.post("/detokenize", json={"tokens": [5, 6]})
            assert other.status_code == 200
    finally:
        thread.join(30)
    assert results["tokenize"].status_code == 200
    monkeypatch.undo()
    assert_healthy(server)


# ---------------------------------------------------------------- item 2: per-request limits

def limit_cases(text_limit: int) -> list[tuple[str, dict[str, Any], str]]:
    """(path, body, the param the 400 must name), each one over exactly one limit."""
    many_messages = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    return [
        ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(MAX_STOP + 1)]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),
        ("/v1/chat/completions", {**CHAT, "stop": ["ok", "y" * (MAX_STOP_CHARS + 1)]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ("/v1/completions", {"prompt": ["hi"] * (MAX_PROMPTS + 1), "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [[5]] * (MAX_PROMPTS + 1), "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": ["hi"] * 3, "n": MAX_CHOICES // 3 + 1, "max_tokens": 1}, "n"),
        ("/v1/completions", {"prompt": "ab" * (text_limit // 2 + 1)}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", "c" * (text_limit + 1)]}, "prompt"),
        ("/tokenize", {"prompt": "d" * (text_limit + 1)}, "prompt"),
        ("/v1/chat/completions", {"messages": many_messages}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "e" * (text_limit + 1)}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "f" * text_limit}]},
                                               {"role": "user", "content": "g"}]}, "messages"),
        ("/tokenize", {"messages": many_messages}, "messages"),
        ("/detokenize", {"tokens": [5] * (text_limit + 1)}, "tokens"),
    ]


def test_each_costly_field_has_a_limit(server, text_limit: int) -> None:
    with server.client() as http:
        for path, body, param in limit_cases(text_limit):
            error = check_error(http.post(path, json=body), 400, param)
            assert "at most" in error["message"], error
    assert_healthy(server)


def test_requests_at_the_limits_are_served(server, text_limit: int) -> None:
    stops = ["\x00" * (MAX_STOP_CHARS - 1) + chr(0x100 + i) for i in range(MAX_STOP)]
    with server.client() as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stop": stops,
                                               "stop_token_ids": [10 + i % 100 for i in range(MAX_STOP_TOKEN_IDS)]})
        assert r.status_code == 200, r.text
        r = http.post("/tokenize", json={"prompt": "h" * text_limit})
        assert r.status_code == 200 and r.json()["count"] > 0
    assert_healthy(server)


# ---------------------------------------------------------------- item 7: lone surrogates

SURROGATE_CASES = [
    # (path, raw body, the param the 400 must name)
    ("/v1/completions", rb'{"prompt": "a\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", rb'{"prompt": ["ok", "\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", rb'{"prompt": "hi", "stop": ["\ude00"]}', "stop"),
    ("/v1/completions", rb'{"model": "\ud800", "prompt": "hi"}', "model"),
    ("/v1/completions", b'{"model": "\xed\xb0\x80", "prompt": "hi"}', "model"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\udbff"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\xed\xa0\x80"}]}]}',
     "messages"),
    ("/tokenize", rb'{"prompt": "\ud800"}', "prompt"),
    ("/tokenize", b'{"prompt": "\xed\xa0\x80"}', "prompt"),
    ("/tokenize", rb'{"messages": [{"role": "user", "content": "x\ud800"}]}', "messages"),
    ("/detokenize", rb'{"tokens": [5], "model": "\ud800"}', "model"),
]


@pytest.mark.parametrize("path,raw,param", SURROGATE_CASES, ids=[f"{i}{c[0]}-{c[2]}" for i, c in enumerate(SURROGATE_CASES)])
def test_lone_surrogates_are_400_naming_the_field(server, path: str, raw: bytes, param: str) -> None:
    with server.client() as http:
        error = check_error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400, param,
                            "surrogate")
        assert error["code"] == "invalid_value"
    assert_healthy(server)


def test_a_surrogate_in_a_field_name_is_400_and_pairs_are_text(server) -> None:
    with server.client() as http:
        error = check_error(http.post("/v1/completions", content=rb'{"prompt": "hi", "\ud800": 1}',
                                      headers={"content-type": "application/json"}), 400, contains="surrogate")
        assert error["param"] is None
        # an escaped pair is one character (U+1F600), not a lone surrogate; an escaped backslash is no escape
        r = http.post("/tokenize", content=rb'{"prompt": "\ud83d\ude00 and \\ud800"}',
                      headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        text = http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
        assert text == "\U0001F600 and \\ud800"
    assert_healthy(server)


# ---------------------------------------------------------------- a client leaving mid-upload

def test_client_leaving_mid_upload_is_no_error(server, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pagedllm.server")
    host, port = server.url.removeprefix("http://").split(":")
    for path in ("/v1/completions", "/tokenize"):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         "Content-Length: 1000\r\n\r\n".encode() + b'{"prompt": "only part of')
            time.sleep(0.2)  # let the server start reading the body
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        left = [r for r in caplog.records if "left after sending" in r.getMessage()]
        if len(left) >= 2:
            break
        time.sleep(0.05)
    records = [r for r in caplog.records if r.name.startswith("pagedllm")]
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
    left = [r for r in records if "left after sending" in r.getMessage()]
    assert len(left) == 2 and all(r.levelno == logging.INFO and r.exc_info is None for r in left)
    assert_healthy(server)
