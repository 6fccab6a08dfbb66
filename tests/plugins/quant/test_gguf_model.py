"""GGUF checkpoints end to end: the real SmolLM2 file against transformers, tiny files we
write ourselves (Llama / Qwen2 / Qwen3, F32 and Q8_0) against their Hugging Face
directories, and the errors a bad file must produce.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.plugins.quant.gguf import GGUFFormat  # noqa: E402
from pagedllm.plugins.quant.gguf_file import GGUFError  # noqa: E402
from tests._ggml_blocks import quantize_q4_k, quantize_q6_k  # noqa: E402

T = gguf.GGMLQuantizationType
NUM_TOKENS = 32
KEEP_TOKENS = 8
KV_BYTES = 1 << 26
LOGPROB_ATOL = 1e-4  # keep-quantized runs the same float32 weights, so only op order differs
# int8 activations (llama.cpp's numerics) on the tiny random models, teacher-forced against the
# exact dense path: measured on a Xeon (AVX512-VNNI) worst 0.31 (Q4_0) / 0.17 (Q8_0) with 2 of
# 47 argmax flips each, against 0.003 and no flips for the 14-bit kernel
INT8_TINY_LOGPROB_ATOL = 0.6
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "def fib(n):\n    # complete this Python function",
    "Explain in one sentence why the sky is blue.",
    "Quel est le plus long fleuve du monde ?",
    "Give me a JSON object with keys name and age.",
]


# --------------------------------------------------------------------------- the real SmolLM2


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """This module is dominated by small CPU matmuls on 2 shared cores; with a second
    OpenMP thread, a busy machine spends its time spinning at barriers (measured: HF
    generate 4x slower in wall time, 4x the CPU time)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def smollm2_llm() -> LLM:
    """float32 products everywhere (`--dtype auto` may use bf16 ones, see below)."""
    return LLM(kv_cache_memory=KV_BYTES, max_model_len=1024, dtype="float32")


@pytest.fixture(scope="module")
def chat_prompts(smollm2_llm) -> list[list[int]]:
    return [smollm2_llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]


@pytest.fixture(scope="module")
def greedy_outputs(smollm2_llm, chat_prompts):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, logprobs=0)
    return smollm2_llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    """transformers' float32 model on the file's dequantized weights (the reference)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_path),
                                                gguf_file=os.path.basename(smollm2_path),
                                                dtype=torch.float32).eval()


def _hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """float64 [len(tokens), vocab]: transformers' log-softmax at each of `tokens`' positions."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    return torch.log_softmax(logits.double(), -1)[len(prompt) - 1:-1]


@pytest.mark.slow
def test_smollm2_greedy_parity_with_transformers(hf_smollm2, chat_prompts, greedy_outputs) -> None:
    model = hf_smollm2
    eos = model.config.eos_token_id
    for i, (prompt, out) in enumerate(zip(chat_prompts, greedy_outputs)):
        with torch.no_grad():
            full = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False,
                                  pad_token_id=eos, eos_token_id=eos)[0, len(prompt):].tolist()
        expected = full[:full.index(eos) + 1] if eos in full else full
        assert out.outputs[0].token_ids == expected, f"chat {i} ({CHATS[i]!r}) differs from transformers"
    assert len({tuple(o.outputs[0].token_ids) for o in greedy_outputs}) == len(CHATS)


def _small_batch_kernels(model) -> set[str]:
    """The kinds of the small-batch kernels the layers took in place of the native one; they
    round activations (VNNI: to 14-bit block integers; int4: to bf16)."""
    return {m.gguf_small.kind for m in model.modules() if getattr(m, "gguf_small", None) is not None}


# `--dtype auto` on a CPU with native bf16: float32 activations, bf16 products in the
# GEMMs (core/precision.py; the VNNI or torch's int4 kernel for the smallest batches where
# one wins).
# Measured on a Xeon with AMX against transformers in float32: with oneDNN's bf16 GEMM and a
# float32 KV cache, 6 of the 8 chats (7 with the int4 kernel) gave the same 32 greedy
# tokens, teacher-forced logprobs of our tokens within 0.08 (against transformers' own bf16
# run: 5-6 of 8, at most 0.15); with the AMX tile kernel (float32 outputs) and the bf16 KV
# cache: 6 of 8, within 0.045.
MEDIUM_MIN_EQUAL_CHATS = 5
MEDIUM_LOGPROB_ATOL = 0.2


