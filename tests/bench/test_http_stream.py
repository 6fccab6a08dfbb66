"""The load generator's own HTTP/1.1 client, against a raw socket server that answers with
exactly the bytes each test gives it (framings a real server may use, and broken ones)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable

import pytest

from pagedllm.bench import http_stream
from pagedllm.bench.serve import stream_one

Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[list[str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    length = next(int(h.split(":", 1)[1]) for h in head if h.lower().startswith("content-length:"))
    return head, await reader.readexactly(length)


def run_against(reply: bytes | Reply, client: Callable[[str], Awaitable[Any]]) -> tuple[Any, list[Any]]:
    """Serve one connection with `reply` (bytes written after the request is read, then
    close; or a coroutine given the streams) and run `client(url)` against it. Returns the
    client's result and the requests seen, as (head lines, body)."""
    seen: list[Any] = []
    handlers: list[asyncio.Task] = []

    async def main() -> Any:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                seen.append(await _read_request(reader))
                if isinstance(reply, bytes):
                    for piece in reply.split(b"|"):  # "|" marks where the server pauses between writes
                        writer.write(piece)
                        await writer.drain()
                        await asyncio.sleep(0.002)
                else:
                    await reply(reader, writer)
            except (ConnectionError, asyncio.CancelledError):
                pass  # the client stopped reading: what some tests check
            finally:
                writer.close()

        def start(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            handlers.append(asyncio.ensure_future(handle(reader, writer)))

        server = await asyncio.start_server(start, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            result = await client(f"http://127.0.0.1:{port}/v1/completions")
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
            return result

    return asyncio.run(main()), seen


def _chunked(*pieces: bytes) -> bytes:
    return b"|".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"|0\r\n\r\n"


def _events(*texts: str) -> list[bytes]:
    chunks = [b"data: " + json.dumps({"choices": [{"index": 0, "text": t}]}).encode() + b"\n\n" for t in texts]
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(texts)}}
    return chunks + [b"data: " + json.dumps(usage).encode() + b"\n\n", b"data: [DONE]\n\n"]


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"


def test_a_chunked_stream_is_timed_chunk_by_chunk_and_the_request_is_well_formed() -> None:
    reply = SSE_HEAD + b"transfer-encoding: chunked\r\n\r\n|" + _chunked(*_events("a", "b", "c"))
    timing, seen = run_against(reply, lambda url: stream_one(url, {"prompt": [1, 2, 3]}, 3, {"Authorization": "Bearer k"}))
    assert timing.success, timing.error
    assert len(timing.chunk_times) == 3 and timing.output_tokens == 3 and timing.prompt_tokens == 3
    head, body = seen[0]
    assert head[0] == "POST /v1/completions HTTP/1.1"
    assert "Authorization: Bearer k" in head and "Connection: close" in head
    assert any(h.startswith("Host: 127.0.0.1:") for h in head)
    assert json.loads(body) == {"prompt": [1, 2, 3]}


def test_chunk_extensions_trailers_crlf_lines_and_events_split_across_chunks() -> None:
    event = b'data: {"choices": [{"text": "x"}]}\r\n\r\n'
    body = _chunked(event[:7], event[7:] + event, b"data: [DONE]\r\n\r\n")
    body = body.replace(b"7\r\n", b"7;ext=1\r\n", 1)  # a chunk extension on the first size line
    body = body[: -len(b"0\r\n\r\n")] + b"0\r\nx-trailer: 1\r\n\r\n"
    timing, _ = run_against(SSE_HEAD + b"Transfer-Encoding: Chunked\r\n\r\n|" + body,
                            lambda url: stream_one(url, {}, 1))
    assert timing.success and len(timing.chunk_times) == 2


def test_length_and_close_delimited_bodies_and_interim_responses() -> None:
    events = b"".join(_events("a", "b"))
    for head in (b"HTTP/1.1 100 Continue\r\n\r\n" + SSE_HEAD + b"content-length: %d\r\n\r\n" % len(events),
                 SSE_HEAD + b"connection: close\r\n\r\n"):
        timing, _ = run_against(head + b"|" + events, lambda url: stream_one(url, {}, 1))
        assert timing.success and len(timing.chunk_times) == 2, (head, timing.error)


def test_an_error_status_is_recorded_with_the_servers_message() -> None:
    body = b'{"error": {"message": "model nope not found"}}'
    reply = b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    timing, _ = run_against(reply, lambda url: stream_one(url, {}, 1))
    assert not timing.success and timing.error.startswith("HTTP 404") and "model nope not found" in timing.error


def test_an_error_event_mid_stream_fails_the_request() -> None:
    events = _events("a")[:1] + [b'data: {"error": {"message": "engine died"}}\n\n']
    timing, _ = run_against(SSE_HEAD + b"transfer-encoding: chunked\r\n\r\n" + _chunked(*events),
                            lambda url: stream_one(url, {}, 1))
    assert not timing.success and "engine died" in timing.error


@pytest.mark.parametrize("reply, message", [
    (b"SSH-2.0-OpenSSH\r\n", "not an HTTP/1.x status line"),
    (SSE_HEAD + b"content-length: 500\r\n\r\ndata: [DO", "closed 491 bytes before the body's end"),
    (SSE_HEAD + b"transfer-encoding: chunked\r\n\r\nzz\r\n", "bad chunk size line"),
    (SSE_HEAD + b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n", "closed inside the chunked body"),
    (SSE_HEAD + b"no colon here\r\n\r\n", "bad header line"),
    (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n", "closed inside the response's headers"),
])
def test_broken_responses_fail_the_request_with_what_was_wrong(reply: bytes, message: str) -> None:
    timing, _ = run_against(reply, lambda url: stream_one(url, {}, 1))
    assert not timing.success and message in timing.error


def test_a_server_that_never_answers_times_out() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    timing, _ = run_against(silent, lambda url: stream_one(url, {}, 1, timeout=0.2))
    assert not timing.success and "within 0.2 s" in timing.error


def test_targets() -> None:
    assert http_stream.Target.parse("http://h/v1/x?y=1") == http_stream.Target("h", 80, "/v1/x?y=1", False)
    target = http_stream.Target.parse("https://[::1]:8443/v1")
    assert (target.host, target.port, target.tls, target.host_header) == ("::1", 8443, True, "[::1]:8443")
    assert http_stream.Target.parse("https://h/").host_header == "h"
    with pytest.raises(ValueError, match="http:// or https://"):
        http_stream.Target.parse("ftp://h/")
    timing = asyncio.run(stream_one("http://127.0.0.1:9/v1/completions", {}, 1))  # the discard port: refused
    assert not timing.success and timing.error


def test_chat_chunks_count_their_delta_content() -> None:
    chunk = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
    reply = SSE_HEAD + b"transfer-encoding: chunked\r\n\r\n" + _chunked(role, chunk, chunk, b"data: [DONE]\n\n")
    timing, _ = run_against(reply, lambda url: stream_one(url, {}, 1))
    assert timing.success and len(timing.chunk_times) == 2
