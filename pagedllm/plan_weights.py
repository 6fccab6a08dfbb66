"""Weight bytes from a config, for `pagedllm plan`: one function per piece of a decoder
model, and how tensor, pipeline and expert parallelism divide them.

A piece is a group of parameters that parallelism treats alike: the embedding and an
untied lm_head (split by vocabulary rows), attention's query/output projections (split
by heads) and key/value projections (split by KV heads, replicated when there are fewer
than ranks), a dense MLP (split by its intermediate size), routed experts (each
expert's intermediate size split, or whole experts spread with expert parallelism),
shared experts (split like an MLP), and what every rank holds whole: norms, routers,
MLA's compressing projections. The split rules are the model layers' (plugins/models:
`Linear(parallel=...)`, `VocabEmbedding`, `ExpertSplit`); pipeline stages are
`core.parallel.stage_layers`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from pagedllm.core.contracts.model import KVCacheSpec
from pagedllm.core.parallel import stage_layers

QKV_BIAS_MODELS = ("qwen2", "qwen2_moe")  # Qwen2's q/k/v projections always carry a bias
QK_NORM_MODELS = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text")  # per-head q/k RMSNorm weights
FOUR_NORM_MODELS = ("gemma2", "gemma3", "gemma3_text")  # pre/post attention and feed-forward norms


# ---------------------------------------------------------------------- bytes per parameter


@dataclass(frozen=True)
class WeightFormat:
    """How many bytes a parameter takes: `linear_bytes` for the weight of a quantizable
    linear layer (attention, MLP, experts), `dtype_bytes` for everything else (embedding,
    lm_head, norms, routers, biases), which quantizers leave in the compute dtype."""

    name: str
    linear_bytes: float
    dtype_bytes: int


def _int_bytes(bits: int, group_size: int | None, zero_point: bool) -> float:
    """Packed integers plus a float16 scale (and a packed zero point) per group."""
    per_group = (2 + (bits / 8 if zero_point else 0)) / group_size if group_size and group_size > 0 else 0.0
    return bits / 8 + per_group


def weight_format(quantization: str | None, quant_config: dict[str, Any], dtype_bytes: int,
                  dtype_name: str = "") -> WeightFormat:
    """The bytes per parameter of a quantization method, read from the checkpoint's
    quantization_config where it has one: fp8 1 (+ a float32 scale per 128 x 128 block
    when block-quantized), int4 (AWQ / GPTQ / compressed-tensors) 0.5 + group scales,
    bitsandbytes nf4 0.5 + absmax per 64."""
    if quantization is None:
        return WeightFormat(dtype_name or f"{dtype_bytes}-byte floats", dtype_bytes, dtype_bytes)
    key = quantization.lower().replace("-", "_")
    if key in ("fp8", "fbgemm_fp8"):
        block = quant_config.get("weight_block_size")
        scale = 4 / (block[0] * block[1]) if block else 0.0
        return WeightFormat("fp8" + (f" ({block[0]}x{block[1]} block scales)" if block else ""), 1 + scale,
                            dtype_bytes)
    if key in ("awq", "awq_marlin", "gptq", "gptq_marlin"):
        bits = int(quant_config.get("bits", quant_config.get("w_bit", 4)))
        group = int(quant_config.get("group_size", quant_config.get("q_group_size", 128)))
        return WeightFormat(f"{key} int{bits} (group {group})", _int_bytes(bits, group, True), dtype_bytes)
    if key == "compressed_tensors":
        return _compressed_tensors(quant_config, dtype_bytes)
    if key == "bitsandbytes":
        if quant_config.get("load_in_8bit"):
            return WeightFormat("bitsandbytes int8", 1.0, dtype_bytes)
        double = quant_config.get("bnb_4bit_use_double_quant", False)
        return WeightFormat("bitsandbytes nf4", 0.5 + (1 / 64 + 4 / (64 * 256) if double else 4 / 64), dtype_bytes)
    raise ValueError(f"pagedllm plan cannot size {quantization!r} weights; it knows fp8, awq, gptq, "
                     "compressed-tensors, bitsandbytes and GGUF files")


def _compressed_tensors(quant_config: dict[str, Any], dtype_bytes: int) -> WeightFormat:
    groups = list((quant_config.get("config_groups") or {}).values())
    weights = (groups[0] or {}).get("weights") or {} if groups else {}
    bits = int(weights.get("num_bits", 8))
    if weights.get("type", "int") == "float":
        return WeightFormat(f"compressed-tensors fp{bits}", bits / 8, dtype_bytes)
    group = weights.get("group_size")
    return WeightFormat(f"compressed-tensors int{bits}" + (f" (group {group})" if group else ""),
                        _int_bytes(bits, group, not weights.get("symmetric", True)), dtype_bytes)


# ---------------------------------------------------------------------- the model's shape


@dataclass(frozen=True)
class MoEShape:
    """Where a model has routed experts and how big they are."""

    num_experts: int
    top_k: int
    expert_size: int  # one routed expert's intermediate size
    shared_size: int  # the shared expert(s)' intermediate size (0: none)
    shared_gate: bool  # Qwen2-MoE's per-token sigmoid gate on the shared expert
    router_bytes: int | None  # None: the compute dtype (DeepSeek's router is float32: 4)
    router_bias: bool  # DeepSeek-V3's selection bias
    layers: frozenset[int]  # the decoder layers with experts
    dense_size: int  # the other layers' MLP intermediate size


def _top_k(cfg: Any) -> int:
    return int(getattr(cfg, "num_experts_per_tok", None) or 1)


def moe_shape(cfg: Any) -> MoEShape | None:
    """The routed-expert layout by the rules the model plugins apply (DeepSeek:
    first_k_dense_replace and moe_layer_freq; Llama 4: interleave_moe_layer_step or
    moe_layers; Qwen-MoE: decoder_sparse_step and mlp_only_layers); None for a dense model."""
    n = int(cfg.num_hidden_layers)
    if getattr(cfg, "n_routed_experts", None):
        first, freq = int(cfg.first_k_dense_replace or 0), int(getattr(cfg, "moe_layer_freq", 1) or 1)
        size = int(cfg.moe_intermediate_size)
        v3 = getattr(cfg, "model_type", "") == "deepseek_v3" or getattr(cfg, "topk_method", "") == "noaux_tc"
        return MoEShape(int(cfg.n_routed_experts), _top_k(cfg), size,
                        size * int(getattr(cfg, "n_shared_experts", 0) or 0), False, 4, v3,
                        frozenset(i for i in range(first, n) if i % freq == 0), int(cfg.intermediate_size))
    if str(getattr(cfg, "model_type", "")).startswith("llama4"):
        layers = getattr(cfg, "moe_layers", None)
        if layers is None:
            step = int(getattr(cfg, "interleave_moe_layer_step", 1) or 1)
            layers = range(step - 1, n, step)
        size = int(cfg.intermediate_size)
        return MoEShape(int(cfg.num_local_experts), _top_k(cfg), size, size, False, None, False,
                        frozenset(layers), int(getattr(cfg, "intermediate_size_mlp", size)))
    experts = int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0) or 0)
    if not experts:
        return None
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    dense_only = set(getattr(cfg, "mlp_only_layers", None) or [])
    shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    return MoEShape(experts, _top_k(cfg), int(cfg.moe_intermediate_size), shared, shared > 0, None,
                    False, frozenset(i for i in range(n) if i not in dense_only and (i + 1) % step == 0),
                    int(getattr(cfg, "intermediate_size", 0) or 0))


# ---------------------------------------------------------------------- pieces


@dataclass(frozen=True)
class Piece:
    """A group of parameters parallelism treats alike. `tp_units`: how many units (heads,
    vocabulary rows, intermediate columns) tensor parallelism deals out (0: every rank
    holds it whole); `ep_units`: the experts expert parallelism deals out instead."""

    what: str  # embedding, lm_head, final_norm, attention, attention_kv, norms, mlp, experts, shared_experts, router
    layer: int | None  # the decoder layer; None outside them
    params: int
    nbytes: int
    tp_units: int = 0
    ep_units: int = 0


def _piece(what: str, layer: int | None, weights: int, fmt: WeightFormat, tp_units: int = 0, ep_units: int = 0,
           other: int = 0, quantized: bool = True) -> Piece:
    """`weights` parameters of quantizable linear weights (or not, `quantized=False`) and
    `other` parameters in the compute dtype (biases, norms)."""
    per = fmt.linear_bytes if quantized else fmt.dtype_bytes
    return Piece(what, layer, weights + other, math.ceil(weights * per) + other * fmt.dtype_bytes, tp_units, ep_units)


def vocab_pieces(cfg: Any, fmt: WeightFormat, tied: bool) -> list[Piece]:
    """The token embedding, the final norm, and the lm_head unless it is the embedding."""
    vocab, hidden = int(cfg.vocab_size), int(cfg.hidden_size)
    out = [_piece("embedding", None, vocab * hidden, fmt, tp_units=vocab, quantized=False),
           _piece("final_norm", None, 0, fmt, other=hidden)]
    if not tied:
        out.append(_piece("lm_head", None, vocab * hidden, fmt, tp_units=vocab, quantized=False))
    return out


def attention_pieces(cfg: Any, spec: KVCacheSpec, layer: int, fmt: WeightFormat) -> list[Piece]:
    """q and o (split by query heads), k and v (by KV heads), their biases, q/k norms."""
    hidden, d, heads, kv = int(cfg.hidden_size), spec.head_size, spec.num_heads, spec.num_kv_heads
    bias = bool(getattr(cfg, "attention_bias", False) or getattr(cfg, "qkv_bias", False)
                or getattr(cfg, "model_type", "") in QKV_BIAS_MODELS)
    # o_proj's bias: attention_out_bias when the config sets it, else attention_bias (Llama,
    # Qwen3 in transformers; Qwen2's o_proj never has one)
    attention_bias = bool(getattr(cfg, "attention_bias", False)) and getattr(cfg, "model_type", "") != "qwen2"
    out_bias = hidden if getattr(cfg, "attention_out_bias", attention_bias) else 0
    norms = 2 * d if getattr(cfg, "model_type", "") in QK_NORM_MODELS else 0
    return [_piece("attention", layer, 2 * hidden * heads * d, fmt, tp_units=heads, other=heads * d if bias else 0),
            _piece("attention_kv", layer, 2 * hidden * kv * d, fmt, tp_units=kv, other=2 * kv * d if bias else 0),
            _piece("norms", layer, 0, fmt, other=norms + out_bias)]


def mla_pieces(cfg: Any, layer: int, fmt: WeightFormat) -> list[Piece]:
    """Multi-head latent attention (DeepSeek-V2/V3): the compressing projections q_a and
    kv_a (with the rotary key) and their norms are whole on every rank; q_b (or q), kv_b
    and o are split by heads. The engine also keeps kv_b absorbed into per-head W_UK and
    W_UV in the compute dtype (no checkpoint parameters, the same size as kv_b)."""
    hidden, heads, lora = int(cfg.hidden_size), int(cfg.num_attention_heads), int(cfg.kv_lora_rank)
    nope, rope, v = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim), int(cfg.v_head_dim)
    q_lora = int(getattr(cfg, "q_lora_rank", None) or 0)
    whole = hidden * (lora + rope) + hidden * q_lora
    split = (q_lora or hidden) * heads * (nope + rope) + lora * heads * (nope + v) + heads * v * hidden
    absorbed = lora * heads * (nope + v)
    return [_piece("attention_latent", layer, whole, fmt, other=lora + q_lora),
            _piece("attention", layer, split, fmt, tp_units=heads),
            Piece("attention_absorbed", layer, 0, absorbed * fmt.dtype_bytes, tp_units=heads)]


def mlp_piece(cfg: Any, layer: int, size: int, fmt: WeightFormat, what: str = "mlp") -> Piece:
    """gate, up and down projections of one MLP, split by the intermediate size."""
    return _piece(what, layer, 3 * int(cfg.hidden_size) * size, fmt, tp_units=size)


def moe_pieces(cfg: Any, layer: int, moe: MoEShape, fmt: WeightFormat) -> list[Piece]:
    """Routed experts (each split by its intermediate size, or spread whole with expert
    parallelism), shared experts (split like an MLP) and the router (whole on every rank)."""
    hidden = int(cfg.hidden_size)
    out = [_piece("experts", layer, moe.num_experts * 3 * hidden * moe.expert_size, fmt, tp_units=moe.expert_size,
                  ep_units=moe.num_experts)]
    if moe.shared_size:
        out.append(mlp_piece(cfg, layer, moe.shared_size, fmt, "shared_experts"))
    router = moe.num_experts * hidden + (hidden if moe.shared_gate else 0)
    bias = moe.num_experts if moe.router_bias else 0
    per = moe.router_bytes or fmt.dtype_bytes
    out.append(Piece("router", layer, router + bias, (router + bias) * per))
    return out


def layer_norm_piece(cfg: Any, layer: int, fmt: WeightFormat) -> Piece:
    """A decoder layer's RMSNorms (two; Gemma's four)."""
    count = 4 if getattr(cfg, "model_type", "") in FOUR_NORM_MODELS else 2
    return _piece("norms", layer, 0, fmt, other=count * int(cfg.hidden_size))


def weight_pieces(cfg: Any, spec: KVCacheSpec, moe: MoEShape | None, fmt: WeightFormat, tied: bool) -> list[Piece]:
    """Every piece of a decoder-only model, from its (text) config."""
    pieces = vocab_pieces(cfg, fmt, tied)
    for layer in range(int(cfg.num_hidden_layers)):
        pieces += mla_pieces(cfg, layer, fmt) if spec.kind == "mla" else attention_pieces(cfg, spec, layer, fmt)
        if moe is not None and layer in moe.layers:
            pieces += moe_pieces(cfg, layer, moe, fmt)
        else:
            pieces.append(mlp_piece(cfg, layer, moe.dense_size if moe is not None else int(cfg.intermediate_size),
                                    fmt))
        pieces.append(layer_norm_piece(cfg, layer, fmt))
    return pieces


_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GGUF_BY_HEADS = ("attn_q", "attn_output", "attn_q_b", "attn_kv_b", "attn_k_b", "attn_v_b")
_GGUF_BY_KV_HEADS = ("attn_k", "attn_v")
_GGUF_DENSE = ("ffn_gate", "ffn_up", "ffn_down")


def gguf_pieces(tensors: dict[str, tuple[tuple[int, ...], int]], cfg: Any, spec: KVCacheSpec, moe: MoEShape | None,
                dense_bytes: int | None) -> list[Piece]:
    """One piece per tensor of a GGUF file, with the file's bytes (`dense_bytes` None: the
    engine keeps the ggml blocks, --gguf-keep-quantized) or the dense copy the engine makes
    by default (elements x `dense_bytes`), split by the rule of the tensor's kind."""
    vocab = int(cfg.vocab_size)
    out = []
    for name, (shape, file_bytes) in tensors.items():
        params = math.prod(shape)
        nbytes = file_bytes if dense_bytes is None else params * dense_bytes
        match = _GGUF_LAYER.match(name)
        base = name.rsplit(".", 1)[0]
        if match is None:
            what = {"token_embd": "embedding", "output": "lm_head"}.get(base, "final_norm")
            out.append(Piece(what, None, params, nbytes, vocab if what != "final_norm" else 0))
            continue
        layer, part = int(match[1]), match[2]
        if part in _GGUF_BY_HEADS:
            units, what = spec.num_heads, "attention"
        elif part in _GGUF_BY_KV_HEADS:
            units, what = spec.num_kv_heads, "attention_kv"
        elif part in _GGUF_DENSE:
            units, what = (moe.dense_size if moe is not None else int(cfg.intermediate_size)), "mlp"
        elif part.endswith("_exps") and moe is not None:
            out.append(Piece("experts", layer, params, nbytes, moe.expert_size, moe.num_experts))
            continue
        elif part.endswith("_shexp") and moe is not None:
            units, what = moe.shared_size, "shared_experts"
        else:  # norms, routers, MLA's compressing projections: whole on every rank
            units, what = 0, "other"
        out.append(Piece(what, layer, params, nbytes, units))
    return out