@pytest.mark.slow
def test_smollm2_dtype_auto_bf16_products_stay_close_to_transformers(hf_smollm2, chat_prompts,
                                                                       greedy_outputs) -> None:
    from pagedllm.ops.cpu import features

    llm = LLM(kv_cache_memory=KV_BYTES, max_model_len=1024)
    worker = llm.engine.worker
    assert worker.matmul_precision == "medium", "--dtype auto on GGUF should allow bf16 products"
    gate_up = worker.model.model.layers[0].mlp.gate_up_proj
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params, use_tqdm=False)
    packed = [getattr(m, name) for m in worker.model.modules() for name in ("gguf_dense", "gguf_head")
              if getattr(m, name, None) is not None]
    uses_bf16 = any("bf16" in p.kind for p in packed)
    small = _small_batch_kernels(worker.model)
    cpu = features.detect()
    if not cpu.native_bf16:
        assert not uses_bf16, "bf16 products where the CPU only emulates bf16"
    if cpu.has("amx_bf16"):  # AMX measured 2-7x the float32 GEMM at every row count
        assert "bf16" in gate_up.gguf_dense.kind, f"no bf16 copy on an AMX CPU: {gate_up.gguf_dense.kind}"
    if not uses_bf16 and not small:  # nothing measured faster than float32 here: float32 throughout
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in greedy_outputs]
        return
    equal = 0
    for i, (prompt, got, ref) in enumerate(zip(chat_prompts, outputs, greedy_outputs)):
        tokens = got.outputs[0].token_ids
        equal += tokens == ref.outputs[0].token_ids  # the float32 run equals transformers (test above)
        expected = _hf_logprobs(hf_smollm2, prompt, tokens).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
        ours = torch.tensor([next(iter(step.values())).logprob for step in got.outputs[0].logprobs],
                            dtype=torch.float64)
        worst = (ours - expected).abs().max().item()
        assert worst <= MEDIUM_LOGPROB_ATOL, f"chat {i}: logprob off by {worst:.3f} from transformers float32"
    assert equal >= MEDIUM_MIN_EQUAL_CHATS, f"only {equal} of {len(CHATS)} chats kept transformers' greedy tokens"


# PAGEDLLM_INT8_ACTIVATIONS=int8 with the VNNI kernel forced into every GGUF layer and batch
# (the most it can round): measured on a Xeon (AVX512-VNNI) against transformers float32,
# teacher-forced on our own tokens, logprobs within 0.80 (0.05 with the 14-bit kernel in the
# same places) and 231 of 242 tokens transformers' argmax; 2 of the 8 chats kept its greedy
# tokens throughout. llama.cpp's numerics, and why int8 is asked for, never chosen.
INT8_LOGPROB_ATOL = 1.2
INT8_MIN_ARGMAX_SHARE = 0.9


@pytest.mark.slow
def test_smollm2_int8_activations_stay_within_their_stated_tolerance(hf_smollm2, chat_prompts, monkeypatch) -> None:
    from pagedllm.ops.cpu import crossover
    from pagedllm.plugins.quant import gguf_vnni

    if not gguf_vnni.available():
        pytest.skip("this build has no form of the VNNI kernel")
    monkeypatch.setenv("PAGEDLLM_INT8_ACTIVATIONS", "int8")
    monkeypatch.setattr(crossover, "known", lambda what, candidates=crossover.CANDIDATES: None)
    # VNNI beats the native kernel, nothing beats VNNI (neither int4, the Q4 tiles nor a dense copy)
    v8 = gguf_vnni.kind(True)
    monkeypatch.setattr(crossover, "rows_from", lambda what, *args, **kwargs:
                        1 if f"|native|{v8}|" in what else crossover.NEVER if f"|{v8}|" in what.split("amx-q4")[0]
                        or "|int4|" in what else 1)
    llm = LLM(kv_cache_memory=KV_BYTES, max_model_len=1024)
    small = [m.gguf_small for m in llm.engine.worker.model.modules() if getattr(m, "gguf_small", None) is not None]
    assert small and all(isinstance(k, gguf_vnni.VnniLinear) and k.int8 for k in small), \
        f"not every GGUF layer on the int8 VNNI kernel: {_small_batch_kernels(llm.engine.worker.model)}"
    assert all(m.gguf_native_below == crossover.NEVER for m in llm.engine.worker.model.modules()
               if getattr(m, "gguf_small", None) is not None), "a dense copy serves some batches"
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params, use_tqdm=False)
    worst, agree, total = 0.0, 0, 0
    for prompt, got in zip(chat_prompts, outputs):
        tokens = got.outputs[0].token_ids
        rows = _hf_logprobs(hf_smollm2, prompt, tokens)
        ours = torch.tensor([next(iter(step.values())).logprob for step in got.outputs[0].logprobs],
                            dtype=torch.float64)
        worst = max(worst, (ours - rows.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)).abs().max().item())
        agree += (rows.argmax(-1) == torch.tensor(tokens)).sum().item()
        total += len(tokens)
    assert worst <= INT8_LOGPROB_ATOL, f"int8 activations: logprobs off by {worst:.3f} from transformers float32"
    assert agree >= INT8_MIN_ARGMAX_SHARE * total, f"only {agree} of {total} tokens are transformers' argmax"


