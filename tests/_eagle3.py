"""An EAGLE-3 head in the published checkpoint layout, with random weights, for a target."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file


def write_head(path, target_dir, draft_vocab: int = 384, own_embedding: bool = False, extra: dict | None = None,
               seed: int = 0, aux_layers: list[int] | None = None):
    """config.json + model.safetensors: `midlayer.*`, `fc` (3H -> H), `norm`, `lm_head` over a
    random draft vocabulary, `d2t` / `t2d`, optionally `embed_tokens` and the feature layers."""
    cfg = json.loads((target_dir / "config.json").read_text())
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv_heads, head_dim, inter = 4, 2, 16, 96
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": h, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-6,
        "max_position_embeddings": cfg["max_position_embeddings"], "rope_theta": 10000.0,
        **({"eagle_aux_hidden_state_layer_ids": aux_layers} if aux_layers else {})}))
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    kept = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    tensors = {
        "fc.weight": w(h, 3 * h),
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": w(inter, h), "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "midlayer.input_layernorm.weight": torch.ones(h), "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h), "norm.weight": torch.ones(h),
        "lm_head.weight": w(draft_vocab, h),
        "d2t": kept - torch.arange(draft_vocab), "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, kept, True),
    }
    if own_embedding:
        tensors["embed_tokens.weight"] = w(vocab, h)
    tensors.update(extra or {})
    save_file(tensors, str(path / "model.safetensors"))
    return path
