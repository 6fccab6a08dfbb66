"""The measurement every runner shares, so all engines are timed the same way.

A job (JSON) gives the prompt token ids, output length and engine options; the
runner supplies `load(job) -> (handle, info)` and `generate(handle, prompts,
max_tokens) -> output token counts`. Phases, in order:

1. load the model (timed);
2. the warm-up prompt for one token: `startup_to_first_token_s` is measured from
   the moment the parent spawned this process (`job["spawn_time"]`, wall clock),
   so it includes interpreter start, imports, load and the first forward pass;
3. batched: every prompt of a set in one call, `output_len` tokens each (EOS ignored);
4. single stream: the prompts of a (small) set one after another.

Phases 3 and 4 run once per prompt set (`--repeat`) and report the fastest run
(all times are kept): on a shared machine it is the one least disturbed by
others. Every phase gets prompts no earlier phase has seen, so an engine with a
prefix cache (pagedllm, vLLM) never gets a free prefill from a repeat.

The result file is rewritten after each phase, so a runner killed by the
parent's timeout still leaves what it measured. Standard library only.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Callable


def _rates(elapsed: float, prompts: list[list[int]], counts: list[int]) -> dict[str, Any]:
    out_tokens = sum(counts)
    in_tokens = sum(len(p) for p in prompts)
    return {
        "num_requests": len(prompts),
        "elapsed_s": elapsed,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "expected_output_tokens": None,
        "requests_per_s": len(prompts) / elapsed,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (in_tokens + out_tokens) / elapsed,
    }


def run(load: Callable[[dict], tuple[Any, dict]], generate: Callable[[Any, list[list[int]], int], list[int]]) -> None:
    """Entry point of every runner script: `runner.py JOB_JSON RESULT_JSON`."""
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    result: dict[str, Any] = {"ok": False, "phase": "load", "cpu_count": os.cpu_count()}

    def save() -> None:
        tmp = result_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        os.replace(tmp, result_path)

    try:
        output_len = int(job["output_len"])
        start = time.time()
        handle, info = load(job)
        result["load_s"] = time.time() - start
        result["info"] = info
        result["phase"] = "first token"
        save()
        generate(handle, [job["warmup_prompt"]], 1)
        result["startup_to_first_token_s"] = time.time() - float(job["spawn_time"])
        for phase, sets, one_call in (("batched", job["batched_sets"], True),
                                      ("single_stream", job.get("single_sets") or [], False)):
            result["phase"] = phase
            save()
            runs = []
            for prompts in sets:
                t0 = time.perf_counter()
                if one_call:
                    counts = generate(handle, prompts, output_len)
                else:
                    counts = [c for p in prompts for c in generate(handle, [p], output_len)]
                runs.append((time.perf_counter() - t0, prompts, counts))
            if runs:
                elapsed, prompts, counts = min(runs, key=lambda run: run[0])
                result[phase] = _rates(elapsed, prompts, counts)
                result[phase]["expected_output_tokens"] = output_len * len(prompts)
                result[phase]["all_elapsed_s"] = [run[0] for run in runs]
        result["phase"] = "done"
        result["ok"] = True
    except BaseException as exc:  # report, then still fail the process
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
        save()
        raise
    save()
