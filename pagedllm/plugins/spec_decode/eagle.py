"""EAGLE-3: a one-layer head drafts from the target's own hidden states.

The head (published layout, e.g. the `LlamaForCausalLMEagle3` checkpoints): `fc` maps the
target's hidden states entering three of its layers (3H, by default layers 2, L // 2 and
L - 3, or the head config's `eagle_aux_hidden_state_layer_ids`) to H; `midlayer` is a
Llama decoder layer whose attention reads [input_layernorm(embedding of the next token),
hidden_norm(hidden)] (2H wide), with the hidden state as residual; `norm`, then `lm_head`
over a draft vocabulary whose id j is target id j + d2t[j] (`t2d` marks the target ids it
covers). The embedding is the head's own `embed_tokens` if it ships one, else the target's.

At position p the head takes the feature of p and the embedding of token p + 1 and
predicts token p + 2. Its one attention layer keeps a KV cache in the target's blocks:
the prompt's positions are written from every prefill chunk (`observe`), the accepted
positions of each verify step from that step's rows (`propose`), and the k - 1 positions
it drafts ahead from its own pre-norm output fed back as the next feature. Drafts are the
argmax (deterministic: verified as one-hot). EAGLE-1 heads (`fc` 2H -> H over the final
hidden state) are not supported yet and are refused.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Iterator

import torch
from torch import nn

from pagedllm import ops
from pagedllm.core.contracts import (
    AttentionContext,
    KVCacheSpec,
    ModelContext,
    ProposalBatch,
    ProposerContext,
    SpecDecodeConfig,
    SpecProposer,
    TargetStep,
)
from pagedllm.core.worker import process_after_loading
from pagedllm.plugins.models.layers import Attention, Linear, RMSNorm, RotaryEmbedding, VocabEmbedding, rope_parameters


def head_config(path: str) -> SimpleNamespace:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    cfg = SimpleNamespace(**raw)
    cfg.num_key_value_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    cfg.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cfg.draft_vocab_size = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
    cfg.rms_norm_eps = getattr(cfg, "rms_norm_eps", 1e-6)
    cfg.max_position_embeddings = getattr(cfg, "max_position_embeddings", 4096)
    return cfg


def head_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight file in the head's directory (safetensors or .bin)."""
    files = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".bin")))
    if not files:
        raise ValueError(f"EAGLE head {path}: no .safetensors or .bin weight file")
    for name in files:
        full = os.path.join(path, name)
        if name.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(full, framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        else:
            yield from torch.load(full, map_location="cpu", weights_only=True).items()


class Eagle3Head(nn.Module):
    def __init__(self, ctx: ModelContext, target_hidden: int, max_model_len: int) -> None:
        super().__init__()
        cfg = ctx.hf_config
        h, dtype = cfg.hidden_size, ctx.dtype
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.fc = Linear(3 * target_hidden, h, bias=False, params_dtype=dtype)
        self.qkv_proj = Linear(2 * h, [q, kv, kv], bias=bool(getattr(cfg, "attention_bias", False)), params_dtype=dtype)
        self.o_proj = Linear(q, h, params_dtype=dtype)
        self.gate_up_proj = Linear(h, [cfg.intermediate_size] * 2, params_dtype=dtype)
        self.down_proj = Linear(cfg.intermediate_size, h, params_dtype=dtype)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.attn = Attention(ctx, 0, self.heads, self.kv_heads, self.head_dim, scale=self.head_dim ** -0.5)
        theta, scaling = rope_parameters(cfg)
        # the head drafts at the target's positions, which may run past its own config's length
        self.rotary = RotaryEmbedding(self.head_dim, max(cfg.max_position_embeddings, max_model_len), theta, scaling,
                                      max_position_embeddings=cfg.max_position_embeddings)
        self.embed_tokens: VocabEmbedding | None = None  # the head's own, if its checkpoint has one
        self.lm_head = VocabEmbedding(cfg.draft_vocab_size, h, dtype)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long), persistent=False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attn: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output for the logits, pre-norm output: the next step's feature)."""
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        q, k, v = ops.rotary_qkv(self.qkv_proj(x), self.heads, self.kv_heads, self.head_dim,
                                 *self.rotary.lookup(positions))
        x, residual = self.post_attention_layernorm(self.o_proj(self.attn(q, k, v, attn)), residual)
        x = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return self.norm(x, residual)

    def draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        best = self.lm_head.logits(normed).argmax(dim=-1)
        return best + self.d2t[best]


