"""Helpers the model-architecture tests share: tiny random Hugging Face models saved with a
real tokenizer, transformers' greedy reference (cached per model, prompts and length), and
the reference directory a quantized file is compared against."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from tests.conftest import save_tokenizer
from tests.test_llm import NUM_TOKENS, hf_greedy

_REFS: dict = {}


def save_hf_model(path: Path, model_cls: str, config_cls: str, settings: dict[str, Any], seed: int = 0) -> Path:
    """transformers.<model_cls>(<config_cls>(**settings)) with seeded random weights, saved
    with the 384-token test tokenizer."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**settings)).eval()
    model.save_pretrained(path)
    save_tokenizer(path)
    return path


def cached_builds(tmp_path_factory, build: Callable[[Path, str], Path]) -> Callable[[str], Path]:
    """name -> build(fresh temp dir, name), built once per session and name."""
    cache: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in cache:
            cache[name] = build(tmp_path_factory.mktemp(name), name)
        return cache[name]

    return make


def reference(model_dir: Path, prompts: list[list[int]], num_tokens: int = NUM_TOKENS, varied: bool = False):
    """transformers' greedy tokens and log-softmax rows (tests.test_llm.hf_greedy), cached.
    `varied`: a random model that repeats itself (4 distinct tokens or fewer) would prove
    nothing, so that fails here."""
    key = (str(model_dir), tuple(map(tuple, prompts)), num_tokens)
    if key not in _REFS:
        _REFS[key] = hf_greedy(model_dir, prompts, num_tokens)
        if varied:
            assert all(len(set(tokens)) > 4 for tokens, _ in _REFS[key]), \
                f"{model_dir}: a degenerate random model proves nothing"
    return _REFS[key]


def dequantized_reference(hf_dir: Path, root: Path, weights: dict[str, torch.Tensor]) -> Path:
    """A copy of `hf_dir` holding `weights` (what a quantized file dequantizes to), so that
    transformers runs exactly the numbers the engine loaded."""
    from safetensors.torch import save_file

    ref = root / "ref"
    shutil.copytree(hf_dir, ref)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(ref / "model.safetensors"), metadata={"format": "pt"})
    return ref


def held_experts(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """A FusedMoE's dense (w13 [E, 2I, H], w2 [E, H, I]) as it holds them: its parameters,
    or, once packed for the native CPU MoE kernel (which drops them), unpacked from the
    kernel's 16-column panels [E, ceil(N/16), K, 16]."""
    if hasattr(experts, "w13_weight"):
        return experts.w13_weight, experts.w2_weight
    packed = experts.packed_experts

    def unpack(w) -> torch.Tensor:
        e, panels, k, width = w.panels.shape
        return w.panels.permute(0, 1, 3, 2).reshape(e, panels * width, k)[:, :w.n]

    return unpack(packed.w13), unpack(packed.w2)
