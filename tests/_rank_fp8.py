"""Helpers for tests/plugins/quant/test_fp8_parallel.py that spawned ranks import: build a
quantized checkpoint's model on a rank's `ParallelState` through its quantizer (what the
worker does: the checkpoint's quantization_config, or `--quantization` on a float one),
load this rank's part, and decode greedily with tests/_rank_model.py's batched loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from pagedllm.core.parallel import ParallelState
from tests._rank_model import PROMPTS, STEPS, _decode, model_context


def load_quantized(state: ParallelState, path: str | Path, quantization: str | None = None) -> torch.nn.Module:
    """The checkpoint's model on `state`, loaded and packed through its quantizer."""
    from pagedllm.core.loader import open_model
    from pagedllm.core.plugins import get_registry
    from pagedllm.core.worker import _quant_config, process_after_loading

    registry = get_registry()
    source = open_model(str(path), "auto", registry, {})
    model_cls = registry.model_class(list(source.hf_config.architectures))
    quant = _quant_config(quantization, source, registry, {})
    if quant is not None:
        quant.bind(model_cls.packed_modules_mapping)
    model = model_cls(model_context(source.hf_config, state, quant))
    weights = source.weights()
    model.load_weights(quant.weights(weights, model) if quant is not None else weights)
    process_after_loading(model)
    return model.eval()


def held(model: torch.nn.Module) -> dict[str, Any]:
    """What a few layers hold on this rank (shapes, the fp8 kind), for the parent to check
    each rank loaded its part."""
    layer = model.model.layers[0]
    out: dict[str, Any] = {}
    for name in ("self_attn.qkv_proj", "self_attn.o_proj"):
        module = layer.get_submodule(name)
        out[name] = dict(sizes=list(module.output_sizes), input=module.input_size,
                         kind=getattr(module, "fp8_kind", None),
                         row_scale=tuple(module.fp8_row_scale.shape) if hasattr(module, "fp8_row_scale") else None)
    experts = getattr(layer.mlp, "experts", None)
    if experts is not None:
        out["experts"] = {n: tuple(p.shape) for n, p in experts.named_parameters()}
    return out


def generate_quantized(state: ParallelState, cases: Sequence[tuple[str, str | None]]) -> list[dict[str, Any]]:
    """For each (checkpoint, --quantization flag): greedy tokens, each step's logits (a
    last stage) and what the first layer holds, all in one set of spawned ranks."""
    results = []
    for path, flag in cases:
        model = load_quantized(state, path, flag)
        with torch.inference_mode():
            out = _decode(model, state, PROMPTS, STEPS)
        out["held"] = held(model)
        if "logits" in out:
            out["logits"] = out["logits"].numpy().copy()  # a torch tensor's shared memory dies with the rank
        results.append(out)
    return results

