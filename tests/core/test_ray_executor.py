"""The Ray executor: a local Ray cluster started by the test (`ray start --head`), TP=2
with `distributed_executor_backend="ray"` (rank 1 a Ray actor), the same tokens as
transformers; the test stops the cluster."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pagedllm import LLM
from test_llm import assert_parity, make_prompts, reference, run_engine
from tests.test_cli import free_port


def _ray_cli() -> str:
    found = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    if not os.path.exists(found):
        pytest.fail("the `ray` command is missing: pip install 'ray>=2.40' (make install does)")
    return found


@pytest.fixture
def ray_cluster(monkeypatch):
    pytest.importorskip("ray", reason="Ray is installed by `make install` (the test extra)")
    ray_cmd = _ray_cli()
    port = free_port()
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    subprocess.run([ray_cmd, "start", "--head", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
                    "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats"],
                   check=True, env=env, capture_output=True, timeout=180)
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    try:
        yield
    finally:
        import ray

        ray.shutdown()
        subprocess.run([ray_cmd, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_tensor_parallel_over_ray(ray_cluster, tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prompts = make_prompts(seed=6, lens=[11, 35])
    llm = LLM(str(model_dir), dtype="float32", device="cpu", kv_cache_memory=1 << 22,
              tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert type(llm.engine.executor).__name__ == "RayExecutor"
        assert_parity(run_engine(llm, prompts), reference(model_dir, prompts))
    finally:
        llm.engine.shutdown()
