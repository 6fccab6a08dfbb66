"""End-to-end parity with Hugging Face transformers on tiny random models.

Every engine path (plain, chunked prefill, prefix caching, preemption) must give the
same greedy tokens as transformers' `generate`, with close logprobs.
"""

from __future__ import annotations

import inspect

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import TEST_DEVICE

NUM_TOKENS = 32
PROMPT_LENS = [3, 17, 40, 1, 64, 25, 9, 100]
LOGPROB_ATOL = 2e-3


def make_prompts(seed: int = 0, lens=PROMPT_LENS, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(2, 500) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(2, 500) for _ in range(n)] for n in lens]


def hf_greedy(model_dir, prompts, num_tokens=NUM_TOKENS, dtype=torch.float32, device="cpu"):
    """(tokens, per-step log-softmax rows on the CPU) from transformers, one prompt at a time.

    A plain argmax loop over the KV-cached forward: `generate(min_new_tokens=...)` would
    mask EOS, which is not what `ignore_eos` means.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    # transformers >= 5.24 calls the KV cache `cache` (`past_key_values` is deprecated)
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    results = []
    with torch.no_grad():
        for ids in prompts:
            out = model(torch.tensor([ids], device=device), use_cache=True)
            tokens, logprobs = [], []
            for _ in range(num_tokens):
                row = torch.log_softmax(out.logits[0, -1].float(), -1).cpu()
                token = int(row.argmax())
                tokens.append(token)
                logprobs.append(row)
                out = model(torch.tensor([[token]], device=device), use_cache=True,
                            **{cache_name: getattr(out, cache_name)})
            results.append((tokens, logprobs))
    return results


_HF_CACHE: dict = {}


def reference(model_dir, prompts):
    key = (str(model_dir), tuple(map(tuple, prompts)))
    if key not in _HF_CACHE:
        _HF_CACHE[key] = hf_greedy(model_dir, prompts)
    return _HF_CACHE[key]


def run_engine(llm: LLM, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_parity(outputs, ref):
    for i, (out, (tokens, hf_logprobs)) in enumerate(zip(outputs, ref)):
        got = out.outputs[0].token_ids
        assert got == tokens, f"prompt {i}: greedy tokens differ from transformers\n ours {got}\n hf   {tokens}"
        for step, (record, hf_row) in enumerate(zip(out.outputs[0].logprobs, hf_logprobs)):
            for token_id, lp in record.items():
                assert lp.logprob == pytest.approx(hf_row[token_id].item(), abs=LOGPROB_ATOL), (
                    f"prompt {i} step {step} token {token_id}: logprob differs from transformers")


def new_llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 1 << 24)
    return LLM(str(model_dir), dtype="float32", device=TEST_DEVICE, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "llama3-rope", "mistral", "qwen2", "qwen3"])
def test_greedy_parity(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    prompts = make_prompts()
    outputs = run_engine(new_llm(model_dir), prompts)
    assert_parity(outputs, reference(model_dir, prompts))
    assert [o.prompt_token_ids for o in outputs] == prompts, "generate must keep input order"


def test_outputs_are_not_degenerate(tiny_model_dir):
    """Guards the parity tests: a random model that repeats one token would prove nothing."""
    ref = reference(tiny_model_dir("llama"), make_prompts())
    assert all(len(set(tokens)) > 4 for tokens, _ in ref)


def test_chunked_prefill_parity(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prompts = make_prompts()
    llm = new_llm(model_dir, max_num_batched_tokens=16)
    outputs = run_engine(llm, prompts)
    assert_parity(outputs, reference(model_dir, prompts))
    assert llm.engine.stats.num_steps > NUM_TOKENS + sum(PROMPT_LENS) // 16 - 1


def test_prefix_caching_parity(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3")
    prompts = make_prompts(seed=1, lens=[5, 20, 33, 2], shared_prefix=70)
    llm = new_llm(model_dir)
    first = run_engine(llm, prompts[:1])
    rest = run_engine(llm, prompts[1:])
    assert_parity(first + rest, reference(model_dir, prompts))
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 64 for o in rest), [o.num_cached_tokens for o in rest]
    assert llm.engine.block_manager.prefix_hit_rate > 0.5


def test_preemption_parity(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    prompts = make_prompts(seed=2)
    # 2 layers x 2 kv heads x 16 dims x 4 bytes x 2 = 512 bytes/token; 12 blocks of 16 tokens
    llm = new_llm(model_dir, kv_cache_memory=12 * 16 * 512, max_model_len=160)
    outputs = run_engine(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_parity(outputs, reference(model_dir, prompts))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_seeded_sampling_independent_of_batch(tiny_model_dir):
    llm = new_llm(tiny_model_dir("llama"))
    target = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], target, use_tqdm=False)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (5, 30, 12)]
    batch = llm.generate([{"prompt_token_ids": [9, 10]}, {"prompt_token_ids": [5, 6, 7, 8]},
                          {"prompt_token_ids": list(range(2, 60))}, {"prompt_token_ids": [3]}],
                         [others[0], target, others[1], others[2]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    again = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], target, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids


def test_n_sequences_and_stop_strings(tiny_model_dir):
    llm = new_llm(tiny_model_dir("llama"))
    out = llm.generate("Hello world", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10,
                                                     ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in out.outputs)
    greedy = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    stop = greedy.text[len(greedy.text) // 2:][:3]
    stopped = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                         stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stop not in stopped.text and greedy.text.startswith(stopped.text)


def test_max_tokens_and_stop_token_ids(tiny_model_dir):
    llm = new_llm(tiny_model_dir("llama"))
    greedy = llm.generate([{"prompt_token_ids": [4, 5, 6]}], SamplingParams(temperature=0, max_tokens=12,
                                                                            ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    stop_id = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_id)
    out = llm.generate([{"prompt_token_ids": [4, 5, 6]}],
                       SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_bad_input(tiny_model_dir):
    llm = new_llm(tiny_model_dir("llama"), max_model_len=64)
    with pytest.raises(ValueError, match=r"70 tokens.*max_model_len=64"):
        llm.generate([{"prompt_token_ids": [3] * 70}], use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [10 ** 6]}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests(), "a rejected batch must queue nothing"
    with pytest.raises(TypeError, match="unexpected engine argument 'max_modle_len'"):
        LLM(str(tiny_model_dir("llama")), max_modle_len=5)


def test_unknown_architecture(tiny_model_dir, tmp_path):
    import json
    import shutil

    src = tiny_model_dir("llama")
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"FancyNewForCausalLM.*LlamaForCausalLM.*pagedllm_model_architectures"):
        new_llm(tmp_path / "m")


def test_unavailable_backend(tiny_model_dir):
    with pytest.raises(ValueError, match=r"unknown attention backend 'NOPE'.*TORCH"):
        new_llm(tiny_model_dir("llama"), attention_backend="NOPE")
    with pytest.raises(ValueError, match=r"FLASH_ATTN cannot run here: .*Backends that can: .*TORCH"):
        new_llm(tiny_model_dir("llama"), attention_backend="FLASH_ATTN")


def test_memory_error_says_what_to_change(tiny_model_dir):
    with pytest.raises(ValueError, match=r"max_model_len=512.*lower --max-model-len.*--kv-cache-dtype fp8"):
        new_llm(tiny_model_dir("llama"), kv_cache_memory=4096)


def test_chat_uses_template(tiny_model_dir):
    llm = new_llm(tiny_model_dir("llama"))
    out = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=4),
                   use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode("<|user|>Hello</s><|assistant|>")


def test_generate_from_another_thread_warns_once(tiny_model_dir, caplog):
    """Two OpenMP pools slow every CPU step: generating on another thread than the one that
    built the LLM works, and says so once."""
    import logging
    import threading

    llm = LLM(model=str(tiny_model_dir()), kv_cache_memory=1 << 22)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
        assert not [r for r in caplog.records if "another thread" in r.getMessage()], "warned on the same thread"
        outputs = []
        for _ in range(2):
            worker = threading.Thread(target=lambda: outputs.append(
                llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)))
            worker.start()
            worker.join()
    warned = [r for r in caplog.records if "another thread" in r.getMessage()]
    assert len(warned) == 1, f"{len(warned)} warnings for two calls from other threads"
    assert len(outputs) == 2 and all(len(o[0].outputs[0].token_ids) == 2 for o in outputs)
