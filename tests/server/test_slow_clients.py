"""Slowloris: connections that send nothing, half a header or half a body are closed after
--header-timeout / --body-timeout (with a 408 where a request had begun), and past
--max-connections a request gets an OpenAI-shaped 503. Raw sockets to 127.0.0.1."""

from __future__ import annotations

import json
import socket
import time
from typing import Any, Iterator

import pytest

from pagedllm import cli
from pagedllm.server.app import ServerSettings
from pagedllm.server.limits import MAX_HEADER_BYTES
from tests.server._healthy import assert_healthy

TIMEOUT_S = 1.0
CLOSE_BOUND_S = 20.0  # generous: two loaded cores; the server is given TIMEOUT_S


@pytest.fixture(scope="module")
def server(start_server) -> Iterator[Any]:
    settings = ServerSettings(header_timeout=TIMEOUT_S, body_timeout=TIMEOUT_S, keep_alive_timeout=TIMEOUT_S)
    with start_server(settings) as live:
        yield live


def connect(server: Any) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=CLOSE_BOUND_S)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection; fails if it is still
    open after CLOSE_BOUND_S."""
    deadline = time.monotonic() + CLOSE_BOUND_S
    data = b""
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"the server kept the connection open for {CLOSE_BOUND_S} s (sent {data[:200]!r})"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def error_of(response: bytes, status: int) -> dict[str, Any]:
    """The OpenAI error object of a raw HTTP response with `status`."""
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), response[:300]
    assert b"connection: close" in head.lower(), head
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_connection_that_sends_nothing_is_closed(server) -> None:
    with connect(server) as sock:
        assert read_until_closed(sock) == b""
    assert_healthy(server)


def test_half_a_header_line_gets_408_and_is_closed(server) -> None:
    with connect(server) as sock:
        sock.sendall(b"POST /tokenize HTT")
        error = error_of(read_until_closed(sock), 408)
    assert error["code"] == "request_timeout" and "--header-timeout" in error["message"]
    assert_healthy(server)


def test_headers_sent_slowly_are_closed_at_the_deadline(server) -> None:
    """A header line every half second: each byte is progress, but the whole block has a deadline."""
    with connect(server) as sock:
        sock.sendall(b"POST /tokenize HTTP/1.1\r\n")
        start = time.monotonic()
        closed = False
        for i in range(int(CLOSE_BOUND_S / 0.5)):
            try:
                sock.sendall(f"X-Slow-{i}: a\r\n".encode())
            except OSError:
                closed = True
                break
            sock.settimeout(0.5)
            try:
                if sock.recv(65536) == b"":
                    closed = True
                    break
            except socket.timeout:
                pass
            except OSError:  # a reset: the server closed while a header line was on its way
                closed = True
                break
        assert closed, f"still open after {time.monotonic() - start:.0f} s of trickled headers"
    assert_healthy(server)


def test_half_a_body_gets_408_and_is_closed(server) -> None:
    with connect(server) as sock:
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 200\r\n\r\n{\"prompt\": \"only a part")
        error = error_of(read_until_closed(sock), 408)
    assert error["code"] == "request_timeout" and "--body-timeout" in error["message"]
    assert_healthy(server)


def test_half_a_header_on_a_kept_alive_connection_is_closed(server) -> None:
    """After a first request, the next one's headers have the same deadline (uvicorn stops its
    keep-alive timer at the first byte of the next request)."""
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b"\r\n\r\n" not in first:
            chunk = sock.recv(65536)
            assert chunk, "closed before answering"
            first += chunk
        assert first.startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /hea")
        error = error_of(read_until_closed(sock), 408)
    assert error["code"] == "request_timeout"
    assert_healthy(server)


@pytest.mark.parametrize("request_bytes", [
    b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1) + b"\r\n\r\n",
    b"\x16\x03\x01 not http at all\r\n\r\n",
], ids=["headers-over-16KiB", "not-http"])
def test_what_is_not_http_gets_an_openai_shaped_400(server, request_bytes: bytes) -> None:
    with connect(server) as sock:
        sock.sendall(request_bytes)
        error = error_of(read_until_closed(sock), 400)
    assert error["code"] == "invalid_http"
    assert_healthy(server)


def test_connections_past_the_cap_get_503(start_server) -> None:
    with start_server(ServerSettings(max_connections=2, header_timeout=60)) as live:
        held = [connect(live), connect(live)]
        try:
            with connect(live) as extra:
                extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                error = error_of(read_until_closed(extra), 503)
            assert error["code"] == "too_many_connections" and error["type"] == "server_error"
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + CLOSE_BOUND_S
        while True:  # the server sees the two close a moment later
            try:
                assert_healthy(live)
                break
            except AssertionError:
                assert time.monotonic() < deadline, "no connection was accepted after the others closed"
                time.sleep(0.1)


@pytest.mark.parametrize("flag", ["--header-timeout", "--body-timeout", "--keep-alive-timeout",
                                  "--max-connections", "--stream-stall-timeout", "--shutdown-timeout"])
def test_limits_out_of_range_exit_2_naming_the_flag(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        cli.main(["serve", "/some/model", flag, "-1"])
    assert exc_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err