# ---------------------------------------------------------------------- per rank


def piece_rank_bytes(piece: Piece, tp: int, expert_parallel: bool = False) -> int:
    """One rank's bytes of `piece`: ceil(units / min(tp, units)) of its units, so a piece
    with fewer units than ranks (KV heads) is replicated, one unit per rank."""
    units = piece.ep_units if expert_parallel and piece.ep_units else piece.tp_units
    if tp == 1 or units == 0:
        return piece.nbytes
    per_rank = -(-units // min(tp, units))
    return -(-piece.nbytes * per_rank // units)


def stage_of(piece: Piece, num_layers: int, pp: int, tied: bool) -> set[int]:
    """The pipeline stages that hold `piece`: a layer's own stage; the embedding on the
    first (and, tied, a copy for the head on the last); the final norm and lm_head on the last."""
    if piece.layer is not None:
        return {next(r for r in range(pp) if piece.layer in stage_layers(num_layers, pp, r))}
    if piece.what == "embedding":
        return {0, pp - 1} if tied else {0}
    return {pp - 1}


def stage_weight_bytes(pieces: list[Piece], num_layers: int, tp: int, pp: int, expert_parallel: bool,
                       tied: bool) -> list[int]:
    """Weight bytes of one rank of each pipeline stage."""
    totals = [0] * pp
    for piece in pieces:
        for stage in stage_of(piece, num_layers, pp, tied):
            totals[stage] += piece_rank_bytes(piece, tp, expert_parallel)
    return totals
