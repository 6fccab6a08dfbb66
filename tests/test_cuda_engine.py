"""The engine on a CUDA GPU (marker `cuda`; skipped without one): what the CPU suite cannot show.

The transformers-parity suites themselves (plain, chunked prefill, prefix caching,
preemption, every speculative method, the quantized formats) run on a GPU unchanged with
`PAGEDLLM_TEST_DEVICE=cuda`, which scripts/gpu_check.sh sets. This module adds:

- bfloat16, the dtype a GPU serves in, against transformers in bfloat16 on the same GPU.
  Two bf16 implementations round differently, so neither is "the" answer: both are
  scored against transformers in float32, and ours must be about as close as
  transformers' own bf16 (greedy agreement and top-token logprob error), per backend;
- the memory plan that profiles the GPU (`gpu_memory_utilization`, no explicit KV budget)
  and gives the memory back at shutdown.
"""

from __future__ import annotations

import gc

import pytest
import torch

from pagedllm import LLM
from tests.conftest import report
from tests.test_llm import NUM_TOKENS, hf_greedy, make_prompts, reference, run_engine

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def closeness(outputs, fp32_ref) -> tuple[int, float]:
    """(prompts whose every greedy token equals float32 transformers', mean |logprob error|
    of the chosen token over the steps before each prompt's first different token)."""
    equal, errors = 0, []
    for got, (tokens, rows) in zip(outputs, fp32_ref):
        equal += got[0] == tokens
        for step, (token, want) in enumerate(zip(got[0], tokens)):
            if token != want:
                break
            errors.append(abs(got[1][step] - rows[step][token].item()))
    return equal, sum(errors) / max(1, len(errors))


def engine_rows(outputs) -> list[tuple[list[int], list[float]]]:
    rows = []
    for out in outputs:
        seq = out.outputs[0]
        rows.append((seq.token_ids, [step[t].logprob for t, step in zip(seq.token_ids, seq.logprobs)]))
    return rows


def hf_rows(results) -> list[tuple[list[int], list[float]]]:
    return [(tokens, [row[t].item() for t, row in zip(tokens, rows)]) for tokens, rows in results]


@pytest.mark.parametrize("backend", ["TRITON", "TORCH"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_is_as_close_to_float32_as_transformers_bf16(tiny_model_dir, arch, backend):
    model_dir = tiny_model_dir(arch)
    prompts = make_prompts()
    fp32 = reference(model_dir, prompts)
    theirs = closeness(hf_rows(hf_greedy(model_dir, prompts, dtype=torch.bfloat16, device="cuda")), fp32)
    llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", attention_backend=backend, kv_cache_memory=1 << 26)
    assert llm.engine.worker.backend.name == backend
    ours = closeness(engine_rows(run_engine(llm, prompts)), fp32)
    report(f"{arch} {backend}: prompts equal to float32 over {NUM_TOKENS} tokens, mean top-token logprob error: "
          f"ours {ours[0]}/{len(prompts)} {ours[1]:.4f}, transformers bf16 {theirs[0]}/{len(prompts)} {theirs[1]:.4f}")
    assert ours[0] >= theirs[0] - 1, f"bf16 greedy agreement with float32: ours {ours[0]}, transformers' {theirs[0]}"
    assert ours[1] <= 1.5 * theirs[1] + 0.01, f"bf16 logprob error: ours {ours[1]:.4f}, transformers' {theirs[1]:.4f}"


def test_memory_plan_profiles_the_gpu_and_shutdown_gives_it_back(tiny_model_dir):
    model_dir = tiny_model_dir("llama", max_position_embeddings=8192)
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    total = torch.cuda.mem_get_info()[1]
    # 4096 sequences of 8192 tokens would want ~8 GiB of this model's cache: 5% of the GPU binds.
    # The CUDA context, cuBLAS and Triton's modules count against it too (~0.85 GiB on an H200).
    llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.05, max_model_len=8192,
              max_num_seqs=4096)
    budget = llm.engine.worker.budget
    cache_bytes = sum(t.numel() * t.element_size() for t in llm.engine.worker.kv_caches)
    assert budget.num_blocks < 4096 * 8192 // 16, "the sequences' cap bound, not the utilization"
    assert cache_bytes <= 0.05 * total, f"the KV cache ({cache_bytes / 2**30:.2f} GiB) passes 5% of the GPU"
    assert cache_bytes >= 0.025 * total, f"the KV cache ({cache_bytes / 2**30:.2f} GiB) left most of its 5% unused"
    outputs = run_engine(llm, make_prompts()[:2])
    assert all(len(o.outputs[0].token_ids) == NUM_TOKENS for o in outputs)
    llm.shutdown()
    del llm, outputs
    gc.collect()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated() - before
    assert left < 64 << 20, f"{left / 2**20:.0f} MiB still allocated after shutdown"
