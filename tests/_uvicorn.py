"""Run an ASGI app under a real uvicorn on a free loopback port, in a thread, or wait for
a server subprocess to come up (test helpers)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def serve_in_thread(app: Any, start_timeout: float = 30.0, **options: Any) -> Iterator[str]:
    """Run `app` under uvicorn on a free port; yields the base URL, stops the server after.
    `options` are more `uvicorn.Config` arguments (e.g. `pagedllm.server.app.uvicorn_options`)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = {"log_level": "warning", "lifespan": "off", "timeout_graceful_shutdown": 2, **options}
    server = uvicorn.Server(uvicorn.Config(app, **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 90.0) -> None:
    """Poll `url`/health until it answers 200; a server that exits or does not come up
    in time is killed and the test fails with its output."""
    import httpx
    import pytest

    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=10) as http:
        while True:
            try:
                if http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"server did not start:\n{proc.communicate()[0]}")
            time.sleep(0.2)
