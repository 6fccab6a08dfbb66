"""`pagedllm bench compare`: pagedllm and its peers on one workload, one table.

Honesty rules this module keeps:

- every engine gets the same prompt token ids (built once here, sent as ids;
  llama.cpp's server takes text only, so it gets their decoded text);
- no phase reuses a prompt, so a prefix cache never turns a repeat into a free
  prefill (see `Workload`);
- vLLM computes on all cores like everyone else (VLLM_CPU_NUM_OF_RESERVED_CPU=0)
  and in fp32 where the CPU has no native bf16 (--vllm-dtype auto);
- engines run one after the other, each in its own subprocess (its own venv for
  vLLM and llama.cpp) with a timeout, so one cannot slow or crash another;
- a peer that is not installed is reported as such, never estimated; a peer that
  fails or times out shows the error and whatever it measured before;
- how each engine batched (continuous batching, `generate()` batch, llama.cpp
  multi-sequence batch or sequential) is printed next to its numbers.

Which engines exist and how to run them is `peers.py`. Offline phases come from
`runners/_protocol.py` (start-up to first token, batched, single stream). Where an engine has an OpenAI server (pagedllm, vLLM, llama.cpp)
the serve workload then starts it on 127.0.0.1 and runs `bench serve` against it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.bench.peers import (ALL_ENGINES, EngineSpec, cpu_has_native_bf16, engine_specs,
                                  resolve_hf_model)
from pagedllm.bench.probe import machine_speed
from pagedllm.bench.serve import benchmark, completions_url, request_payload, stream_one
from pagedllm.bench.workload import BenchRequest, random_requests, special_ids, vocab_size_of
from pagedllm.engine_args import add_engine_args, engine_kwargs_from_args
from pagedllm.ops.cpu import features

RUNNERS = Path(__file__).parent / "runners"


@dataclass
class EngineResult:
    name: str
    status: str = "ok"
    offline: dict[str, Any] = field(default_factory=dict)
    serve: dict[str, Any] = field(default_factory=dict)
    serve_status: str = ""
    log: str = ""
    probe: dict[str, Any] = field(default_factory=dict)  # {"offline"|"serve": machine_speed()} before each phase


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=32, help="Prompts in the batched and serve runs.")
    g.add_argument("--input-len", type=int, default=128, help="Prompt length in tokens.")
    g.add_argument("--output-len", type=int, default=64, help="Tokens generated per prompt (EOS ignored).")
    g.add_argument("--single-stream-prompts", type=int, default=4,
                   help="Prompts run one at a time for the single-stream rate (0: skip).")
    g.add_argument("--repeat", type=int, default=1,
                   help="Run the batched and single-stream phases N times and keep the fastest "
                        "(helps on a shared machine).")
    p = parser.add_argument_group("peers")
    p.add_argument("--engines", default=",".join(ALL_ENGINES),
                   help=f"Comma-separated subset of: {', '.join(ALL_ENGINES)}.")
    p.add_argument("--peers-dir", default=os.environ.get("PAGEDLLM_PEERS_DIR", ".peers"),
                   help="Where scripts/setup_peers.sh put the peers' venvs (default .peers).")
    p.add_argument("--hf-model", default=None,
                   help="Safetensors model for vLLM and transformers (default: PEERS_DIR/smollm2-hf, "
                        "made from --gguf on first use).")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the bundled SmolLM2 GGUF).")
    p.add_argument("--vllm-dtype", default="auto",
                   help="vLLM's dtype; auto: bfloat16 where the CPU has native bf16 (AVX512-BF16/AMX), "
                        "else float32.")
    p.add_argument("--hf-batch-size", type=int, default=None, help="transformers generate() batch (default: all).")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads for llama.cpp (its default is half the cores).")
    p.add_argument("--timeout", type=float, default=900.0, help="Seconds per engine and phase before it is killed.")
    p.add_argument("--serve", action=argparse.BooleanOptionalAction, default=True,
                   help="Also run the serve workload on engines with a server (default: yes).")
    p.add_argument("--serve-concurrency", type=int, default=None,
                   help="Max requests in flight in the serve run (default: --num-prompts).")
    p.add_argument("--output-json", default=None, help="Write every engine's results here.")
    p.add_argument("--log-dir", default=None, help="Keep the engines' logs here (default: a temp dir).")
    add_engine_args(parser)


# ------------------------------------------------------------------ running


def _kill_tree(proc: subprocess.Popen) -> None:
    """Stop a child we started and everything it spawned (its own process group)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])


