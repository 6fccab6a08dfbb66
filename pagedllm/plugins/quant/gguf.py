"""GGUF checkpoints: one llama.cpp file carries config, tokenizer and weights.

`GGUFFormat` turns the file into what the engine reads from a Hugging Face directory: a
transformers config built from the GGUF metadata, a tokenizer built from the embedded
vocabulary, and (name, tensor) pairs under Hugging Face parameter names, so the model
plugins load it unchanged. Quantized linear and embedding weights arrive as raw ggml
blocks and `GGUFConfig` (quantization "gguf", always chosen for a GGUF file) decides
what to keep; see gguf_linear.py for its two modes (default: a dense float copy plus the
blocks for the native CPU kernels; `--gguf-keep-quantized`: the blocks only).

llama.cpp's converter permutes the rows of Llama's q/k projections (it pairs rotary
halves for its interleaved RoPE); we undo that so the weights match Hugging Face's.
An architecture can also pick its HF class from the file and rewrite the tensor stream
(`_Arch.select` / `.tensors`: deepseek2, gguf_deepseek.py).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from pagedllm.core.contracts import CheckpointFormat
from pagedllm.plugins.quant import gguf_deepseek
from pagedllm.plugins.quant.gguf_dequant import dequantize_numpy
from pagedllm.plugins.quant.gguf_file import FLOAT_TYPES, GGUFError, GGUFFile, is_gguf
from pagedllm.plugins.quant.gguf_linear import tag_raw


@dataclass(frozen=True)
class _Arch:
    hf_architecture: str
    config_class: str  # a transformers config class name
    permute_qk: bool  # llama.cpp permuted q/k rows at conversion
    layer_names: dict[str, str] = field(default_factory=dict)  # this arch's GGUF -> HF layer names over _LAYER_NAMES
    norm_shift: float = 0.0  # llama.cpp stored norm weights + this (Gemma's (1 + w) norms: 1)
    extra_config: Callable[["GGUFFormat"], dict[str, Any]] | None = None  # arch-specific config fields
    # (HF architecture, config class) chosen from the file, where one GGUF arch covers several
    select: Callable[["GGUFFormat"], tuple[str, str]] | None = None
    # a pass over the (HF name, tensor) stream: renames, tensors the converter split
    tensors: Callable[["GGUFFormat", Iterator[tuple[str, torch.Tensor]]],
                      Iterator[tuple[str, torch.Tensor]]] | None = None


# llama.cpp's rules where a Gemma GGUF is silent: every n-th layer global, soft-caps (Gemma 2
# defaults), and the 27B models (by layer count) scale queries by hidden/heads, not head_dim
_GEMMA = {"gemma2": dict(pattern=2, caps=(50.0, 30.0), layers_27b=46),
          "gemma3": dict(pattern=6, caps=(None, None), layers_27b=62)}


def _gemma_config(fmt: "GGUFFormat") -> dict[str, Any]:
    """Gemma 2 / 3 config fields from GGUF metadata (the rest is generic)."""
    rules = _GEMMA[fmt.arch]
    layers, hidden = fmt._require("block_count"), fmt._require("embedding_length")
    heads = fmt._require("attention.head_count")
    pattern = fmt._meta("attention.sliding_window_pattern", rules["pattern"])
    if isinstance(pattern, int):
        sliding = [bool((i + 1) % pattern) for i in range(layers)]
    else:  # one flag per layer, true = sliding
        sliding = [bool(flag) for flag in pattern]
    attn_cap, final_cap = (fmt._meta(key, default) for key, default in
                           zip(("attn_logit_softcapping", "final_logit_softcapping"), rules["caps"]))
    out = dict(layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
               sliding_window=fmt._require("attention.sliding_window"),
               query_pre_attn_scalar=hidden // heads if layers == rules["layers_27b"] else
               int(fmt._meta("attention.key_length", hidden // heads)),
               attn_logit_softcapping=None if attn_cap is None else float(attn_cap),
               final_logit_softcapping=None if final_cap is None else float(final_cap))
    if fmt.arch == "gemma3":  # the sliding layers' own rope base (llama.cpp's default 10000)
        out["rope_local_base_freq"] = float(fmt._meta("rope.freq_base_swa", 10000.0))
    return out


_GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}

# llama.cpp's MoE names: router, the experts stacked per projection [E, rows, cols], and
# Qwen2-MoE's shared expert with its sigmoid gate (a 1-D [H] tensor in llama.cpp's files)
_MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
              "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
              "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
              "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}


def _qwen_moe_config(fmt: "GGUFFormat") -> dict[str, Any]:
    """Qwen2-MoE / Qwen3-MoE config fields. A layer is sparse where the file has its router
    (llama.cpp's files: every layer); sizes default to the tensors' shapes where the
    metadata is silent. llama.cpp hard-codes the routing: qwen3moe renormalizes the top-k
    probabilities (norm_topk_prob), qwen2moe does not, whatever the file says."""
    f = fmt.file
    layers = fmt._require("block_count")
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in f.tensors]
    if not sparse:
        raise GGUFError(f"{fmt.path}: {fmt.arch} GGUF has no expert router (blk.N.ffn_gate_inp.weight)")
    first = sparse[0]

    def size(key: str, tensor: str, dim: int) -> int:  # metadata, else the tensor's shape
        info = f.tensors.get(f"blk.{first}.{tensor}.weight")
        value = fmt._meta(key, None if info is None else info.shape[dim])
        if value is None:
            raise GGUFError(f"{fmt.path}: GGUF metadata is missing {fmt.arch}.{key} (and there is no {tensor})")
        return int(value)

    scale = float(fmt._meta("expert_weights_scale", 0.0))
    if scale not in (0.0, 1.0):
        raise NotImplementedError(f"{fmt.path}: {fmt.arch} expert_weights_scale {scale} is not supported "
                                  "(Qwen-MoE routing has no scaling factor)")
    out: dict[str, Any] = dict(
        num_experts=size("expert_count", "ffn_gate_exps", 0),
        num_experts_per_tok=fmt._require("expert_used_count"),
        moe_intermediate_size=size("expert_feed_forward_length", "ffn_gate_exps", 1),
        norm_topk_prob=fmt.arch == "qwen3moe", decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(layers) if i not in sparse])
    if fmt.arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = size("expert_shared_feed_forward_length", "ffn_gate_shexp", 0)
        out["qkv_bias"] = "blk.0.attn_q.bias" in f.tensors
    return out


# GGUF `general.architecture` -> how to present it; each needs a model plugin of that HF name.
ARCHITECTURES = {
    "llama": _Arch("LlamaForCausalLM", "LlamaConfig", permute_qk=True),
    "qwen2": _Arch("Qwen2ForCausalLM", "Qwen2Config", permute_qk=False),
    "qwen3": _Arch("Qwen3ForCausalLM", "Qwen3Config", permute_qk=False),
    "gemma2": _Arch("Gemma2ForCausalLM", "Gemma2Config", permute_qk=False, layer_names=_GEMMA_NAMES,
                    norm_shift=1.0, extra_config=_gemma_config),
    "gemma3": _Arch("Gemma3ForCausalLM", "Gemma3TextConfig", permute_qk=False, layer_names=_GEMMA_NAMES,
                    norm_shift=1.0, extra_config=_gemma_config),
    "qwen2moe": _Arch("Qwen2MoeForCausalLM", "Qwen2MoeConfig", permute_qk=False, layer_names=_MOE_NAMES,
                      extra_config=_qwen_moe_config),
    "qwen3moe": _Arch("Qwen3MoeForCausalLM", "Qwen3MoeConfig", permute_qk=False, layer_names=_MOE_NAMES,
                      extra_config=_qwen_moe_config),
    # DeepSeek-V2 / V2-Lite / V3 / R1 (gguf_deepseek.py); llama.cpp does not permute their q/k
    "deepseek2": _Arch("DeepseekV3ForCausalLM", "DeepseekV3Config", permute_qk=False,
                       layer_names=gguf_deepseek.LAYER_NAMES, extra_config=gguf_deepseek.config,
                       select=gguf_deepseek.select, tensors=gguf_deepseek.tensors),
}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", *gguf_deepseek.LINEARS)
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str, path: str, layer_names: dict[str, str] | None = None) -> str:
    """The Hugging Face parameter name of a GGUF tensor (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`); `layer_names` overrides the layer map."""
    names = {**_LAYER_NAMES, **(layer_names or {})}
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in names:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{names[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    if gguf_name == "rope_freqs.weight":
        raise NotImplementedError(f"{path}: GGUF rope_freqs (Llama 3.1-style rope scaling) is not supported yet")
    raise GGUFError(f"{path}: GGUF tensor {gguf_name!r} has no counterpart in pagedllm's models")


def unpermute_rows(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: within each head, rows were reordered from
    [first half | second half] to interleaved pairs. Works on raw block rows too."""
    rows = x.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot un-permute {rows} rows over {num_heads} heads")
    return x.reshape(num_heads, rows // num_heads // 2, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


class GGUFFormat(CheckpointFormat):
    """A `.gguf` file (its `gguf_keep_quantized` option is read by `GGUFConfig`)."""

    name = "gguf"

    @classmethod
    def detect(cls, path: str) -> bool:
        return is_gguf(path)

    @functools.cached_property
    def file(self) -> GGUFFile:
        return GGUFFile(self.path)

    @functools.cached_property
    def arch(self) -> str:
        arch = self.file.require("general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(f"{self.path}: GGUF architecture {arch!r} is not supported; supported: "
                             f"{', '.join(sorted(ARCHITECTURES))}")
        return arch

    def _meta(self, key: str, default: Any = None) -> Any:
        return self.file.get(f"{self.arch}.{key}", default)

    def _require(self, key: str) -> int:
        return int(self.file.require(f"{self.arch}.{key}"))

    def hf_config(self) -> Any:
        return self._hf_config

    @functools.cached_property
    def _hf_config(self) -> Any:
        import transformers

        spec, f = ARCHITECTURES[self.arch], self.file
        hf_architecture, config_class = spec.select(self) if spec.select else (spec.hf_architecture,
                                                                              spec.config_class)
        num_heads = self._require("attention.head_count")
        hidden = self._require("embedding_length")
        vocab = self._meta("vocab_size") or len(f.get("tokenizer.ggml.tokens") or []) or \
            f.tensors["token_embd.weight"].shape[0]
        kwargs: dict[str, Any] = dict(
            architectures=[hf_architecture], vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=self._require("feed_forward_length"),
            num_hidden_layers=self._require("block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=int(self._meta("attention.head_count_kv", num_heads)),
            head_dim=int(self._meta("attention.key_length", hidden // num_heads)),
            max_position_embeddings=int(self._meta("context_length", 2048)),
            rms_norm_eps=float(self._meta("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self._meta("rope.freq_base", 10000.0)),
            tie_word_embeddings="output.weight" not in f.tensors,
            bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=f.get("tokenizer.ggml.padding_token_id"),
            dtype="float32",
        )
        extra = spec.extra_config(self) if spec.extra_config is not None else {}
        # an arch whose extra config holds rope_scaling read its scaling keys itself
        scaling = None if "rope_scaling" in extra else self._meta("rope.scaling.type")
        if scaling == "linear":
            kwargs["rope_scaling"] = {"rope_type": "linear", "factor": float(self._meta("rope.scaling.factor"))}
        elif scaling not in (None, "none"):
            raise NotImplementedError(f"{self.path}: GGUF rope scaling {scaling!r} is not supported yet "
                                      "(supported: none, linear)")
        if "rope_freqs.weight" in f.tensors:
            raise NotImplementedError(f"{self.path}: GGUF rope_freqs (Llama 3.1-style rope scaling) "
                                      "is not supported yet")
        kwargs.update(extra)
        return getattr(transformers, config_class)(**kwargs)

    def tokenizer(self) -> Any:
        from pagedllm.plugins.quant.gguf_tokenizer import build_tokenizer

        return build_tokenizer(self.file.metadata, self.path)

    def quantization(self) -> str | None:
        return "gguf"

    def _permute_heads(self, name: str) -> int | None:
        if not ARCHITECTURES[self.arch].permute_qk:
            return None
        cfg = self.hf_config()
        if ".self_attn.q_proj." in name:
            return cfg.num_attention_heads
        if ".self_attn.k_proj." in name:
            return cfg.num_key_value_heads
        return None

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor under its HF name: float32, or (quantized linear, embedding and
        stacked expert weights) raw uint8 rows tagged by `gguf_linear.tag_raw`. Tensors are
        fresh copies."""
        self.hf_config()  # fail on an unsupported file before streaming anything
        spec = ARCHITECTURES[self.arch]
        stream = self._mapped_tensors(spec)
        return spec.tensors(self, stream) if spec.tensors is not None else stream

    def _mapped_tensors(self, spec: _Arch) -> Iterator[tuple[str, torch.Tensor]]:
        """The file's tensors one to one under their HF names (before the arch's `tensors` pass)."""
        for gguf_name, info in self.file.tensors.items():
            name = hf_name(gguf_name, self.path, spec.layer_names)
            heads = self._permute_heads(name)
            data = self.file.tensor_bytes(gguf_name)
            is_matrix = name in _EMBEDDINGS or (name.endswith(".weight") and name.rsplit(".", 2)[-2] in _LINEARS)
            if is_matrix and info.qtype not in FLOAT_TYPES:  # stacked experts stay 3-D (gguf_moe.py)
                tensor = torch.from_numpy(np.array(data, copy=True)).reshape(*info.shape[:-1], -1)
                if heads:
                    tensor = unpermute_rows(tensor, heads)
                yield name, tag_raw(tensor, info.qtype)
                continue
            tensor = dequantize_numpy(data, info.qtype, info.shape)
            if spec.norm_shift and name.endswith("norm.weight"):
                tensor = tensor - spec.norm_shift
            if name.endswith(".shared_expert_gate.weight") and tensor.dim() == 1:
                tensor = tensor[None]  # llama.cpp's [H] -> the gate's [1, H]
            yield name, unpermute_rows(tensor, heads) if heads else tensor
