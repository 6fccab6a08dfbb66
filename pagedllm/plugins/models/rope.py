"""Rotary position embeddings and their scaling types, as Hugging Face transformers
(5.x, `modeling_rope_utils`) computes them: default, linear, dynamic (NTK), yarn,
longrope and llama3.

A model looks up one cos/sin table row per token (`RotaryEmbedding.lookup`); the table
holds everything position-dependent, so a scaling type is a different table, never a
different kernel:

- static types (default, linear, llama3, yarn): row p = cos/sin(p x inv_freq), times
  the type's attention factor (yarn's mscale multiplies cos and sin, so q.k scales by
  its square, as transformers does);
- length-dependent types (dynamic, longrope): transformers recomputes inv_freq from the
  current sequence length at every forward (`dynamic_rope_update`), so the rotation a
  token gets depends on how long its batch's sequence was when it was computed, not only
  on its position. A paged cache with chunked prefill and prefix sharing cannot follow
  that, so row p holds the rotation transformers gives a token at p *when the sequence
  is p + 1 long*: below the original length this is plain rope (exactly transformers');
  beyond it, each position gets the base (dynamic) or the factors (longrope) that
  transformers uses for a sequence ending there. Outputs therefore match transformers
  exactly whenever the prompt fits within the original length (generation may run
  past it), and for any prompt that transformers is fed one token at a time; a longer
  prompt given to transformers in one forward rotates all its tokens with the base of
  its full length instead. vLLM uses one static scaled base for every position (so it
  differs from transformers even on short prompts); we keep transformers' rotations.

The tables are computed in float32 the way transformers computes them, so that rows
agree to rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm import ops

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def rope_parameters(hf_config: Any) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) from either the transformers>=5 `rope_parameters`
    field or the older `rope_theta` + `rope_scaling` pair."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    scaling.update(params)
    return float(theta), scaling


def rope_type(scaling: dict[str, Any]) -> str:
    """The scaling type a rope dict names ("rope_type", or the older "type"), "default" if none."""
    return scaling.get("rope_type", scaling.get("type", "default")) or "default"


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_scale(scaling: dict[str, Any]) -> float:
    """The softmax-scale multiplier DeepSeek-V2/V3 attention applies on top of
    head_dim**-0.5 (transformers' `yarn_apply_mscale`): mscale(factor, mscale_all_dim)**2
    when the rope is scaled and `mscale_all_dim` is set, else 1. (The cos/sin tables carry
    the separate factor mscale / mscale_all_dim, 1 when they are equal as in DeepSeek-V3.)"""
    if rope_type(scaling) == "default" or not scaling.get("mscale_all_dim"):
        return 1.0
    m = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
    return m * m


def _exponents(dim: int) -> torch.Tensor:
    """2i / dim for i < dim / 2, in float32 as transformers computes it."""
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _default(dim: int, base: float | torch.Tensor) -> torch.Tensor:
    return 1.0 / (base ** _exponents(dim))


def _original_length(scaling: dict[str, Any], max_position_embeddings: int | None) -> int:
    orig = scaling.get("original_max_position_embeddings") or max_position_embeddings
    if orig is None:
        raise ValueError(f"rope scaling {rope_type(scaling)!r} needs original_max_position_embeddings")
    return int(orig)


def _factor(scaling: dict[str, Any], orig: int, max_position_embeddings: int | None) -> float:
    """The stretch factor; yarn and longrope may leave it out, meaning max / original."""
    factor = scaling.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ValueError(f"rope scaling {rope_type(scaling)!r} without a factor needs max_position_embeddings")
        factor = max_position_embeddings / orig
    return float(factor)


def _yarn(dim: int, theta: float, scaling: dict[str, Any], max_position_embeddings: int | None
          ) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by 1/factor, keep high ones, blend in between over the
    dimensions whose rotation count within the original length lies in (beta_slow, beta_fast)."""
    orig = _original_length(scaling, max_position_embeddings)
    factor = _factor(scaling, orig, max_position_embeddings)
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention = yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times in orig tokens
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    pos_freqs = theta ** _exponents(dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention)


def _llama3(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: divide long wavelengths by factor, keep short ones, blend in between."""
    inv_freq = _default(dim, theta)
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _longrope_attention(scaling: dict[str, Any], orig: int, max_position_embeddings: int | None) -> float:
    attention = scaling.get("attention_factor")
    if attention is not None:
        return float(attention)
    factor = _factor(scaling, orig, max_position_embeddings)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


def _dynamic_base(theta: float, factor: float, seq_len: torch.Tensor, max_position_embeddings: int,
                  dim: int) -> torch.Tensor:
    """NTK-aware base for sequences of `seq_len` tokens (>= max_position_embeddings)."""
    return theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any], max_position_embeddings: int | None = None,
                  seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, attention factor) for a sequence of `seq_len` tokens:
    transformers' ROPE_INIT_FUNCTIONS for the scaling type. The attention factor multiplies
    the cos/sin tables (yarn, longrope; 1 for the others). `head_dim` is the rotated size
    (DeepSeek's qk_rope_head_dim, or head_dim x partial_rotary_factor).

    `max_position_embeddings` is the config's (dynamic's original length; yarn's and
    longrope's when they give no factor). `seq_len` matters to dynamic and longrope only
    (None: their values at the original length)."""
    kind = rope_type(scaling)
    dim = head_dim
    if kind == "default":
        return _default(dim, theta), 1.0
    if kind == "linear":
        return _default(dim, theta) / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(dim, theta, scaling), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, max_position_embeddings)
    if kind == "dynamic":
        if max_position_embeddings is None:
            raise ValueError("dynamic rope scaling needs max_position_embeddings")
        length = max(seq_len or max_position_embeddings, max_position_embeddings)
        base = _dynamic_base(theta, float(scaling["factor"]), torch.tensor(float(length)), max_position_embeddings,
                             dim)
        return _default(dim, base), 1.0
    if kind == "longrope":
        orig = _original_length(scaling, max_position_embeddings)
        factors = scaling["long_factor"] if seq_len and seq_len > orig else scaling["short_factor"]
        ext = torch.tensor(factors, dtype=torch.float32)
        return 1.0 / (ext * theta ** _exponents(dim)), _longrope_attention(scaling, orig, max_position_embeddings)
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported yet (supported: {', '.join(ROPE_TYPES)})")


def rope_cos_sin(head_dim: int, max_position: int, theta: float, scaling: dict[str, Any],
                 max_position_embeddings: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_position, head_dim / 2] (float32), attention factor included;
    row p is the rotation of a token at position p (see the module docstring for dynamic
    and longrope, whose row p assumes a sequence p + 1 long)."""
    kind = rope_type(scaling)
    max_pe = max_position_embeddings or max_position
    positions = torch.arange(max_position, dtype=torch.int64).float()
    if kind == "dynamic":
        # rows below the original length: plain rope; beyond: the base of a sequence ending there
        seq_len = torch.clamp(positions + 1, min=float(max_pe))
        base = _dynamic_base(theta, float(scaling["factor"]), seq_len, max_pe, head_dim)
        freqs = positions[:, None] * _default(head_dim, base[:, None])
        attention = 1.0
    elif kind == "longrope":
        short, attention = rope_inv_freq(head_dim, theta, scaling, max_pe, seq_len=None)
        orig = _original_length(scaling, max_pe)
        long, _ = rope_inv_freq(head_dim, theta, scaling, max_pe, seq_len=orig + 1)
        freqs = positions[:, None] * torch.where(positions[:, None] >= orig, long[None, :], short[None, :])
    else:
        inv_freq, attention = rope_inv_freq(head_dim, theta, scaling, max_pe)
        freqs = positions[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    return cos, sin


class RotaryEmbedding(nn.Module):
    """The cos/sin tables of a neox-style rotary embedding (rotate halves, as Hugging
    Face Llama applies it).

    One instance serves every layer: the model looks up cos/sin for the step's
    positions once (`lookup`) and each layer rotates with `ops.rotary_qkv`. `head_dim`
    is the rotated size (it may be smaller than the attention head, e.g. DeepSeek's
    qk_rope_head_dim); `max_position` the table length (the longest context served);
    `max_position_embeddings` the config's, which some scaling types read (default:
    `max_position`).
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any],
                 max_position_embeddings: int | None = None) -> None:
        super().__init__()
        cos, sin = rope_cos_sin(head_dim, max_position, theta, scaling, max_position_embeddings)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, D/2] (float32) for the step's positions."""
        return ops.gather_rows(self.cos, positions), ops.gather_rows(self.sin, positions)
