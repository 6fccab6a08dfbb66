"""Plugins: a real third-party package found through its entry point, env-var selection,
the PAGEDLLM_PLUGINS filter, and lookups that name the alternatives."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.core.plugins import get_registry

FIXTURE = Path(__file__).parents[1] / "fixtures" / "third_party_plugin"

SCRIPT = """
import json, sys
import toy_pagedllm_plugin as toy
from pagedllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", device="cpu", kv_cache_memory=1 << 22)
out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print(json.dumps({"backend": llm.engine.worker.backend.name, "model": type(llm.engine.worker.model).__name__,
                  "calls": toy.CALLS["forward"], "tokens": out[0].outputs[0].token_ids}))
"""


def install_as_distribution(site: Path) -> None:
    """Lay the fixture package out as an installed distribution (package + .dist-info
    with entry_points.txt): exactly what pip would leave, found by importlib.metadata."""
    shutil.copytree(FIXTURE / "toy_pagedllm_plugin", site / "toy_pagedllm_plugin")
    info = site / "toy_pagedllm_plugin-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-pagedllm-plugin\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[pagedllm.plugins]\ntoy = toy_pagedllm_plugin\n")


@pytest.fixture
def toy_env(tmp_path, tiny_model_dir):
    site = tmp_path / "site"
    site.mkdir()
    install_as_distribution(site)
    model = tmp_path / "toy-model"
    shutil.copytree(tiny_model_dir("llama"), model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["ToyForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDLLM_", "VLLM_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    return env, model


def run(env, model):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model)], env=env, capture_output=True, text=True,
                          timeout=300)
    return proc


def test_third_party_plugin_selected_by_env_var(toy_env):
    env, model = toy_env
    env["VLLM_ATTENTION_BACKEND"] = "TOY"  # the vLLM alias works too
    proc = run(env, model)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["backend"] == "TOY" and result["model"] == "ToyForCausalLM"
    assert result["calls"] > 0 and len(result["tokens"]) == 4
    assert "from VLLM_ATTENTION_BACKEND" in proc.stderr


def test_plugin_filter_excludes_unlisted_plugins(toy_env):
    env, model = toy_env
    env["PAGEDLLM_PLUGINS"] = "attention,models"
    env["PAGEDLLM_ATTENTION_BACKEND"] = "TOY"
    proc = run(env, model)
    assert proc.returncode != 0
    assert "model architecture ['ToyForCausalLM'] is not supported" in proc.stderr


def test_builtin_registry_lists_all_kinds():
    registry = get_registry()
    assert "TORCH" in registry.attention_backends
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(registry.model_architectures)
    with pytest.raises(ValueError, match="unknown quantization 'nope'"):
        registry.quant_config("nope", {})
    with pytest.raises(ValueError, match="unknown speculative method"):
        registry.spec_method("nope")


def test_head_counts_are_checked_once_for_every_backend():
    import torch

    from pagedllm.core.contracts import AttentionSpec

    with pytest.raises(ValueError, match="num_heads 5 is not a multiple of num_kv_heads 2"):
        AttentionSpec(num_heads=5, num_kv_heads=2, head_size=64, dtype=torch.float32, kv_cache_dtype="auto",
                      block_size=16, device=torch.device("cpu"))


def test_op_set_up_runs_in_the_background_once_per_function(monkeypatch, caplog):
    """`start_preparing_ops` runs each distinct `OpImpl.prepare` once, with the engine's
    device, off the calling thread; one that fails is logged, not raised, and the others
    still run (the implementation's `check` reports what is wrong when it is asked)."""
    import logging
    import threading

    import torch

    from pagedllm.core.contracts import OpImpl

    calls = []

    def build(device):
        calls.append(("build", threading.current_thread().name, device))

    def broken(device):
        raise RuntimeError("no compiler here")

    def later(device):
        calls.append(("later", threading.current_thread().name, device))

    def fn(*args):
        return None

    def runs(device, dtype):
        return []

    impls = {"rms_norm": [OpImpl("rms_norm", "a", fn, runs, prepare=build), OpImpl("rms_norm", "b", fn, runs)],
             "silu_and_mul": [OpImpl("silu_and_mul", "a", fn, runs, prepare=build),
                              OpImpl("silu_and_mul", "c", fn, runs, prepare=broken),
                              OpImpl("silu_and_mul", "d", fn, runs, prepare=later)]}
    registry = get_registry()
    monkeypatch.setattr(registry, "op_impls", impls)
    with caplog.at_level(logging.DEBUG, logger="pagedllm"):
        thread = registry.start_preparing_ops(torch.device("cpu"))
        assert thread is not None and thread is not threading.current_thread()
        thread.join(10)
    cpu = torch.device("cpu")
    assert calls == [("build", "pagedllm-prepare-ops", cpu), ("later", "pagedllm-prepare-ops", cpu)]
    assert any("no compiler here" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(registry, "op_impls", {"rms_norm": [OpImpl("rms_norm", "b", fn, runs)]})
    assert registry.start_preparing_ops(cpu) is None, "nothing to set up: no thread"
