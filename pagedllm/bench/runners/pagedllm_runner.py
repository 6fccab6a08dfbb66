"""Times pagedllm's offline `LLM` API (greedy, EOS ignored) for `bench compare`."""

from __future__ import annotations

from typing import Any

import _protocol


def load(job: dict) -> tuple[Any, dict]:
    import torch

    import pagedllm
    from pagedllm import LLM

    llm = LLM(**job.get("engine_kwargs", {}))
    worker = llm.engine.worker
    dtype = str(getattr(worker, "dtype", "?")).replace("torch.", "")
    if getattr(worker, "matmul_precision", "highest") == "medium":
        dtype += " (matmul precision medium: bf16 products where the CPU has them and they measure faster)"
    info = {"version": pagedllm.__version__, "model": llm.engine.model_path, "dtype": dtype,
            "torch_threads": torch.get_num_threads(), "mode": "continuous batching"}
    return llm, info


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[int]:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [len(o.outputs[0].token_ids) for o in outs]


if __name__ == "__main__":
    _protocol.run(load, generate)
