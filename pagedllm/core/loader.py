"""Where a model's config, tokenizer and weights come from.

The core reads Hugging Face directories (config.json, tokenizer files, *.safetensors,
sharded or not); any other format (GGUF) comes from a `CheckpointFormat` plugin. The
result is a `ModelSource`, so the worker never asks which format it was.

Two facts about any Hugging Face config live here too, since every format yields one:
the user's `--hf-overrides` (applied right after the config is read, whatever the
format) and the longest context the config allows (`derived_max_model_len`).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from pagedllm.core.contracts import CheckpointFormat
from pagedllm.core.hub import looks_like_hub_name, resolve_model
from pagedllm.core.plugins import PluginRegistry

logger = logging.getLogger("pagedllm")
# the rope dict's keys that stay when an override switches to another scaling type
_ROPE_KEEP = ("rope_theta", "partial_rotary_factor")


@dataclass
class ModelSource:
    path: str
    hf_config: Any
    tokenizer: Any
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    quantization: str | None
    quantization_config: dict[str, Any]
    format_name: str
    # the language model's config: `hf_config` itself, or the text part of a composite
    # (vision-language) config, whose top level lacks vocab_size, max_position_embeddings, ...
    text_config: Any = None

    def __post_init__(self) -> None:
        if self.text_config is None:
            self.text_config = language_model_config(self.hf_config)


class HFDirectory(CheckpointFormat):
    """A Hugging Face model directory with safetensors weights."""

    name = "safetensors"

    @classmethod
    def detect(cls, path: str) -> bool:
        return os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json"))

    def hf_config(self) -> Any:
        from transformers import AutoConfig

        return _remote_code_hint(AutoConfig.from_pretrained, self.path,
                                 trust_remote_code=bool(self.options.get("trust_remote_code")))

    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return _remote_code_hint(AutoTokenizer.from_pretrained, self.options.get("tokenizer") or self.path,
                                 trust_remote_code=bool(self.options.get("trust_remote_code")))

    def weight_files(self) -> list[str]:
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        else:
            names = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        if not names:
            raise ValueError(f"{self.path} has no *.safetensors weights; convert the checkpoint to safetensors "
                             "(transformers: model.save_pretrained(dir, safe_serialization=True))")
        return [os.path.join(self.path, n) for n in names]

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.weight_files():
            yield from mapped_safetensors(file)

    def quantization(self) -> str | None:
        return None


def open_configured_model(config: Any, registry: PluginRegistry) -> ModelSource:
    """The engine's model as its EngineConfig names it (the bundled default when none),
    opened with every model option: what the engine and each of its ranks open."""
    from pagedllm.core.config import default_model

    m = config.model
    return open_model(m.model or default_model(), m.load_format, registry, config.plugin_options,
                      tokenizer=m.tokenizer, hf_overrides=m.hf_config_overrides(),
                      trust_remote_code=m.trust_remote_code, revision=m.revision, download_dir=m.download_dir)


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def mapped_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one .safetensors file as views of a private memory map of it: a
    page of the file is read only when a loader touches it, so a tensor-parallel rank
    that narrows a tensor to its slice before copying reads only that slice, and no
    rank holds a second copy of the file. (The format: an 8-byte little-endian header
    length, a JSON header of name -> dtype, shape, [start, end) offsets, the data.)"""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        size = os.fstat(f.fileno()).st_size
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    base = 8 + header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which pagedllm cannot read")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end == start:
            yield name, torch.empty(shape, dtype=dtype)
            continue
        count = (end - start) // torch.empty((), dtype=dtype).element_size()
        yield name, torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + start).view(shape)


def open_model(path: str, load_format: str, registry: PluginRegistry, options: dict[str, Any],
               tokenizer: str | None = None, hf_overrides: dict[str, Any] | None = None,
               trust_remote_code: bool = False, revision: str | None = None,
               download_dir: str | None = None) -> ModelSource:
    """Open `path` with the format that fits it (plugins first when load_format is auto);
    `hf_overrides` are applied to its config before anything reads it; `trust_remote_code`
    lets transformers run a repository's own config / tokenizer code (`auto_map`). A hub
    name (ORG/NAME) for the model or the tokenizer is resolved first (core/hub.py):
    the returned source's `path` is local."""
    path = resolve_model(path, revision, download_dir)
    if tokenizer and looks_like_hub_name(tokenizer):
        tokenizer = resolve_model(tokenizer, None, download_dir, what="tokenizer")
    fmt = registry.checkpoint_format(load_format, path, options)
    if fmt is None:
        if not HFDirectory.detect(path):
            known = ", ".join(sorted(registry.checkpoint_formats)) or "none"
            raise ValueError(f"{path!r} is neither a Hugging Face model directory (with config.json) nor a file "
                             f"of a known format (plugins: {known}); pass --load-format to force one")
        fmt = HFDirectory(path, options)
    if tokenizer:
        fmt.options["tokenizer"] = tokenizer
    fmt.options["trust_remote_code"] = trust_remote_code
    hf_config = fmt.hf_config()
    if hf_overrides:
        apply_hf_overrides(hf_config, hf_overrides)
    quant_config = dict(getattr(hf_config, "quantization_config", None) or {})
    quant = quant_config.get("quant_method") or fmt.quantization()
    tok = _tokenizer(fmt, tokenizer)
    return ModelSource(path=path, hf_config=hf_config, tokenizer=tok, weights=fmt.weights,
                       quantization=quant, quantization_config=quant_config, format_name=fmt.name)