# The VNNI kernel's AVX2 form (CPUs without AVX512-VNNI, such as Zen 3) forced into every
# SmolLM2 layer and the head on 14-bit activations, the rest of the AVX2-only build in float32:
# measured on a Xeon (PAGEDLLM_CPU_MAX_ISA=avx2) against transformers float32, logprobs of
# our own tokens within 0.011 and all 8 chats kept its greedy tokens.
AVX2_FORM_LOGPROB_ATOL = 0.1
AVX2_FORM_MIN_EQUAL_CHATS = 6


@pytest.mark.slow
def test_smollm2_vnni_avx2_form_stays_close_to_transformers(hf_smollm2, chat_prompts, greedy_outputs,
                                                            monkeypatch, request) -> None:
    """On an AVX2-only build (this machine's own, or PAGEDLLM_CPU_MAX_ISA=avx2's): what a Zen 3
    runs."""
    from pagedllm.ops.cpu import crossover
    from pagedllm.plugins.quant import gguf_vnni

    _use_vnni_form(request, "avx2")
    monkeypatch.delenv("PAGEDLLM_INT8_ACTIVATIONS", raising=False)
    monkeypatch.setattr(crossover, "known", lambda what, candidates=crossover.CANDIDATES: None)
    # the AVX2 form beats the native kernel; nothing beats it (int4, the Q4 tiles, a dense copy)
    monkeypatch.setattr(crossover, "rows_from", lambda what, *args, **kwargs:
                        1 if "|native|vnni-avx2|" in what else crossover.NEVER)
    llm = LLM(kv_cache_memory=KV_BYTES, max_model_len=1024)
    small = [m.gguf_small for m in llm.engine.worker.model.modules() if getattr(m, "gguf_small", None) is not None]
    assert small and all(isinstance(k, gguf_vnni.VnniLinear) and k.form == "avx2" and not k.int8 for k in small), \
        f"not every GGUF layer on the AVX2 form: {_small_batch_kernels(llm.engine.worker.model)}"
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params, use_tqdm=False)
    worst, equal = 0.0, 0
    for prompt, got, ref in zip(chat_prompts, outputs, greedy_outputs):
        tokens = got.outputs[0].token_ids
        equal += tokens == ref.outputs[0].token_ids  # the float32 run equals transformers
        expected = _hf_logprobs(hf_smollm2, prompt, tokens).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
        ours = torch.tensor([next(iter(step.values())).logprob for step in got.outputs[0].logprobs],
                            dtype=torch.float64)
        worst = max(worst, (ours - expected).abs().max().item())
    assert worst <= AVX2_FORM_LOGPROB_ATOL, f"AVX2 form: logprobs off by {worst:.3f} from transformers float32"
    assert equal >= AVX2_FORM_MIN_EQUAL_CHATS, f"AVX2 form: only {equal} of {len(CHATS)} chats kept greedy tokens"


def test_smollm2_float32_never_takes_a_rounding_kernel(smollm2_llm) -> None:
    model = smollm2_llm.engine.worker.model
    small = _small_batch_kernels(model)
    assert not small, f"--dtype float32 took small-batch kernels that round activations: {small}"
    kinds = [m.gguf_dense.kind for m in model.modules() if getattr(m, "gguf_dense", None) is not None]
    assert kinds and not any("bf16" in k for k in kinds), f"--dtype float32 took bf16 GEMMs: {kinds}"


def test_smollm2_knows_paris(smollm2_llm) -> None:
    out = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.slow
def test_smollm2_keep_quantized_matches_dequantized(chat_prompts, greedy_outputs) -> None:
    """Same float32 weights, dequantized per call instead of once: same greedy tokens,
    logprobs within LOGPROB_ATOL; weights take a third of the memory. Every step
    dequantizes all linear weights, so this compares the first KEEP_TOKENS tokens."""
    llm = LLM(kv_cache_memory=KV_BYTES, max_model_len=1024, dtype="float32",  # as the reference: float32 throughout
              plugin_options={"gguf_keep_quantized": True})
    model = llm.engine.worker.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.uint8 and not hasattr(qkv, "weight"), "keep-quantized kept a dense copy"
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes < 200 * 2**20  # vs 513 MiB dequantized (the Q8_0 embedding is 108 MiB of it)
    params = SamplingParams(temperature=0, max_tokens=KEEP_TOKENS, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params, use_tqdm=False)
    for got, ref in zip(outputs, greedy_outputs):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids[:KEEP_TOKENS]
        for step_got, step_ref in zip(got.outputs[0].logprobs, ref.outputs[0].logprobs):
            for token_id, lp in step_got.items():
                assert lp.logprob == pytest.approx(step_ref[token_id].logprob, abs=LOGPROB_ATOL)


