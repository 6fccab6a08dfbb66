"""An EAGLE-1 head in the published checkpoint layout, with random weights, for a target,
and a direct transformers implementation of what it drafts (the oracle the engine's
proposer is checked against)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HEADS, KV_HEADS, HEAD_DIM, INTER = 4, 2, 16, 96


def write_head(path: Path, target_dir: Path, num_layers: int = 1, fc_bias: bool = True,
               first_input_norm: bool = True, own_embedding: bool = False, own_lm_head: bool = False,
               extra: dict | None = None, seed: int = 0) -> Path:
    """config.json (a LlamaConfig) + model.safetensors: `fc` (2H -> H), `layers.N.*`;
    `layers.0.input_layernorm` shipped (as some checkpoints do, to be ignored) when
    `first_input_norm`; optionally `embed_tokens` and `lm_head`. Norm weights are random
    around 1 so that a norm applied where none belongs changes the output."""
    cfg = json.loads((target_dir / "config.json").read_text())
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": INTER,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "num_hidden_layers": num_layers, "vocab_size": vocab, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "max_position_embeddings": cfg["max_position_embeddings"], "rope_theta": 10000.0,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}))
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    def norm():
        return 1 + 0.3 * torch.randn(h, generator=g)

    tensors = {"fc.weight": w(h, 2 * h)}
    if fc_bias:
        tensors["fc.bias"] = w(h)
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, h),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, h),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, h),
            p + "self_attn.o_proj.weight": w(h, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": w(INTER, h), p + "mlp.up_proj.weight": w(INTER, h),
            p + "mlp.down_proj.weight": w(h, INTER), p + "post_attention_layernorm.weight": norm()})
        if i > 0 or first_input_norm:
            tensors[p + "input_layernorm.weight"] = norm()
    if own_embedding:
        tensors["embed_tokens.weight"] = w(vocab, h)
    if own_lm_head:
        tensors["lm_head.weight"] = w(vocab, h)
    tensors.update(extra or {})
    save_file(tensors, str(path / "model.safetensors"))
    return path


class Reference:
    """EAGLE-1 drafting written directly with transformers: the target's final hidden
    states (LlamaModel's output, after its norm) are the features; the input at position p
    is fc(cat([embed(token p + 1), feature p])); Hugging Face LlamaDecoderLayers, the first
    with its input_layernorm replaced by identity; no final norm; the target's lm_head (the
    head's own where it ships one) scores; the output is fed back as the next feature.

    `mistake` builds a wrong variant, to show the comparison would catch it: "swapped"
    (cat([feature, embedding])), "first_norm" (layer 0 applies its shipped input norm),
    "prenorm_feature" (the target's last hidden state before its final norm)."""

    def __init__(self, head_dir: Path, target_dir: Path, mistake: str | None = None) -> None:
        import transformers
        from torch import nn
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        raw = json.loads((head_dir / "config.json").read_text())
        cfg = transformers.LlamaConfig(**raw)
        cfg._attn_implementation = "eager"
        weights = load_file(str(head_dir / "model.safetensors"))
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias="fc.bias" in weights)
        self.fc.load_state_dict({k.removeprefix("fc."): v for k, v in weights.items() if k.startswith("fc.")})
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            layer = LlamaDecoderLayer(cfg, layer_idx=i).eval()
            own = {k.removeprefix(f"layers.{i}."): v for k, v in weights.items() if k.startswith(f"layers.{i}.")}
            if i == 0 and not (mistake == "first_norm" and "input_layernorm.weight" in own):
                own.pop("input_layernorm.weight", None)
                layer.input_layernorm = nn.Identity()
            layer.load_state_dict(own)
            self.layers.append(layer)
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.embed = nn.Embedding.from_pretrained(weights["embed_tokens.weight"]) if "embed_tokens.weight" in weights \
            else self.target.get_input_embeddings()
        if "lm_head.weight" in weights:
            self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
            self.lm_head.weight.data.copy_(weights["lm_head.weight"])
        else:
            self.lm_head = self.target.get_output_embeddings()
        self.mistake = mistake

    @torch.no_grad()
    def head(self, next_tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        """The head's output at every position (a causal pass over the whole sequence)."""
        n = len(next_tokens)
        emb = self.embed(torch.tensor([next_tokens]))
        pair = (features[None], emb) if self.mistake == "swapped" else (emb, features[None])
        x = self.fc(torch.cat(pair, dim=-1))
        positions = torch.arange(n)[None]
        rope = self.rotary(x, positions)
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
            x = x[0] if isinstance(x, tuple) else x
        return x[0]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
        """k greedy drafts after the sequence `tokens` (its newest token last), and each
        draft's margin over the runner-up logit (a near tie may fall either way)."""
        seen = []
        hook = self.target.model.norm.register_forward_hook(lambda module, args, out: seen.append(args[0]))
        try:
            features = self.target.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
        finally:
            hook.remove()
        if self.mistake == "prenorm_feature":
            features = seen[0][0]
        nexts = list(tokens[1:])
        out, margins = [], []
        for _ in range(k):
            last = self.head(nexts, features)[-1:]
            top = self.lm_head(last)[0].topk(2)
            out.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            nexts.append(out[-1])
            features = torch.cat([features, last])
        return out, margins
