"""Writing FP8 checkpoints for tests (vLLM's layout), with the dequantized float weights
beside them, and scoring a text through an engine's model with teacher forcing."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from tests._checkpoints import LINEAR, split_linears, write_pair

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _calibrate(src: Path, text_ids: list[int]) -> dict[str, float]:
    """Static input scales: each linear's largest input magnitude on `text_ids`, / 448."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and LINEAR.match(name + ".weight"):
            def hook(mod, inputs, _out, name=name):
                amax[name] = max(amax.get(name, 0.0), float(inputs[0].abs().max()))
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        model(torch.tensor([text_ids]))
    return {name: value / FP8_MAX for name, value in amax.items()}


def fp8_checkpoint(src: Path, out: Path, ref: Path, block: tuple[int, int] | None = None,
                   static_ids: list[int] | None = None, per_row: bool = False):
    """`src` (float HF dir) -> `out` (fp8 weights; per-tensor scales, or `block` scales)
    and `ref` (the dequantized weights, float32). `static_ids` calibrates static input
    scales (activation_scheme "static"). `per_row` scales each output row instead (what
    `--quantization fp8` does to a float checkpoint; only `ref` is then meaningful).
    Returns how the activations are quantized, for
    `hf_log_likelihoods(..., activations=)`."""
    inputs = _calibrate(src, static_ids) if static_ids is not None else {}
    quant, dense, linears = split_linears(src)
    for name, prefix, w in linears:
        if block is None:
            top = w.abs().amax(1, keepdim=True) if per_row else w.abs().max()
            scale = (top / FP8_MAX).clamp(min=1e-12)
            codes = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            dense[name] = codes.float() * scale
            quant[f"{prefix}.weight_scale"] = scale.reshape(()) if not per_row else scale
            if prefix in inputs:
                quant[f"{prefix}.input_scale"] = torch.tensor(inputs[prefix])
        else:
            bn, bk = block
            n, k = w.shape
            blocks = w.view(n // bn, bn, k // bk, bk)
            scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [n / bn, k / bk]
            codes = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            dense[name] = (codes.float() * scale[:, None, :, None]).view(n, k)
            codes = codes.view(n, k)
            quant[f"{prefix}.weight_scale_inv"] = scale
        quant[name] = codes
    qc = {"quant_method": "fp8", "activation_scheme": "static" if static_ids is not None else "dynamic"}
    if block is not None:
        qc["weight_block_size"] = list(block)
    write_pair(src, out, ref, quant, dense, qc)
    if block is not None:
        return ("group", block[1])
    return ("static", inputs) if static_ids is not None else ("token", None)


def _fake_quantize_input(kind: str, arg, name: str):
    """A forward pre-hook rounding a Linear's input as W8A8 does: to fp8 per token, per
    token and group of `arg` columns, or with the static scale of `name`; to int8 per
    token ("int8")."""
    def hook(_module, inputs):
        x = inputs[0]
        if kind == "int8":  # INT8 W8A8: symmetric, per token
            scale = (x.abs().amax(-1, keepdim=True) / 127.0).clamp(min=1e-12)
            return ((x / scale).round().clamp(-128, 127) * scale,)
        if kind == "static":
            scale = torch.tensor(arg[name])
            return ((x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale,)
        shaped = x if kind == "token" else x.reshape(*x.shape[:-1], -1, arg)
        scale = (shaped.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        q = (shaped / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale
        return (q.reshape(x.shape),)
    return hook


def engine_log_likelihoods(llm, ids: list[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[:i + 1]) from the engine's model, teacher-forced in one
    prefill over a scratch use of its KV cache (nothing else may be running)."""
    from pagedllm.core.contracts import AttentionContext

    worker = llm.engine.worker
    blocks = list(range(-(-len(ids) // worker.block_size)))
    layout = worker._layout([ids], [0], [len(ids)], [blocks])
    with torch.inference_mode():
        hidden = worker.model(layout.input_ids, layout.positions,
                              AttentionContext(worker.builder.build(layout), worker.kv_caches))
        logits = worker.model.compute_logits(hidden)
    rows = torch.log_softmax(logits.double(), -1)[:-1].cpu()
    return rows.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def hf_model(model_dir: Path, activations=None):
    """transformers' model in float32; `activations` (what fp8_checkpoint returned) also
    rounds every projection's input to fp8 as W8A8 does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if activations is not None:
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and LINEAR.match(name + ".weight"):
                module.register_forward_pre_hook(_fake_quantize_input(*activations, name))
    return model


def hf_log_likelihoods(model_dir: Path, ids: list[int], activations=None) -> torch.Tensor:
    """Teacher-forced log-likelihoods from transformers (see hf_model)."""
    model = hf_model(model_dir, activations)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    rows = torch.log_softmax(logits.double(), -1)[:-1]
    return rows.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def perplexity(logliks: torch.Tensor) -> float:
    return math.exp(-float(logliks.mean()))


def greedy_agreement(model_dir: Path, prompts: list[list[int]], outputs) -> tuple[int, int]:
    """(tokens that are transformers' argmax, tokens) over our greedy continuations of
    `prompts`, teacher-forced through transformers on `model_dir`."""
    model = hf_model(model_dir)
    agree = total = 0
    for prompt, got in zip(prompts, outputs):
        tokens = got.outputs[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        agree += int((logits.argmax(-1) == torch.tensor(tokens)).sum())
        total += len(tokens)
    return agree, total