def test_smollm2_config_and_format(smollm2_path) -> None:
    fmt = GGUFFormat(smollm2_path)
    assert GGUFFormat.detect(smollm2_path) and fmt.quantization() == "gguf"
    cfg = fmt.hf_config()
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (576, 30, 9, 3)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.eos_token_id == 2
    assert GGUFFormat(smollm2_path, {"gguf_keep_quantized": True}).quantization() == "gguf"


# --------------------------------------------------------------------------- tiny files we write

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[part]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama q/k rows (pair the rotary halves)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_TEST_ENCODERS = {T.Q4_K: lambda x, _: quantize_q4_k(torch.from_numpy(x)).numpy(),
                  T.Q6_K: lambda x, _: quantize_q6_k(torch.from_numpy(x)).numpy()}


def write_gguf(hf_dir: Path, path: Path, arch: str, linear_type=T.F32, extra_tensors=(), arch_name=None,
               encode=None, quantize_head=False) -> Path:
    """Convert a tiny Hugging Face model to GGUF the way llama.cpp would (no tokenizer).
    `encode(x) -> (raw blocks, ggml type)`, if given, writes the linear weights instead of
    `linear_type`; `quantize_head` treats an untied output head as one of them."""
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch_name or arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
    for name, tensor in state.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        x = tensor.float().numpy()
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            x = _llama_cpp_permute(x, cfg["num_attention_heads" if "q_proj" in name else "num_key_value_heads"])
        is_linear = name.endswith("proj.weight") or (quantize_head and name == "lm_head.weight")
        if is_linear and encode is not None:
            raw, qtype = encode(x)
            writer.add_tensor(_gguf_name(name), np.asarray(raw), raw_dtype=T(qtype))
        elif is_linear and linear_type != T.F32:
            quantize = _TEST_ENCODERS.get(linear_type, gguf.quants.quantize)  # gguf-py cannot write K-quants
            writer.add_tensor(_gguf_name(name), np.asarray(quantize(x, linear_type)), raw_dtype=linear_type)
        else:
            writer.add_tensor(_gguf_name(name), x)
    for name, data, qtype in extra_tensors:
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_llm(path: Path, hf_dir: Path, **kwargs) -> LLM:
    return LLM(str(path), tokenizer=str(hf_dir), kv_cache_memory=1 << 22, dtype="float32", **kwargs)


def _greedy(llm: LLM, prompts: list[list[int]], num_tokens: int = 12):
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


TINY_PROMPTS = [[5, 17, 99, 3], [200, 201, 7, 7, 7, 310, 12, 44, 45], [400]]


def _assert_same_greedy(got, want) -> None:
    """The same greedy tokens, and logprobs within LOGPROB_ATOL (one model, two paths)."""
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for row_a, row_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for token_id, lp in row_a.items():
                assert lp.logprob == pytest.approx(row_b[token_id].logprob, abs=LOGPROB_ATOL)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_matches_its_hf_directory(tiny_model_dir, tmp_path, arch) -> None:
    from safetensors.torch import load_file

    hf_dir = tiny_model_dir(arch)
    path = write_gguf(hf_dir, tmp_path / "tiny.gguf", arch)
    state = load_file(str(hf_dir / "model.safetensors"))
    loaded = dict(GGUFFormat(str(path)).weights())
    assert set(loaded) == set(state) - ({"lm_head.weight"} if arch == "llama" else set())
    for name, tensor in loaded.items():
        assert torch.equal(tensor, state[name].float()), name  # names and q/k un-permutation are exact
    got = _greedy(_tiny_llm(path, hf_dir), TINY_PROMPTS)
    ref = _greedy(LLM(str(hf_dir), kv_cache_memory=1 << 22, dtype="float32"), TINY_PROMPTS)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.parametrize("gemm", [False, True])
