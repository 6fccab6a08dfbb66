"""Times Hugging Face transformers `generate` as the plain-PyTorch baseline.

Batched with left padding (the prompts of a batch must end at the same position for
decoder-only generation), greedy, and `min_new_tokens == max_new_tokens` so EOS
cannot end a sequence early. `batch_size` in the job splits the prompts into
batches (default: all at once). Runs in the project's venv, on the GPU where torch sees
one (as the engine it is compared with), else on the CPU.
"""

from __future__ import annotations

from typing import Any

import _protocol


def load(job: dict) -> tuple[Any, dict]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, job.get("dtype", "float32"))
    tok = AutoTokenizer.from_pretrained(job["model"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=dtype).to(device).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    handle = {"model": model, "pad": pad if pad is not None else 0, "batch_size": job.get("batch_size"),
              "device": device}
    info = {"version": transformers.__version__, "model": job["model"], "dtype": str(dtype), "device": device,
            "torch_threads": torch.get_num_threads(),
            "mode": f"generate(), left padding, batch size {job.get('batch_size') or 'all'}"}
    return handle, info


def generate(h: dict, prompts: list[list[int]], max_tokens: int) -> list[int]:
    import torch

    size = h["batch_size"] or len(prompts)
    counts: list[int] = []
    for i in range(0, len(prompts), size):
        chunk = prompts[i:i + size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[h["pad"]] * (width - len(p)) + p for p in chunk], device=h["device"])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=h["device"])
        with torch.inference_mode():
            out = h["model"].generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False, pad_token_id=h["pad"])
        counts += [out.shape[1] - width] * len(chunk)
    return counts


if __name__ == "__main__":
    _protocol.run(load, generate)
