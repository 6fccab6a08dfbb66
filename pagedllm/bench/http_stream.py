"""A lean HTTP/1.1 client for one streamed POST per connection: `bench serve`'s load generator.

Why not httpx: the machines this engine is measured on often have two cores, and the
load generator runs on them beside the server it measures, so every microsecond it
spends on an event is taken from the server's steps. httpx's async transport and line
iterator took ~170 us of CPU per streamed event: for 32 SmolLM2 streams on a 2-vCPU
Xeon, ~20% of one core during the wave, and every engine measured that way looked
slower than it is (its steps' OpenMP threads were preempted). Reading the response
with asyncio's streams and splitting the lines here takes ~45 us per event, JSON
parsing included. A real deployment's clients run elsewhere; the lighter the load
generator, the closer a co-located benchmark gets to that.

What it does: one connection per request (`Connection: close`), http or https, a
chunked, length-delimited or close-delimited body, 1xx interim responses skipped. No
proxies, redirects or pooling: a load test against one server needs none of them.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from dataclasses import dataclass, field
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

MAX_HEADER_LINES = 100
READ_BYTES = 1 << 16


class HTTPProtocolError(Exception):
    """The server's response is not HTTP/1.x as this client reads it."""


@dataclass
class Target:
    """Where a URL points: the connection's end and the request target."""

    host: str
    port: int
    path: str
    tls: bool

    @classmethod
    def parse(cls, url: str) -> Target:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http:// or https:// URL, got {url!r}")
        tls = parts.scheme == "https"
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(parts.hostname, parts.port or (443 if tls else 80), path, tls)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        return host if self.port == (443 if self.tls else 80) else f"{host}:{self.port}"


@dataclass
class Response:
    """A response whose body has not been read yet."""

    status: int
    headers: dict[str, str]  # names lower-cased; a repeated header keeps its last value
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    _buffer: bytes = field(default=b"", repr=False)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, transfer coding removed."""
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await self.reader.readline()
                if not size_line:
                    raise HTTPProtocolError("the connection closed inside the chunked body")
                try:
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise HTTPProtocolError(f"bad chunk size line {size_line[:40]!r}") from None
                if size == 0:
                    while (await self.reader.readline()).strip():  # trailers, up to the blank line
                        pass
                    return
                data = await self.reader.readexactly(size + 2)  # the chunk and its CRLF
                yield data[:-2]
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left > 0:
                data = await self.reader.read(min(left, READ_BYTES))
                if not data:
                    raise HTTPProtocolError(f"the connection closed {left} bytes before the body's end")
                left -= len(data)
                yield data
        else:  # delimited by the connection's end
            while data := await self.reader.read(READ_BYTES):
                yield data

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines (LF or CRLF ended), decoded as UTF-8; a last unterminated line too."""
        async for data in self.chunks():
            self._buffer += data
            if b"\n" not in data:
                continue
            *complete, self._buffer = self._buffer.split(b"\n")
            for line in complete:
                yield line.rstrip(b"\r").decode("utf-8", "replace")
        if self._buffer:
            yield self._buffer.rstrip(b"\r").decode("utf-8", "replace")

    async def read(self) -> bytes:
        return b"".join([data async for data in self.chunks()])

    def close(self) -> None:
        self.writer.close()


async def post(url: str, payload: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    """Send `payload` as a JSON POST on a new connection and read the response's head.

    The caller reads the body from the result and must `close()` it."""
    target = Target.parse(url)
    context = ssl.create_default_context() if target.tls else None
    reader, writer = await asyncio.open_connection(target.host, target.port, ssl=context, limit=READ_BYTES)
    try:
        body = json.dumps(payload).encode()
        head = [f"POST {target.path} HTTP/1.1", f"Host: {target.host_header}", "Content-Type: application/json",
                "Accept: text/event-stream, application/json", f"Content-Length: {len(body)}", "Connection: close"]
        head += [f"{name}: {value}" for name, value in (headers or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        while True:
            status, response_headers = await _read_head(reader)
            if not 100 <= status < 200:
                return Response(status, response_headers, reader, writer)
    except BaseException:
        writer.close()
        raise


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise HTTPProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADER_LINES):
        line = await reader.readline()
        if line in (b"\r\n", b"\n"):
            return int(parts[1]), headers
        if not line:
            raise HTTPProtocolError("the connection closed inside the response's headers")
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep:
            raise HTTPProtocolError(f"bad header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    raise HTTPProtocolError(f"more than {MAX_HEADER_LINES} header lines")
