"""A rank killed mid-generation: the request in flight ends with an error, /health answers
503, the server exits non-zero within seconds, and no rank process is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import psutil
import pytest

from tests._uvicorn import wait_healthy
from tests.server.test_shutdown import stream_lines
from tests.test_cli import free_port

LONG = 4000


@pytest.mark.slow
def test_killed_rank_fails_the_server_fast_and_leaves_no_orphans(tiny_model_dir: Any) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model = tiny_model_dir("llama", max_position_embeddings=LONG + 192)
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "serve", str(model), "--port", str(port),
                             "--kv-cache-memory", "8M", "--served-model-name", "tiny", "--dtype", "float32",
                             "-tp", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    server = psutil.Process(proc.pid)
    try:
        wait_healthy(proc, url)
        # the rank process: spawned by multiprocessing (its resource tracker is not a rank)
        ranks = [p for p in server.children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 1, f"expected one rank process beside the server, found {ranks}"
        rank = ranks[0]
        out: dict[str, Any] = {}
        first = threading.Event()
        reader = threading.Thread(target=stream_lines, args=(url, {"model": "tiny", "prompt": "hello",
                                                                   "max_tokens": LONG, "ignore_eos": True},
                                                             out, first))
        reader.start()
        assert first.wait(60), "the stream never started"
        descendants = server.children(recursive=True)
        rank.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        saw_503 = False
        while proc.poll() is None and time.monotonic() - killed_at < 30:
            try:
                saw_503 |= httpx.get(url + "/health", timeout=2).status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        exited_after = time.monotonic() - killed_at
        reader.join(timeout=30)
        log = proc.stdout.read() if proc.poll() is not None else ""
        assert proc.returncode not in (None, 0), f"the server must exit non-zero, got {proc.returncode}\n{log[-3000:]}"
        assert exited_after < 15, f"the server took {exited_after:.1f}s to exit after a rank died"
        assert saw_503, "/health never answered 503 while the engine was dead"
        assert "rank 1" in log, "the log should name the rank that died"
        assert any("error" in line for line in out.get("lines", [])) or "error" in out, \
            f"the stream in flight must end with an error: {out.get('lines', [])[-3:]}"
        time.sleep(1)
        alive = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"processes left behind: {[p.pid for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()