@dataclass
class Workload:
    """Every prompt of a comparison, each used once: a warm-up prompt, `repeat` batched
    sets and `repeat` single-stream sets for the offline runs, and the serve set."""

    warmup: BenchRequest
    batched_sets: list[list[BenchRequest]]
    single_sets: list[list[BenchRequest]]
    serve: list[BenchRequest]

    @classmethod
    def build(cls, args: argparse.Namespace, vocab_size: int, seed: int, exclude: list[int]) -> "Workload":
        n, k, r = args.num_prompts, args.single_stream_prompts, max(1, args.repeat)
        pool = random_requests(1 + r * (n + k) + n, args.input_len, args.output_len, vocab_size, seed, exclude)
        it = iter(pool)

        def take(count: int) -> list[BenchRequest]:
            return [next(it) for _ in range(count)]

        return cls(next(it), [take(n) for _ in range(r)], [take(k) for _ in range(r)] if k else [], take(n))


def run_offline(spec: EngineSpec, work_load: Workload, args: argparse.Namespace, work: Path) -> EngineResult:
    """Run one engine's runner in a subprocess, bounded by --timeout."""
    result = EngineResult(spec.name)
    if spec.python is None:
        result.status = spec.missing
        return result
    def ids(reqs: list[BenchRequest]) -> list[list[int]]:
        return [r.prompt_token_ids for r in reqs]

    job = {**spec.job, "output_len": args.output_len, "warmup_prompt": work_load.warmup.prompt_token_ids,
           "batched_sets": [ids(s) for s in work_load.batched_sets],
           "single_sets": [ids(s) for s in work_load.single_sets]}
    job_path, result_path, log_path = (work / f"{spec.name}.{ext}" for ext in ("job.json", "result.json", "log"))
    result.log = str(log_path)
    env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
    print(f"[{spec.name}] offline run ({args.num_prompts} prompts x {args.output_len} tokens; log {log_path})",
          flush=True)
    with open(log_path, "w") as log:
        job["spawn_time"] = time.time()
        job_path.write_text(json.dumps(job))
        proc = subprocess.Popen([spec.python, str(RUNNERS / spec.runner), str(job_path), str(result_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            result.status = f"timed out after {args.timeout:.0f} s"
    if result_path.exists():
        result.offline = json.loads(result_path.read_text())
    if result.status == "ok" and proc.returncode != 0:
        err = result.offline.get("error") or _tail(log_path)
        result.status = f"failed in {result.offline.get('phase', 'start-up')}: {err}"
    elif result.status != "ok" and result.offline:
        result.status += f" (during {result.offline.get('phase')})"
    return result


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_ready(base_url: str, proc: subprocess.Popen, timeout: float) -> str:
    """Poll GET /v1/models until the server answers, exits, or the timeout passes;
    returns the first model id it serves (what requests must name)."""
    import httpx

    deadline = time.perf_counter() + timeout
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        while time.perf_counter() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
            try:
                resp = await client.get(base_url + "/v1/models")
                if resp.status_code == 200:
                    return resp.json()["data"][0]["id"]
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"the server was not ready within {timeout:.0f} s")


def run_serve_phase(spec: EngineSpec, result: EngineResult, probe: tuple[BenchRequest, str],
                    requests: list[BenchRequest], texts: list[str], args: argparse.Namespace,
                    work: Path) -> None:
    """Start the engine's server on 127.0.0.1, time its first token, run the load, stop it."""
    if spec.python is None:
        return
    if spec.server_cmd is None:
        result.serve_status = spec.server_note or "no server"
        return
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [c.replace("{port}", str(port)) for c in spec.server_cmd]
    log_path = work / f"{spec.name}.serve.log"
    print(f"[{spec.name}] serve run on {base_url} (log {log_path})", flush=True)
    env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        spawn = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            send = texts if spec.send_text else None

            async def go() -> dict[str, Any]:
                model_name = await _wait_ready(base_url, proc, args.timeout)
                # EOS ignored, as in the load: a model that ends random ids at once (Qwen2.5
                # does) would stream no text, and its start-up would go unmeasured
                payload = request_payload(model_name, BenchRequest(probe[0].prompt_token_ids, 2),
                                          probe[1] if send else None)
                first = await stream_one(completions_url(base_url), payload, probe[0].prompt_len,
                                         timeout=args.timeout)
                if not first.success:
                    raise RuntimeError(f"first request failed: {first.error}")
                startup = first.chunk_times[0] - spawn
                out = await asyncio.wait_for(
                    benchmark(base_url, model_name, requests, send, math.inf,
                              args.serve_concurrency or len(requests), getattr(args, "seed", 0), args.timeout,
                              test_request=False), args.timeout)
                out["startup_to_first_token_s"] = startup
                return out

            result.serve = asyncio.run(go())
            result.serve_status = "ok" if result.serve["failed"] == 0 else f"{result.serve['failed']} failed"
        except Exception as exc:
            result.serve_status = f"failed: {type(exc).__name__}: {exc} | {_tail(log_path)}"
        finally:
            _kill_tree(proc)


# ------------------------------------------------------------------ reporting


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    if not ours or not theirs:
        return "-"
    return f"{ours / theirs:.2f}x"


def _get(node: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def table(results: list[EngineResult]) -> str:
    """A markdown table: one row per engine, ratios are pagedllm / that engine."""
    by_name = {r.name: r for r in results}
    ours = by_name.get("pagedllm") or EngineResult("pagedllm")

    head = ["engine", "mode", "batched out tok/s", "paged/peer", "single-stream tok/s", "paged/peer",
            "start-up to 1st token (s)", "serve out tok/s", "paged/peer", "serve TTFT p50 (ms)",
            "serve TPOT p50 (ms)", "serve start-up to 1st token (s)", "machine GFLOP/s before (offline / serve)",
            "status"]
    rows = [head, ["---"] * len(head)]
    for r in results:
        info = r.offline.get("info", {}) if r.offline else {}
        mode = f"{info.get('dtype', '')}, {info.get('mode', '')}".strip(", ") if info else ""
        batched = _get(r.offline, "batched", "output_tok_s")
        single = _get(r.offline, "single_stream", "output_tok_s")
        serve_tps = _get(r.serve, "output_throughput")
        status = r.status if r.status != "ok" else "ok"
        if r.serve_status and r.serve_status != "ok":
            status += f"; serve: {r.serve_status}"
        for label, got, want in (("", _get(r.offline, "batched", "output_tokens"),
                                  _get(r.offline, "batched", "expected_output_tokens")),
                                 ("serve ", _get(r.serve, "total_output_tokens"),
                                  _get(r.serve, "expected_output_tokens"))):
            if got is not None and want and got != want:
                status += f"; {label}generated {got} of {want} tokens"
        rows.append([
            r.name, mode, _fmt(batched), _ratio(_get(ours.offline, "batched", "output_tok_s"), batched),
            _fmt(single), _ratio(_get(ours.offline, "single_stream", "output_tok_s"), single),
            _fmt(_get(r.offline, "startup_to_first_token_s"), 2), _fmt(serve_tps),
            _ratio(_get(ours.serve, "output_throughput"), serve_tps),
            _fmt(_get(r.serve, "p50_ttft_ms")), _fmt(_get(r.serve, "p50_tpot_ms")),
            _fmt(_get(r.serve, "startup_to_first_token_s"), 2),
            f"{_fmt(_get(r.probe, 'offline', 'gflops'))} / {_fmt(_get(r.probe, 'serve', 'gflops'))}",
            status.replace("|", "/"),
        ])
    return "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in rows)


def prompt_tokenizer(source: str | None) -> Any:
    """The tokenizer that draws and decodes the prompts: a Hugging Face directory's, or a
    .gguf file's own (pagedllm against llama.cpp on a GGUF needs no HF directory)."""
    if source is not None and Path(source).is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source)
    if source is not None and Path(source).is_file() and source.endswith(".gguf"):
        from pagedllm.plugins.quant.gguf import GGUFFormat

        return GGUFFormat(source).tokenizer()
    raise ValueError("compare needs a tokenizer for the prompts: give --hf-model, or a --model that is a "
                     "Hugging Face directory or a .gguf file")


def run_compare(args: argparse.Namespace) -> dict[str, Any]:
    """Build the prompts, run every engine in turn, print the table and write the JSON."""
    from pagedllm.core.config import default_model

    peers_dir = Path(args.peers_dir)
    seed = getattr(args, "seed", 0)  # the engine's --seed also seeds the prompts
    kwargs = engine_kwargs_from_args(args)
    if not kwargs.get("plugin_options"):
        kwargs.pop("plugin_options", None)
    wanted = {e.strip() for e in args.engines.split(",")}
    try:
        gguf = args.gguf or default_model()
    except ValueError:
        gguf = None
    needs_hf = bool(wanted & {"vllm", "transformers-bf16", "transformers-fp32"}) or args.hf_model is not None
    hf_model = resolve_hf_model(args, peers_dir) if needs_hf else None
    max_len = args.input_len + args.output_len + 16
    specs = engine_specs(args, hf_model or "", gguf, max_len, kwargs)
    work_load: Workload | None = None
    texts: list[str] = []
    if any(spec.python is not None for spec in specs):  # else there is nothing to prompt
        tokenizer = prompt_tokenizer(hf_model or kwargs.get("model"))
        work_load = Workload.build(args, vocab_size_of(tokenizer), seed, special_ids(tokenizer))
        texts = [tokenizer.decode(r.prompt_token_ids) for r in [work_load.warmup, *work_load.serve]]
    work = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="pagedllm-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for spec in specs:
        if work_load is None:  # nothing is installed: report, run nothing
            results.append(EngineResult(spec.name, status=spec.missing))
            continue
        probe = machine_speed() if spec.python is not None else None
        res = run_offline(spec, work_load, args, work)
        if probe:
            res.probe["offline"] = probe
        if args.serve and spec.python is not None:
            res.probe["serve"] = machine_speed()
            run_serve_phase(spec, res, (work_load.warmup, texts[0]), work_load.serve, texts[1:], args, work)
        results.append(res)
    print()
    print(f"Workload: {args.num_prompts} prompts x {args.input_len} input + {args.output_len} output tokens "
          f"(random ids, seed {seed}, greedy, EOS ignored); single stream: first "
          f"{args.single_stream_prompts} prompts one at a time; best of {args.repeat}; {os.cpu_count()} CPUs"
          f"{'' if cpu_has_native_bf16() else ' without native bf16 (bf16 rows are emulated)'}.")
    print(f"CPU: {features.machine().summary()}")
    if features.max_isa() != "native":
        print(f"PAGEDLLM_CPU_MAX_ISA={features.max_isa()} limits pagedllm's own kernels only; the peers use the "
              "whole CPU (torch's oneDNN follows ONEDNN_MAX_CPU_ISA).")
    print(table(results))
    out = {"workload": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                        "single_stream_prompts": args.single_stream_prompts, "seed": seed,
                        "repeat": args.repeat,
                        "cpu_count": os.cpu_count(), "cpu": features.machine().to_dict(),
                        "pagedllm_max_isa": features.max_isa()},
           "engines": [{"name": r.name, "status": r.status, "offline": r.offline, "serve_status": r.serve_status,
                        "serve": {k: v for k, v in r.serve.items() if k not in ("ttfts", "itls", "output_lens")},
                        "machine_probe": r.probe, "log": r.log} for r in results]}
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2, default=str)
        print(f"Results written to {args.output_json}")
    return out
