"""Graceful shutdown of a real `pagedllm serve`: on SIGTERM new requests get 503, a short
request in flight finishes, the long ones are ended after --shutdown-timeout (a stream with
an error event and [DONE], a whole response with a 503), and the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from tests._uvicorn import wait_healthy
from tests.test_cli import free_port

SHUTDOWN_TIMEOUT_S = 3
LONG = 8000  # tokens: far longer than the shutdown timeout, even on a fast machine


def stream_lines(url: str, body: dict[str, Any], out: dict[str, Any], first: threading.Event) -> None:
    """Read a stream's `data:` lines into out["lines"] (out["error"]: how reading failed)."""
    out["lines"] = []
    try:
        with httpx.Client(base_url=url, timeout=60) as http, \
                http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["lines"].append(line[len("data: "):])
                    first.set()
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    finally:
        first.set()


def whole(url: str, body: dict[str, Any], out: dict[str, Any], sent: threading.Event) -> None:
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            sent.set()
            r = http.post("/v1/completions", json=body)
            out["status"], out["body"] = r.status_code, r.json()
    except (httpx.HTTPError, ValueError) as exc:
        out["error"] = repr(exc)
    finally:
        sent.set()


def running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("pagedllm:num_requests_running"))
    return float(line.split()[-1])


@pytest.mark.slow
def test_sigterm_drains_then_ends_what_is_left_and_exits_0(tiny_model_dir: Any) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model = tiny_model_dir("llama", max_position_embeddings=LONG + 192)
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "serve", str(model), "--port", str(port),
                             "--kv-cache-memory", "32M", "--served-model-name", "tiny",
                             "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    threads: list[threading.Thread] = []
    try:
        wait_healthy(proc, url)
        long_body = {"model": "tiny", "prompt": "Hello", "max_tokens": LONG, "ignore_eos": True}
        long_stream: dict[str, Any] = {}
        long_whole: dict[str, Any] = {}
        short_stream: dict[str, Any] = {}
        events = [threading.Event() for _ in range(3)]
        threads = [threading.Thread(target=stream_lines, args=(url, long_body, long_stream, events[0])),
                   threading.Thread(target=whole, args=(url, long_body, long_whole, events[1]))]
        for t in threads:
            t.start()
        assert events[0].wait(60) and events[1].wait(60)
        deadline = time.monotonic() + 60
        while running(url) < 2:  # both long requests are generating
            assert time.monotonic() < deadline, "the long requests did not start"
            time.sleep(0.05)
        threads.append(threading.Thread(target=stream_lines, args=(
            url, {"model": "tiny", "prompt": "Hi", "max_tokens": 24, "ignore_eos": True}, short_stream, events[2])))
        threads[-1].start()
        assert events[2].wait(60)
        proc.send_signal(signal.SIGTERM)

        # New requests are refused while the others drain (the socket stays open meanwhile).
        deadline = time.monotonic() + 20
        with httpx.Client(base_url=url, timeout=10) as http:
            while True:
                r = http.get("/health")
                if r.status_code == 503:
                    break
                assert time.monotonic() < deadline, "new requests were still admitted"
                time.sleep(0.05)
        error = r.json()["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error"

        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive(), "a client got no end to its request"
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
        for t in threads:
            t.join(timeout=10)
    assert proc.returncode == 0, out[-3000:]

    # The short request in flight finished normally.
    assert short_stream.get("error") is None and short_stream["lines"][-1] == "[DONE]", short_stream
    finish = [json.loads(x)["choices"][0]["finish_reason"] for x in short_stream["lines"][:-1]]
    assert finish[-1] == "length" and "error" not in short_stream["lines"][-2]

    # The long stream: some text, then an error event and [DONE].
    lines = long_stream["lines"]
    assert long_stream.get("error") is None and long_stream["status"] == 200, long_stream.get("error")
    assert len(lines) >= 3 and lines[-1] == "[DONE]", lines[-3:]
    error = json.loads(lines[-2])["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "server_error", error
    assert all("error" not in json.loads(x) for x in lines[:-2])

    # The long whole response: a 503 in OpenAI's shape.
    assert long_whole.get("error") is None and long_whole["status"] == 503, long_whole
    assert set(long_whole["body"]["error"]) == {"message", "type", "param", "code"}
    assert long_whole["body"]["error"]["code"] == "server_shutting_down"
    assert "shutting down" in out