def test_tiny_keep_quantized_q8_0_matches_dequantized(tiny_model_dir, tmp_path, monkeypatch, gemm) -> None:
    """`gemm`: the blocks decoded into the float32 GEMM from one row on (its measured
    crossover forced), the path keep-quantized layers take for large batches."""
    from pagedllm.ops.cpu import crossover

    hf_dir = tiny_model_dir("qwen2")  # untied head, q/k/v biases: fused shards + bias loading
    path = write_gguf(hf_dir, tmp_path / "tiny-q8.gguf", "qwen2", linear_type=T.Q8_0)
    dense = _greedy(_tiny_llm(path, hf_dir), TINY_PROMPTS)
    if gemm:
        measured = crossover.rows_from
        monkeypatch.setattr(crossover, "rows_from",
                            lambda what, *a: 1 if "|rows|gemm|" in what else measured(what, *a))
    keep_llm = _tiny_llm(path, hf_dir, plugin_options={"gguf_keep_quantized": True})
    gate_up = keep_llm.engine.worker.model.model.layers[1].mlp.gate_up_proj
    assert gate_up.qweight.dtype == torch.uint8 and not hasattr(gate_up, "weight")
    assert gate_up.gguf_gemm_from == 1 or not gemm
    kept = _greedy(keep_llm, TINY_PROMPTS)
    _assert_same_greedy(kept, dense)


def test_tiny_keep_quantized_serves_a_bfloat16_model(tiny_model_dir, tmp_path) -> None:
    """Kept Q8_0 blocks are all a layer has: bf16 activations must reach the native kernels
    through float32 (this used to fail with an empty dequantization list), and agree with
    the dense bf16 model up to bf16 rounding."""
    hf_dir = tiny_model_dir("qwen2")
    path = write_gguf(hf_dir, tmp_path / "tiny-q8.gguf", "qwen2", linear_type=T.Q8_0)
    options = dict(tokenizer=str(hf_dir), kv_cache_memory=1 << 22, dtype="bfloat16")
    kept = _greedy(LLM(str(path), plugin_options={"gguf_keep_quantized": True}, **options), TINY_PROMPTS, 1)
    dense = _greedy(LLM(str(path), **options), TINY_PROMPTS, 1)
    for a, b in zip(kept, dense):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, "kept blocks and dense weights pick different tokens"
        (token, lp), = a.outputs[0].logprobs[0].items()
        assert lp.logprob == pytest.approx(b.outputs[0].logprobs[0][token].logprob, abs=0.1)


K_ENCODERS = {T.Q4_K: quantize_q4_k, T.Q6_K: quantize_q6_k}


def _k_quant_files(tiny_model_dir, tmp_path, linear_type) -> tuple[Path, Path, Path]:
    """(HF dir, a tiny qwen2 GGUF with `linear_type` linear weights, the same blocks
    rewritten by gguf_blocks32 as Q4_1 / Q8_0). K-quants need rows of 256-value multiples."""
    from pagedllm.plugins.quant.gguf_blocks32 import as_native_blocks

    hf_dir = tiny_model_dir("qwen2", hidden_size=256, intermediate_size=256)
    encoder = K_ENCODERS[linear_type]

    def rewritten(x: np.ndarray):
        qtype, raw = as_native_blocks(encoder(torch.from_numpy(x)), int(linear_type), x.shape[1])
        return raw, qtype

    path = write_gguf(hf_dir, tmp_path / f"tiny-{linear_type.name}.gguf", "qwen2", linear_type=linear_type,
                      quantize_head=True)
    return hf_dir, path, write_gguf(hf_dir, tmp_path / f"tiny-{linear_type.name}-32.gguf", "qwen2",
                                    encode=rewritten, quantize_head=True)


@pytest.mark.parametrize("linear_type", [T.Q4_K, T.Q6_K])
def test_tiny_k_quants_run_as_their_32_value_rewrite(tiny_model_dir, tmp_path, monkeypatch, linear_type) -> None:
    """Where rounding is allowed, K-quant layers are rewritten (gguf_blocks32.py, whose
    tests bound the rewrite) and read by the native kernels; the engine then computes
    exactly the model the rewritten blocks describe: a file holding them, run dense in
    float32 (float32 here, with the rewrite forced on, so nothing else rounds)."""
    from pagedllm.plugins.quant import gguf_linear

    hf_dir, path, rewritten = _k_quant_files(tiny_model_dir, tmp_path, linear_type)
    reference = _greedy(_tiny_llm(rewritten, hf_dir), TINY_PROMPTS)
    monkeypatch.setattr(gguf_linear, "_may_round_blocks", lambda: True)
    llm = _tiny_llm(path, hf_dir, plugin_options={"gguf_keep_quantized": True})
    model = llm.engine.worker.model
    for layer in (model.model.layers[1].mlp.down_proj, model.model.layers[0].self_attn.qkv_proj):
        assert layer.gguf_packed and not layer.gguf_groups, f"{layer.prefix}: not read by the native kernels"
    assert model.lm_head.gguf_packed is not None, "the output head is not read by the native kernels"
    got = _greedy(llm, TINY_PROMPTS)
    _assert_same_greedy(got, reference)