def language_model_config(hf_config: Any) -> Any:
    """The config of the model that reads and writes the tokens.

    A composite checkpoint (Gemma 3, Llama 4: `...ForConditionalGeneration`) nests its
    language model's config under `text_config` beside a vision config, and its top level
    states no vocab_size or context length; transformers' `get_text_config(decoder=True)`
    finds that part (and returns any other config itself). The engine reads the token facts
    from here, while the model class and quantizer get the whole config (architectures,
    quantization_config, tie_word_embeddings live at the top)."""
    get_text_config = getattr(hf_config, "get_text_config", None)
    return get_text_config(decoder=True) if callable(get_text_config) else hf_config


def _tokenizer(fmt: CheckpointFormat, tokenizer: str | None) -> Any:
    if tokenizer and not isinstance(fmt, HFDirectory):
        from transformers import AutoTokenizer

        return _remote_code_hint(AutoTokenizer.from_pretrained, tokenizer,
                                 trust_remote_code=bool(fmt.options.get("trust_remote_code")))
    return fmt.tokenizer()


def _remote_code_hint(load: Any, path: str, trust_remote_code: bool) -> Any:
    """transformers' loader, its refusal of a repository's own code reworded to say the
    flag that allows it (transformers' own message asks to pass `trust_remote_code=True`)."""
    try:
        return load(path, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        raise ValueError(f"{path} ships its own code (auto_map in its config): pass --trust-remote-code "
                         "(LLM(trust_remote_code=True)) to run it, if you trust it") from exc


def _rope_dict(hf_config: Any) -> dict[str, Any]:
    """The config's flat rope dict (transformers >= 5 `rope_parameters`, older `rope_scaling`);
    {} when there is none or it is nested per layer type (Gemma 3)."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        return {}
    return rope


def derived_max_model_len(hf_config: Any) -> tuple[int, str]:
    """The longest context the config allows, and how it was derived (for messages).

    vLLM's rule: max_position_embeddings (2048 when absent), times the rope factor for
    linear and dynamic scaling. For yarn, original_max_position_embeddings x factor when
    that is longer: a yarn added by --hf-overrides to a checkpoint whose
    max_position_embeddings is its original length (Qwen2.5's recipe) reaches the scaled
    length, as vLLM <= 0.10 derived it; a checkpoint that already states the scaled length
    keeps it, as vLLM 0.32 reads it. Per-layer-type rope (Gemma 3) is never scaled."""
    base = int(getattr(hf_config, "max_position_embeddings", None) or 2048)
    rope = _rope_dict(hf_config)
    kind = rope.get("rope_type", rope.get("type")) or "default"
    factor = rope.get("factor")
    if kind in ("linear", "dynamic") and factor:
        return int(base * factor), f"max_position_embeddings={base} x {kind} rope factor {factor}"
    orig = rope.get("original_max_position_embeddings")
    if kind == "yarn" and factor and orig and orig * factor > base:
        return int(orig * factor), f"yarn original_max_position_embeddings={orig} x factor {factor}"
    return base, f"max_position_embeddings={base}"


def apply_hf_overrides(hf_config: Any, overrides: dict[str, Any]) -> None:
    """Set each key of `overrides` on the config, logging it (vLLM's --hf-overrides).

    A dict value merges into a dict or sub-config already there (so `{"rope_scaling":
    {"rope_type": "yarn", ...}}` keeps the checkpoint's rope_theta), except that a rope
    dict naming another scaling type replaces the old one's keys (all but rope_theta and
    partial_rotary_factor). transformers >= 5 spells `rope_scaling` `rope_parameters` and
    keeps `rope_theta` inside it: both old names land there. A key the config does not
    have is set anyway, with a warning (the model may not read it)."""
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a JSON object (a dict), got {type(overrides).__name__}")
    rope_touched = False
    for key, value in overrides.items():
        logger.info("hf_overrides: %s = %r", key, value)
        rope_attr = "rope_parameters" if hasattr(hf_config, "rope_parameters") else "rope_scaling"
        if key in ("rope_scaling", "rope_parameters"):
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"hf_overrides: {key} must be a JSON object, got {value!r}")
            setattr(hf_config, rope_attr, _merged_rope(getattr(hf_config, rope_attr, None), value))
            rope_touched = True
            continue
        if key == "rope_theta" and isinstance(getattr(hf_config, "rope_parameters", None), dict) \
                and "rope_theta" in hf_config.rope_parameters:
            hf_config.rope_parameters = {**hf_config.rope_parameters, "rope_theta": value}
            rope_touched = True
            continue
        if not hasattr(hf_config, key):
            logger.warning("hf_overrides: %s is not a field of %s; set anyway (check its spelling)", key,
                           type(hf_config).__name__)
        current = getattr(hf_config, key, None)
        if isinstance(value, dict) and isinstance(current, dict):
            setattr(hf_config, key, _merge_dicts(current, value))
        elif isinstance(value, dict) and current is not None and hasattr(current, "__dict__"):
            apply_hf_overrides(current, value)  # a sub-config (text_config, ...)
        else:
            setattr(hf_config, key, value)
    if rope_touched and hasattr(hf_config, "standardize_rope_params"):
        hf_config.standardize_rope_params()  # rope_type from "type", original length defaults, as transformers


def _merge_dicts(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge_dicts(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def _merged_rope(current: dict[str, Any] | None, update: dict[str, Any] | None) -> dict[str, Any] | None:
    if update is None:
        return None
    current = dict(current or {})
    new_kind = update.get("rope_type", update.get("type"))
    old_kind = current.get("rope_type", current.get("type")) or "default"
    if new_kind is not None and new_kind != old_kind:
        current = {k: v for k, v in current.items() if k in _ROPE_KEEP}
    if "rope_type" in update:
        current.pop("type", None)  # the older spelling would contradict it
    return _merge_dicts(current, update)