# checkpoint name -> (our module, fused shard or None)
_NAMES = {
    "fc": ("fc", None), "midlayer.self_attn.q_proj": ("qkv_proj", 0), "midlayer.self_attn.k_proj": ("qkv_proj", 1),
    "midlayer.self_attn.v_proj": ("qkv_proj", 2), "midlayer.self_attn.o_proj": ("o_proj", None),
    "midlayer.mlp.gate_proj": ("gate_up_proj", 0), "midlayer.mlp.up_proj": ("gate_up_proj", 1),
    "midlayer.mlp.down_proj": ("down_proj", None), "midlayer.input_layernorm": ("input_layernorm", None),
    "midlayer.hidden_norm": ("hidden_norm", None), "midlayer.post_attention_layernorm": ("post_attention_layernorm", None),
    "norm": ("norm", None), "lm_head": ("lm_head", None), "embed_tokens": ("embed_tokens", None),
}


def load_head(head: Eagle3Head, tensors: Iterator[tuple[str, torch.Tensor]], path: str) -> None:
    from pagedllm.plugins.models.layers import load_shard

    params = dict(head.named_parameters())
    filled: set[str] = set()
    for name, tensor in tensors:
        name = name.removeprefix("model.")
        if name == "d2t":
            head.d2t.copy_(tensor.to(torch.long))
            filled.add("d2t")
            continue
        if name == "t2d":
            continue  # the inverse map: d2t says all the drafting needs
        module, _, kind = name.rpartition(".")
        if module not in _NAMES:
            raise ValueError(f"EAGLE head {path}: tensor {name!r} is not part of the EAGLE-3 layout "
                             f"(expected {', '.join(sorted(_NAMES))}, d2t, t2d)")
        ours, shard = _NAMES[module]
        if ours == "embed_tokens" and head.embed_tokens is None:
            head.embed_tokens = VocabEmbedding(tensor.shape[0], tensor.shape[1], head.lm_head.weight.dtype)
            params.update({f"embed_tokens.{k}": v for k, v in head.embed_tokens.named_parameters()})
        target = f"{ours}.{kind}"
        if target not in params:
            raise ValueError(f"EAGLE head {path}: tensor {name!r} has no place in the head")
        try:
            load_shard(params[target], tensor, shard)
        except ValueError as exc:
            raise ValueError(f"EAGLE head {path}: tensor {name!r}: {exc}") from None
        filled.add(target)
    missing = sorted(n for n in params if n not in filled and not n.startswith("embed_tokens"))
    if missing:
        raise ValueError(f"EAGLE head {path}: missing {', '.join(missing[:6])}")


