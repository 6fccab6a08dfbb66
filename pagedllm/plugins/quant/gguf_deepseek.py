"""GGUF `deepseek2`: llama.cpp's one architecture for DeepSeek-V2, V2-Lite, V3 and R1.

What `GGUFFormat` (gguf.py) needs beyond the generic path, kept here so that gguf.py
stays a table:

* which Hugging Face class: DeepseekV3ForCausalLM when the routing is sigmoid
  (`expert_gating_func` 2) or the file has the selection bias (`exp_probs_b`), else
  DeepseekV2ForCausalLM (softmax routing; files older than the key are V2);
* the config fields from `deepseek2.*` metadata, including the MLA sizes, which llama.cpp
  stores two ways: files converted since llama.cpp's MLA support (April 2025) describe
  the latent as an MQA head (`key_length` = kv_lora_rank + rope, `value_length` =
  kv_lora_rank, one KV head) and put the per-head sizes under `key_length_mla` /
  `value_length_mla`; older files have the per-head sizes under `key_length` /
  `value_length`;
* the tensors: newer files split `kv_b_proj` [H * (nope + v), L] into `attn_k_b`
  [H, L, nope] (each head's key part transposed) and `attn_v_b` [H, v, L]; we join them
  back into kv_b_proj, which the model absorbs itself at load. Older files carry
  `attn_kv_b` as it is.

RoPE: llama.cpp runs deepseek2 with adjacent-pair rotation on the checkpoint's own
q/k rows (no permutation at conversion), which is DeepSeek's layout
(`rope_interleave`, V3's default and V2's only mode).

YaRN: llama.cpp's converter writes `rope.scaling.yarn_log_multiplier` = 0.1 *
mscale_all_dim for deepseek2, and its attention multiplies the softmax scale by
(1 + yarn_log_multiplier * ln(factor))^2 while leaving cos/sin unscaled. In transformers'
terms that is mscale_all_dim = yarn_log_multiplier / 0.1 with `mscale` equal to it (the
cos/sin factor mscale / mscale_all_dim is then 1; every published DeepSeek config has
the two equal). A file without the multiplier gets attention_factor 1 and no softmax
correction, as llama.cpp runs it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterator

import torch

from pagedllm.plugins.quant.gguf_file import GGUFError

if TYPE_CHECKING:
    from pagedllm.plugins.quant.gguf import GGUFFormat

SOFTMAX, SIGMOID = 1, 2  # llama.cpp's expert_gating_func values

# GGUF layer tensor -> HF name (over gguf.py's shared layer map: attn_q, attn_output,
# the norms, the dense ffn_* of the leading dense blocks)
LAYER_NAMES = {
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
    "ffn_gate_inp": "mlp.gate", "exp_probs_b": "mlp.gate.e_score_correction",
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# the projections that may arrive as raw blocks (the others: norms, router, bias, k_b/v_b)
LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
_SPLIT = re.compile(r"^(model\.layers\.\d+\.self_attn)\.(k_b_proj|v_b_proj)\.weight$")


def is_v3(fmt: "GGUFFormat") -> bool:
    """Sigmoid routing or a selection-bias tensor: DeepSeek-V3 / R1."""
    gating = int(fmt._meta("expert_gating_func", SOFTMAX) or SOFTMAX)
    has_bias = any(name.endswith(".exp_probs_b.bias") for name in fmt.file.tensors)
    if gating not in (SOFTMAX, SIGMOID):
        raise NotImplementedError(f"{fmt.path}: deepseek2 expert_gating_func {gating} is not supported "
                                  "(1 softmax, 2 sigmoid)")
    if has_bias and gating == SOFTMAX:
        raise NotImplementedError(f"{fmt.path}: deepseek2 GGUF with softmax routing and a selection bias "
                                  "(exp_probs_b): no DeepSeek model routes that way")
    return gating == SIGMOID or has_bias


def select(fmt: "GGUFFormat") -> tuple[str, str]:
    """(HF architecture, transformers config class) for this file."""
    return ("DeepseekV3ForCausalLM", "DeepseekV3Config") if is_v3(fmt) else \
        ("DeepseekV2ForCausalLM", "DeepseekV2Config")


def _mla_sizes(fmt: "GGUFFormat") -> tuple[int, int]:
    """(qk_nope + qk_rope, v_head_dim) per head, from either metadata layout (module docstring)."""
    if fmt._meta("attention.key_length_mla") is not None:
        return fmt._require("attention.key_length_mla"), fmt._require("attention.value_length_mla")
    return fmt._require("attention.key_length"), fmt._require("attention.value_length")


def _rope_scaling(fmt: "GGUFFormat") -> dict[str, Any] | None:
    scaling = fmt._meta("rope.scaling.type")
    if scaling in (None, "none"):
        return None
    if scaling != "yarn":
        raise NotImplementedError(f"{fmt.path}: deepseek2 GGUF rope scaling {scaling!r} is not supported "
                                  "(supported: none, yarn)")
    out: dict[str, Any] = dict(
        rope_type="yarn", factor=float(fmt.file.require(f"{fmt.arch}.rope.scaling.factor")),
        original_max_position_embeddings=fmt._require("rope.scaling.original_context_length"),
        beta_fast=float(fmt._meta("rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(fmt._meta("rope.scaling.yarn_beta_slow", 1.0)))
    mscale = float(fmt._meta("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
    if mscale:
        out.update(mscale=mscale, mscale_all_dim=mscale)
    else:
        out["attention_factor"] = 1.0
    return out


def config(fmt: "GGUFFormat") -> dict[str, Any]:
    """DeepSeek-V2 / V3 config fields from `deepseek2.*` metadata (the rest is generic).

    Routing follows what llama.cpp reads: `expert_weights_norm` absent = no
    renormalization, `expert_weights_scale` absent = 1, no `expert_group_count` = no
    groups (V3: one group; V2: greedy). V2 files with groups get transformers' V2 rule
    (group_limited_greedy: groups ranked by their best expert)."""
    heads = fmt._require("attention.head_count")
    rope = fmt._require("rope.dimension_count")
    qk, v = _mla_sizes(fmt)
    if qk <= rope:
        raise GGUFError(f"{fmt.path}: deepseek2 key length {qk} leaves no non-rotary part "
                        f"(rope.dimension_count {rope})")
    groups = int(fmt._meta("expert_group_count", 1) or 1)
    used_groups = int(fmt._meta("expert_group_used_count", groups) or groups)
    out: dict[str, Any] = dict(
        num_key_value_heads=heads,  # transformers' DeepSeek configs; MLA reads one latent either way
        q_lora_rank=int(fmt._meta("attention.q_lora_rank", 0) or 0) or None,
        kv_lora_rank=fmt._require("attention.kv_lora_rank"),
        qk_rope_head_dim=rope, qk_nope_head_dim=qk - rope, v_head_dim=v,
        head_dim=rope,  # transformers' DeepSeek configs: the rotary part (the generic key_length is not it)
        first_k_dense_replace=int(fmt._meta("leading_dense_block_count", 0) or 0),
        n_routed_experts=fmt._require("expert_count"),
        num_experts_per_tok=fmt._require("expert_used_count"),
        n_shared_experts=int(fmt._meta("expert_shared_count", 0) or 0),
        moe_intermediate_size=fmt._require("expert_feed_forward_length"),
        routed_scaling_factor=float(fmt._meta("expert_weights_scale", 1.0) or 1.0),
        norm_topk_prob=bool(fmt._meta("expert_weights_norm", False)),
    )
    if is_v3(fmt):
        out.update(n_group=groups, topk_group=used_groups, rope_interleave=True)
    elif groups > 1:
        out.update(topk_method="group_limited_greedy", n_group=groups, topk_group=used_groups)
    else:
        out.update(topk_method="greedy", n_group=None, topk_group=None)
    scaling = _rope_scaling(fmt)
    if scaling is not None:
        out["rope_scaling"] = scaling
    return out


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj [H * (nope + v), L] from llama.cpp's k_b [H, L, nope] and v_b [H, v, L]:
    per head, the key rows (k_b transposed back) then the value rows."""
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[:2] != (v_b.shape[0], v_b.shape[2]):
        raise GGUFError(f"attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} do not split one "
                        "kv_b_proj (expected [H, L, nope] and [H, v, L])")
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1]).contiguous()


def tensors(fmt: "GGUFFormat", stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The generic stream with deepseek2's fixes: the selection bias under its HF name, and
    k_b / v_b joined into kv_b_proj (dropped where the file also has attn_kv_b)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        if name.endswith(".mlp.gate.e_score_correction.bias"):
            yield name.removesuffix(".bias") + "_bias", tensor
            continue
        m = _SPLIT.match(name)
        if m is None:
            yield name, tensor
            continue
        prefix, part = m.groups()
        layer = prefix.split(".")[2]
        if f"blk.{layer}.attn_kv_b.weight" in fmt.file.tensors:
            continue
        halves = pending.setdefault(prefix, {})
        halves[part] = tensor
        if len(halves) == 2:
            del pending[prefix]
            yield f"{prefix}.kv_b_proj.weight", join_kv_b(halves["k_b_proj"], halves["v_b_proj"])
    if pending:
        raise GGUFError(f"{fmt.path}: deepseek2 GGUF has attn_k_b without attn_v_b (or the reverse) for "
                        f"{sorted(pending)}")