@pytest.mark.parametrize("form", ["avx512", "avx2"])
@pytest.mark.parametrize("stored_wins", [True, False], ids=["stored-wins", "rewrite-wins"])
@pytest.mark.parametrize("linear_type", [T.Q4_K, T.Q6_K])
def test_tiny_k_quants_are_read_as_stored_where_that_measured_faster(tiny_model_dir, tmp_path, monkeypatch, request,
                                                                     linear_type, stored_wins, form) -> None:
    """On a CPU with AVX512-VNNI, the few-row kernel of Q4_K layers (and head) may read the
    file's own blocks (4.6 bits per weight against the 5 of their Q4_1 rewrite) where that
    contest ("vnni_k") says it is faster, else the rewrite; Q6_K layers always read their
    Q8_0 rewrite (no contest). As stored, the weights are exact: the engine gives the greedy
    tokens of the file's exact
    dense float32 weights, with logprobs off only by the kernel's activation rounding (1/16382
    of each 32-value block's largest value). The crossovers are forced (VNNI serves every
    float32 call) and bf16 products allowed in float32, so that nothing else rounds."""
    from pagedllm.ops.cpu import crossover, native
    from pagedllm.plugins.quant import gguf_linear, gguf_vnni
    from pagedllm.plugins.quant.gguf_blocks32 import target_type

    _use_vnni_form(request, form)
    hf_dir, path, _ = _k_quant_files(tiny_model_dir, tmp_path, linear_type)
    reference = _greedy(_tiny_llm(path, hf_dir), TINY_PROMPTS)  # the exact dense path
    monkeypatch.setattr(gguf_linear, "_may_round_blocks", lambda: True)
    monkeypatch.setattr(gguf_linear.dense_kernels, "bf16_products_allowed", lambda: True)
    monkeypatch.setattr(crossover, "known", lambda what, candidates=crossover.CANDIDATES: None)
    v = gguf_vnni.kind(False)
    winners = (f"|native|{v}|", f"|{v}|{v}_k|") if stored_wins else (f"|native|{v}|",)
    monkeypatch.setattr(crossover, "rows_from",
                        lambda what, *args, **kwargs: 1 if any(w in what for w in winners) else crossover.NEVER)
    llm = _tiny_llm(path, hf_dir)
    model = llm.engine.worker.model
    read = int(linear_type) if stored_wins and linear_type == T.Q4_K else target_type(int(linear_type))
    for layer in (model.model.layers[1].mlp.down_proj, model.model.layers[0].self_attn.qkv_proj, model.lm_head):
        assert isinstance(layer.gguf_small, gguf_vnni.VnniLinear), f"{layer.prefix}: VNNI does not serve"
        assert layer.gguf_small.form == form, f"{layer.prefix}: the {layer.gguf_small.form} form serves"
        assert {w.qtype for w, _, _ in layer.gguf_small.weights} == {read}, f"{layer.prefix}: reads the wrong blocks"
    got = _greedy(llm, TINY_PROMPTS)
    if read != linear_type:
        return  # the rewrite's own parity: test_tiny_k_quants_run_as_their_32_value_rewrite
    for a, b in zip(got, reference):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for row_a, row_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for token_id, lp in row_a.items():
                # measured 0.017 here, 0.005 for VNNI on a Q8_0 file of this model (the kernel's
                # error on equal weights is the same for every type)
                assert lp.logprob == pytest.approx(row_b[token_id].logprob, abs=0.03)


def test_tiny_k_quants_are_rewritten_only_where_rounding_is_allowed(tiny_model_dir, tmp_path) -> None:
    """`--dtype float32` keeps K-quant layers on their exact dense copy; `--dtype auto` (on
    quantized weights) gives their few-row calls to a native kernel on the rewrite."""
    hf_dir, path, _ = _k_quant_files(tiny_model_dir, tmp_path, T.Q4_K)
    exact = _tiny_llm(path, hf_dir).engine.worker.model.model.layers[0].mlp.gate_up_proj
    assert not exact.gguf_packed and exact.gguf_small is None and exact.gguf_has_dense
    auto = LLM(str(path), tokenizer=str(hf_dir), kv_cache_memory=1 << 22).engine.worker.model
    for layer in (auto.model.layers[0].mlp.gate_up_proj, auto.model.layers[1].mlp.down_proj, auto.lm_head):
        assert layer.gguf_packed or layer.gguf_small is not None, f"{layer.prefix}: no native kernel under auto"