class Eagle3Proposer(SpecProposer):
    name = "eagle3"
    needs_model = True

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        path = context.config.model
        cfg = head_config(path)
        target_cfg = context.hf_config
        layers = getattr(cfg, "eagle_aux_hidden_state_layer_ids", None) or \
            (getattr(cfg, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
        n = target_cfg.num_hidden_layers
        self.layers = tuple(layers) if layers else (2, n // 2, n - 3)
        if cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"EAGLE head {path}: vocab_size {cfg.vocab_size}, the target's is {target_cfg.vocab_size}")
        if context.model_context is None or context.metadata_builder is None:
            raise ValueError("eagle3 needs a worker that builds proposer layers (ProposerContext.model_context)")
        ctx = context.model_context(cfg)
        with torch.device(context.device):
            self.head = Eagle3Head(ctx, getattr(cfg, "target_hidden_size", None) or target_cfg.hidden_size,
                                   context.max_model_len)
        load_head(self.head, head_tensors(path), path)
        process_after_loading(self.head)
        self.head.eval()
        self.embed = self.head.embed_tokens if self.head.embed_tokens is not None else \
            context.target.get_input_embeddings()
        self.kv_spec = KVCacheSpec(num_layers=1, num_heads=cfg.num_attention_heads,
                                   num_kv_heads=cfg.num_key_value_heads, head_size=cfg.head_dim)
        self.build_metadata = context.metadata_builder(self.kv_spec)

    @property
    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        return self.layers

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.kv_spec

    def _run(self, tokens: list[list[int]], start: list[int], blocks: list[list[int]],
             features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward: row j of request i is position start[i] + j, with the
        embedding of tokens[i][j] (the token after it) and its feature."""
        layout = self.context.make_layout(tokens, start, [len(t) for t in tokens], blocks)
        attn = AttentionContext(self.build_metadata(layout), self.kv_caches)
        return self.head(self.embed(layout.input_ids), features, layout.positions, attn)

    def _target_rows(self, step: TargetStep, which: list[tuple[int, int, int]]) -> torch.Tensor:
        """Features (fc of the three layers' states) of rows (batch index, first row, count)."""
        qsl = step.layout.query_start_loc_cpu
        rows = torch.cat([torch.arange(int(qsl[i]) + first, int(qsl[i]) + first + count) for i, first, count in which])
        rows = rows.to(step.hidden_states.device)
        return self.head.fc(torch.cat([aux[rows] for aux in step.aux_hidden_states], dim=-1))

    @torch.inference_mode()
    def observe(self, step: TargetStep) -> None:
        """Prefill chunks that sample nothing: write the head's KV for their positions."""
        todo = [i for i, samples in enumerate(step.samples) if not samples]
        if not todo:
            return
        qsl, pos = step.layout.query_start_loc_cpu, step.layout.positions
        tokens, start, blocks, which = [], [], [], []
        for i in todo:
            count = int(qsl[i + 1] - qsl[i])
            first = int(pos[int(qsl[i])])
            tokens.append(list(step.token_ids[i][first + 1:first + 1 + count]))
            start.append(first)
            blocks.append(self._blocks(step, i))
            which.append((i, 0, count))
        self._run(tokens, start, blocks, self._target_rows(step, which))

    @staticmethod
    def _blocks(step: TargetStep, i: int) -> list[int]:
        return [int(b) for b in step.layout.block_tables[i].tolist()]

    @torch.inference_mode()
    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in batch.request_ids]
        step = batch.step
        if step is None:
            return out
        qsl, pos = step.layout.query_start_loc_cpu, step.layout.positions
        tokens, start, blocks, which, members = [], [], [], [], []
        for r, rid in enumerate(batch.request_ids):
            i = step.batch_index.get(rid)
            if i is None:
                continue
            first = int(pos[int(qsl[i])])
            ids = batch.token_ids[r]
            count = len(ids) - 1 - first  # rows now part of the sequence: up to the newest token's parent
            if count <= 0:
                continue
            tokens.append(list(ids[first + 1:first + 1 + count]))
            start.append(first)
            blocks.append(list(batch.block_ids[r]))
            which.append((i, 0, count))
            members.append(r)
        if not members:
            return out
        normed, feature = self._run(tokens, start, blocks, self._target_rows(step, which))
        ends = torch.tensor([sum(len(t) for t in tokens[:j + 1]) - 1 for j in range(len(tokens))],
                            device=normed.device)
        drafts = self.head.draft_ids(normed[ends]).tolist()
        feature = feature[ends]
        live = [j for j, r in enumerate(members) if batch.max_drafts[r] > 0]
        for j in live:
            out[members[j]].append(drafts[j])
        depth = 1
        while True:
            keep = [j for j in live if len(out[members[j]]) < batch.max_drafts[members[j]]]
            if not keep:
                return out
            index = torch.tensor([live.index(j) for j in keep], device=feature.device)
            feature = feature[index]
            live = keep
            at = [len(batch.token_ids[members[j]]) - 2 + depth for j in live]
            normed, feature = self._run([[out[members[j]][-1]] for j in live], at,
                                        [blocks[j] for j in live], feature)
            for j, token in zip(live, self.head.draft_ids(normed).tolist()):
                out[members[j]].append(token)
            depth += 1


class EagleProposer(SpecProposer):
    name = "eagle"

    @classmethod
    def validate(cls, config: SpecDecodeConfig) -> None:
        raise NotImplementedError(
            "speculative method 'eagle' (EAGLE-1 heads: fc 2H -> H over the target's last hidden state) is not "
            "supported yet; EAGLE-3 heads are (\"method\": \"eagle3\"), as are \"ngram\", \"suffix\" and "
            "\"draft_model\"")

    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        raise NotImplementedError(self.name)
