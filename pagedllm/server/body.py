"""Reading a request body without stalling the event loop.

The event loop answers every client (health checks, every stream), so no request's CPU
work runs on it: parsing a body (and everything the endpoints do with it: field checks,
tokenizing, templates) runs on a small bounded pool of request workers (`off_loop`). A
string holding a lone UTF-16 surrogate (a JSON escape such as "\\ud800", or the bytes
ED A0 80) is no text at all: the body is refused as it is read, naming the top-level field.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, TypeVar

from starlette.requests import ClientDisconnect, Request

from pagedllm.server.errors import APIError

logger = logging.getLogger("pagedllm.server")

REQUEST_WORKERS = min(16, max(4, os.cpu_count() or 1))  # threads for requests' CPU work

T = TypeVar("T")
_WORKERS = ThreadPoolExecutor(max_workers=REQUEST_WORKERS, thread_name_prefix="pagedllm-request")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads keeps unpaired ones as they are
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape that may be one


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a request worker thread, so that the event loop keeps answering while
    one request parses, tokenizes or renders a template. The pool is bounded: a burst of
    heavy requests queues for it rather than starting a thread each. Pure-Python work
    hands the GIL back every few milliseconds and the tokenizers release it; json.loads
    does not (about 20 ms per MB of small numbers), so the body size limit bounds that."""
    return await asyncio.get_running_loop().run_in_executor(_WORKERS, fn, *args)


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object; 413 past `max_bytes`, 400 if not JSON (see `parse_json`).

    The size is checked while reading, so a client that lies in Content-Length (or
    sends none) still cannot make the server buffer more than `max_bytes`. A client that
    leaves before sending the whole body is logged at info level and gets a 499, which
    reaches nobody: uvicorn drops what is sent on a closed connection.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise APIError(f"the request body is {declared} bytes, more than the {max_bytes} allowed",
                       413, code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise APIError(f"the request body is more than the {max_bytes} bytes allowed",
                               413, code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        logger.info("%s %s: the client left after sending %d bytes of the body", request.method,
                    request.url.path, size)
        raise APIError("the client closed the connection before sending the whole body", 499,
                       code="client_closed_request") from None
    return await off_loop(parse_json, b"".join(chunks))


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; 400 if it is not one, or if a string in it holds a
    lone surrogate (param: the top-level field it is in; none when it is in a field name)."""
    if not raw.strip():
        raise APIError("the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise APIError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_json")
    if raw.isascii() and not _SURROGATE_ESCAPE.search(raw):
        return data  # no string in it can hold a surrogate: skip the walk
    for key, value in data.items():
        if _LONE_SURROGATE.search(key):
            raise APIError("a field name in the request body holds a lone UTF-16 surrogate (U+D800 to "
                           "U+DFFF), which is not a character; send valid Unicode", code="invalid_value")
        if _has_lone_surrogate(value):
            raise APIError(f"'{key[:80]}' holds a lone UTF-16 surrogate (U+D800 to U+DFFF, as the JSON escape "
                           "\\ud800 or the bytes ED A0 80), which is not a character; send valid Unicode",
                           param=key, code="invalid_value")
    return data


def _has_lone_surrogate(value: Any) -> bool:
    """Whether a string anywhere in a parsed JSON value holds an unpaired surrogate (a paired
    escape such as \\ud83d\\ude00 is decoded to its character, so any left is lone)."""
    return any(_LONE_SURROGATE.search(text) for text in strings(value))


def strings(value: Any, keys: bool = True) -> Iterator[str]:
    """Every string in a parsed JSON value, object keys too unless `keys` is False."""
    stack = [value]
    while stack:  # not recursive: JSON nests as deep as json.loads allows
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if keys:
                stack.extend(item)
            stack.extend(item.values())