# --------------------------------------------------------------------------- errors


@pytest.fixture
def tiny_gguf(tiny_model_dir, tmp_path) -> tuple[Path, Path]:
    hf_dir = tiny_model_dir("llama")
    return write_gguf(hf_dir, tmp_path / "tiny.gguf", "llama"), hf_dir


@pytest.mark.parametrize("keep_bytes", [100, 0.6], ids=["in-header", "in-tensor-data"])
def test_truncated_file_is_named(tiny_gguf, tmp_path, keep_bytes) -> None:
    path, hf_dir = tiny_gguf
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep_bytes if isinstance(keep_bytes, int) else int(len(data) * keep_bytes)])
    with pytest.raises(ValueError, match=rf"{cut}: GGUF file is truncated"):
        _tiny_llm(cut, hf_dir)


def test_not_a_gguf_file(tmp_path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04" + bytes(100))
    assert not GGUFFormat.detect(str(fake))
    with pytest.raises(GGUFError, match=rf"{fake}: not a GGUF file"):
        GGUFFormat(str(fake)).hf_config()


def test_unsupported_tensor_type_is_named(tiny_model_dir, tmp_path) -> None:
    hf_dir = tiny_model_dir("llama")
    raw = np.zeros((4, 2 * 18), dtype=np.uint8)  # 4 rows of 2 IQ4_NL blocks
    path = write_gguf(hf_dir, tmp_path / "iq.gguf", "llama", extra_tensors=[("blk.0.extra.weight", raw, T.IQ4_NL)])
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.extra\.weight' has tensor type IQ4_NL.*supported: F32"):
        _tiny_llm(path, hf_dir)


def test_unsupported_architecture_lists_supported(tiny_model_dir, tmp_path) -> None:
    hf_dir = tiny_model_dir("llama")
    path = write_gguf(hf_dir, tmp_path / "gpt2.gguf", "llama", arch_name="gpt2")
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported; supported: .*deepseek2, gemma2, gemma3, llama, qwen2, qwen2moe, qwen3, qwen3moe"):
        _tiny_llm(path, hf_dir)


def test_keep_quantized_cli_flag() -> None:
    import argparse

    from pagedllm.plugins import quant

    parser = argparse.ArgumentParser()
    quant.pagedllm_add_cli_args(parser)
    assert parser.parse_args(["--gguf-keep-quantized"]).gguf_keep_quantized is True
    assert parser.parse_args([]).gguf_keep_quantized is False


def test_copy_of_smollm2_detected_by_magic_not_name(smollm2_path, tmp_path) -> None:
    renamed = tmp_path / "model.bin"
    os.symlink(smollm2_path, renamed)
    assert not GGUFFormat.detect(str(renamed))  # load_format="auto" needs the .gguf suffix too


def test_chat_cli_streams_a_conversation(smollm2_llm) -> None:
    """`pagedllm chat` on the default model: scripted input, streamed answers, commands."""
    import argparse
    import io

    from pagedllm.chat_cli import run_chat

    lines = iter(["What is the capital of France?", "/bogus", "/system Answer in one word.", "/reset",
                  "And of Italy?", "/exit"])
    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return super().write(text)

    out = Recorder()
    args = argparse.Namespace(model=None, temperature=0.0, max_tokens=16)
    assert run_chat(args, llm=smollm2_llm, input_fn=lambda prompt: next(lines), out=out) == 0
    text = out.getvalue()
    assert "Paris" in text and "unknown command '/bogus'" in text
    assert "(system prompt set)" in text and "(conversation cleared)" in text
    assert len(writes) > 10  # streamed piece by piece, not one write per answer


def _use_vnni_form(request, form: str) -> None:
    """Run the engine on a build with this form of the VNNI kernel (the AVX2 one: the AVX2-only
    build where this machine's has AVX512-VNNI), or skip."""
    from pagedllm.ops.cpu import native

    if form == "avx2" and native.vnni_form() == "avx512":
        request.getfixturevalue("avx2_build")
    if native.vnni_form() != form:
        pytest.skip(f"no build here has the {form} form of the VNNI kernel")


def _teacher_forced(llm: LLM, sequences: list[list[int]]) -> list[list[tuple[int, float]]]:
    """Per sequence, each position after the first: (the engine's argmax there, its logprob of
    the sequence's token)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    scored = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [[(max(record.items(), key=lambda kv: kv[1].logprob)[0], record[token].logprob)
             for token, record in zip(seq[1:], out.prompt_logprobs[1:])] for seq, out in zip(sequences, scored)]


@pytest.mark.parametrize("form", ["avx512", "avx2"])
@pytest.mark.parametrize("linear_type", [T.Q4_0, T.Q8_0])
def test_tiny_int8_activations_only_where_asked(tiny_model_dir, tmp_path, monkeypatch, request, linear_type,
                                                form) -> None:
    """PAGEDLLM_INT8_ACTIVATIONS=int8: where the VNNI kernel serves (forced here for every
    float32 call, bf16 products allowed in float32 so that nothing else rounds), it rounds
    activations to int8 per 32-value block, llama.cpp's numerics, and its crossovers are
    measured under a name of their own ("vnni8"). Teacher-forced on the exact dense path's
    greedy continuations, its logprobs stay within INT8_TINY_LOGPROB_ATOL of that path's and
    further off than the 14-bit kernel's (the default, "float")."""
    from pagedllm.ops.cpu import crossover, native
    from pagedllm.plugins.quant import gguf_linear, gguf_vnni

    _use_vnni_form(request, form)
    hf_dir = tiny_model_dir("qwen2")
    path = write_gguf(hf_dir, tmp_path / "tiny.gguf", "qwen2", linear_type)
    exact = _tiny_llm(path, hf_dir)  # the exact dense path
    sequences = [p + o.outputs[0].token_ids for p, o in zip(TINY_PROMPTS, _greedy(exact, TINY_PROMPTS))]
    reference = _teacher_forced(exact, sequences)
    monkeypatch.setattr(gguf_linear, "_may_round_blocks", lambda: True)
    monkeypatch.setattr(gguf_linear.dense_kernels, "bf16_products_allowed", lambda: True)
    monkeypatch.setattr(crossover, "known", lambda what, candidates=crossover.CANDIDATES: None)
    asked = []

    def rows_from(what, *args, **kwargs):
        asked.append(what)
        return 1 if "|native|vnni" in what else crossover.NEVER

    monkeypatch.setattr(crossover, "rows_from", rows_from)
    worst, flips = {}, {}
    for setting in ("float", "int8"):
        monkeypatch.setenv("PAGEDLLM_INT8_ACTIVATIONS", setting)
        asked.clear()
        llm = _tiny_llm(path, hf_dir)
        layer = llm.engine.worker.model.model.layers[0].mlp.gate_up_proj
        assert isinstance(layer.gguf_small, gguf_vnni.VnniLinear), "VNNI does not serve"
        assert layer.gguf_small.int8 == (setting == "int8"), f"{setting}: the kernel rounds to the wrong integers"
        assert layer.gguf_small.form == form, f"the {layer.gguf_small.form} form serves"
        name = gguf_vnni.kind(setting == "int8")
        assert any(f"|native|{name}|" in what for what in asked), f"{setting}: no {name} contest in {asked}"
        got = _teacher_forced(llm, sequences)
        pairs = [(g, r) for got_seq, ref_seq in zip(got, reference) for g, r in zip(got_seq, ref_seq)]
        worst[setting] = max(abs(g[1] - r[1]) for g, r in pairs)
        flips[setting] = sum(g[0] != r[0] for g, r in pairs)
    positions = sum(len(seq) - 1 for seq in sequences)
    assert worst["int8"] <= INT8_TINY_LOGPROB_ATOL and flips["int8"] <= positions // 10, \
        f"int8 activations: logprobs off by up to {worst['int8']:.3f}, {flips['int8']} of {positions} argmax flips"
    assert worst["float"] < 0.02 and not flips["float"], f"the 14-bit kernel moved: {worst}, {flips}"
    assert worst["int8"] > 4 * worst["float"], f"int8 activations no further from float32 than 14-bit ones: {worst}"


def test_int8_activations_setting_is_checked(monkeypatch) -> None:
    from pagedllm.plugins.quant import gguf_vnni

    monkeypatch.delenv("PAGEDLLM_INT8_ACTIVATIONS", raising=False)
    assert not gguf_vnni.int8_activations() and gguf_vnni.kind() == gguf_vnni.kind(False), \
        "int8 activations without being asked"
    assert gguf_vnni.kind(True, "avx2") == "vnni8-avx2" and gguf_vnni.kind(False, "avx512") == "vnni"
    monkeypatch.setenv("PAGEDLLM_INT8_ACTIVATIONS", "fast")
    with pytest.raises(ValueError, match="PAGEDLLM_INT8_ACTIVATIONS must be float or int8"):
        gguf_vnni.int8_activations()
