"""vLLM's multi-node flags on the mp backend, two "machines" on loopback: node 0 runs
`pagedllm serve -tp 2 --nnodes 2 --node-rank 0 --master-port P` (the server and rank 0),
node 1 `pagedllm serve -tp 2 --nnodes 2 --node-rank 1 --master-port P --headless` (rank 1
only). The pair answers as one engine does, and node 1 exits 0 when node 0 shuts down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from tests._uvicorn import wait_healthy
from tests.test_cli import free_port


@pytest.mark.slow
def test_two_nodes_serve_as_one(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    expected = LLM(model, dtype="float32", device="cpu", kv_cache_memory=1 << 22).generate(
        ["the cat sat"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    port, meet = free_port(), free_port()
    common = [sys.executable, "-m", "pagedllm.cli", "serve", model, "-tp", "2", "--nnodes", "2",
              "--master-port", str(meet), "--dtype", "float32", "--kv-cache-memory", "4M", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    head = subprocess.Popen(common + ["--node-rank", "0", "--port", str(port), "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    other = subprocess.Popen(common + ["--node-rank", "1", "--headless"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(head, url)
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "the cat sat", "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected.outputs[0].text
        head.send_signal(signal.SIGTERM)
        assert head.wait(timeout=60) == 0
        assert other.wait(timeout=60) == 0, other.stdout.read()[-3000:]
    finally:
        for proc in (head, other):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            proc.stdout.close()
