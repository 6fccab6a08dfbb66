"""EAGLE heads: a few decoder layers draft from the target's own hidden states.

Two generations of checkpoint share one head class (`EagleHead`), one loader and one
proposer loop; what differs is where the embedding meets the feature, which norms
exist, and whose lm_head scores the drafts.

EAGLE-3 (`"method": "eagle3"`, e.g. the `LlamaForCausalLMEagle3` checkpoints): `fc` maps
the target's hidden states entering three of its layers (3H, by default layers 2, L // 2
and L - 3, or the head config's `eagle_aux_hidden_state_layer_ids`) to H; `midlayer` is a
Llama decoder layer whose attention reads [input_layernorm(embedding of the next token),
hidden_norm(feature)] (2H wide), with the feature as residual; `norm`, then `lm_head` over a
draft vocabulary whose id j is target id j + d2t[j] (`t2d` marks the target ids it covers).

EAGLE-1 (`"method": "eagle"`, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): the feature is the
target's last hidden state after its final norm (what `TargetStep.hidden_states` holds,
as Hugging Face's LlamaModel returns it); `fc` (2H -> H, often with a bias) maps
[embedding of the next token, feature] — that order, as EAGLE's `Model.forward`
concatenates them — into `layers.0.*`, a Llama decoder layer without an input norm
(EAGLE never built one for layer 0; a checkpoint that ships `layers.0.input_layernorm`
anyway has it ignored, as vLLM does), then any further `layers.N.*` (normal ones); no
final norm; the output is scored by the target's lm_head (the head's own `lm_head`, if
its checkpoint has one).

Both use the head's own `embed_tokens` if it ships one, else the target's. At position p
the head takes the feature of p and the embedding of token p + 1 and predicts token p + 2.
Its attention layers keep a KV cache in the target's blocks: the prompt's positions are
written from every prefill chunk (`observe`), the accepted positions of each verify step
from that step's rows (`propose`), and the k - 1 positions it drafts ahead from its own
pre-norm output fed back as the next feature. Drafts are the argmax (deterministic:
verified as one-hot).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
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
    SpecProposer,
    TargetStep,
)
from pagedllm.core.worker import process_after_loading
from pagedllm.plugins.models.layers import Attention, Linear, RMSNorm, RotaryEmbedding, VocabEmbedding, rope_parameters

logger = logging.getLogger(__name__)


def head_config(path: str) -> SimpleNamespace:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    cfg = SimpleNamespace(**raw)
    cfg.num_key_value_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    cfg.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cfg.draft_vocab_size = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
    cfg.rms_norm_eps = getattr(cfg, "rms_norm_eps", 1e-6)
    cfg.max_position_embeddings = getattr(cfg, "max_position_embeddings", 4096)
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"EAGLE head {path}: hidden_act {act!r} is not supported (silu only)")
    return cfg


def _weight_files(path: str) -> list[str]:
    """The head directory's weight files (safetensors or .bin), in name order."""
    files = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".bin")))
    if not files:
        raise ValueError(f"EAGLE head {path}: no .safetensors or .bin weight file")
    return [os.path.join(path, f) for f in files]


def head_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight file in the head's directory (safetensors or .bin)."""
    for full in _weight_files(path):
        if full.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(full, framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        else:
            yield from torch.load(full, map_location="cpu", weights_only=True).items()


def head_tensor_names(path: str) -> list[str]:
    """The tensor names of the head's weight files, without reading the tensors (a .bin
    file is memory-mapped), for what must be known before the head is built."""
    names = []
    for full in _weight_files(path):
        if full.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(full, framework="pt") as f:
                names.extend(f.keys())
        else:
            names.extend(torch.load(full, map_location="cpu", weights_only=True, mmap=True).keys())
    return [n.removeprefix("model.") for n in names]


@dataclass(frozen=True)
class HeadShape:
    """What a generation's head is made of (`Eagle3Proposer.head_shape`, `EagleProposer.head_shape`)."""

    version: int  # 1 or 3: where the embedding meets the feature (see EagleHead.forward)
    fc_in: int  # fc's input: 3 x the target's width (EAGLE-3) or 2H, embedding and feature (EAGLE-1)
    fc_bias: bool
    num_layers: int
    final_norm: bool  # EAGLE-3 norms its output; EAGLE-1 feeds the raw residual sum to the lm_head
    draft_vocab: int | None  # the head's own lm_head rows (EAGLE-3); None: the target's lm_head


class HeadLayer(nn.Module):
    """One Llama decoder layer of a head. Its attention reads `in_width` features: 2H for
    EAGLE-3's first layer ([embedding, feature], each with its own norm), H otherwise.
    The first layer of an EAGLE-1 head has no input norm (fc's output enters unnormed)."""

    def __init__(self, ctx: ModelContext, index: int, in_width: int, input_norm: bool, hidden_norm: bool) -> None:
        super().__init__()
        cfg = ctx.hf_config
        h, dtype, eps = cfg.hidden_size, ctx.dtype, cfg.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn_bias, mlp_bias = bool(getattr(cfg, "attention_bias", False)), bool(getattr(cfg, "mlp_bias", False))
        self.qkv_proj = Linear(in_width, [q, kv, kv], bias=attn_bias, params_dtype=dtype)
        self.o_proj = Linear(q, h, bias=attn_bias, params_dtype=dtype)
        self.gate_up_proj = Linear(h, [cfg.intermediate_size] * 2, bias=mlp_bias, params_dtype=dtype)
        self.down_proj = Linear(cfg.intermediate_size, h, bias=mlp_bias, params_dtype=dtype)
        self.input_layernorm = RMSNorm(h, eps, dtype=dtype) if input_norm else None
        self.hidden_norm = RMSNorm(h, eps, dtype=dtype) if hidden_norm else None
        self.post_attention_layernorm = RMSNorm(h, eps, dtype=dtype)
        self.attn = Attention(ctx, index, self.heads, self.kv_heads, self.head_dim, scale=self.head_dim ** -0.5)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the attention's input, already normed where the layer norms it."""
        q, k, v = ops.rotary_qkv(self.qkv_proj(x), self.heads, self.kv_heads, self.head_dim, *rope)
        x, residual = self.post_attention_layernorm(self.o_proj(self.attn(q, k, v, attn)), residual)
        return self.down_proj(self.gate_up_proj.silu_and_mul(x)), residual


class EagleHead(nn.Module):
    """fc, the decoder layers, the optional final norm and lm_head of either generation:
    one class, so both load, cache and draft through the same code."""

    def __init__(self, ctx: ModelContext, shape: HeadShape, max_model_len: int) -> None:
        super().__init__()
        cfg = ctx.hf_config
        h, dtype = cfg.hidden_size, ctx.dtype
        self.version = shape.version
        self.dtype = dtype  # the compute dtype (dense weights may be kept in another, see ops.dense_weight_dtype)
        self.fc = Linear(shape.fc_in, h, bias=shape.fc_bias, params_dtype=dtype)
        if shape.version == 3:
            self.layers = nn.ModuleList([HeadLayer(ctx, 0, 2 * h, input_norm=True, hidden_norm=True)])
        else:
            self.layers = nn.ModuleList(HeadLayer(ctx, i, h, input_norm=i > 0, hidden_norm=False)
                                        for i in range(shape.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype) if shape.final_norm else None
        head_dim = cfg.head_dim
        theta, scaling = rope_parameters(cfg)
        # the head drafts at the target's positions, which may run past its own config's length
        self.rotary = RotaryEmbedding(head_dim, max(cfg.max_position_embeddings, max_model_len), theta, scaling,
                                      max_position_embeddings=cfg.max_position_embeddings)
        self.embed_tokens: VocabEmbedding | None = None  # the head's own, if its checkpoint has one
        self.lm_head: VocabEmbedding | None = None  # EAGLE-3's draft-vocabulary head; EAGLE-1's own, if shipped
        vocab = shape.draft_vocab or cfg.vocab_size
        if shape.draft_vocab is not None:
            self.lm_head = VocabEmbedding(vocab, h, dtype)
        self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.long), persistent=False)

    def forward(self, embeds: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor,
                attn: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(what the lm_head scores, the next step's feature). EAGLE-3's feature arrives
        already through fc (the target's) or is its own output fed back; EAGLE-1's goes
        through fc with the embedding at every step."""
        rope = self.rotary.lookup(positions)
        first = self.layers[0]
        if self.version == 3:
            x = torch.cat([first.input_layernorm(embeds), first.hidden_norm(feature)], dim=-1)
            residual = feature
        else:
            x = self.fc(torch.cat([embeds, feature], dim=-1))
            residual = x.clone()  # a norm may sum into its residual in place; x is still read
        x, residual = first(x, residual, rope, attn)
        for layer in self.layers[1:]:
            normed, residual = layer.input_layernorm(x, residual)
            x, residual = layer(normed, residual, rope, attn)
        if self.norm is None:
            out = x + residual
            return out, out
        return self.norm(x, residual)


# a decoder layer's checkpoint names -> (our module, fused shard or None)
_LAYER_NAMES = {
    "self_attn.q_proj": ("qkv_proj", 0), "self_attn.k_proj": ("qkv_proj", 1), "self_attn.v_proj": ("qkv_proj", 2),
    "self_attn.o_proj": ("o_proj", None), "mlp.gate_proj": ("gate_up_proj", 0), "mlp.up_proj": ("gate_up_proj", 1),
    "mlp.down_proj": ("down_proj", None), "input_layernorm": ("input_layernorm", None),
    "hidden_norm": ("hidden_norm", None), "post_attention_layernorm": ("post_attention_layernorm", None),
}
_TOP_NAMES = ("fc", "norm", "lm_head", "embed_tokens")
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")


def _layout_names(version: int) -> str:
    layer = "midlayer" if version == 3 else "layers.N"
    names = [f"{layer}.{n}" for n in _LAYER_NAMES if version == 3 or n != "hidden_norm"] + list(_TOP_NAMES)
    if version == 1:
        names.remove("norm")
    return ", ".join(sorted(names) + (["d2t", "t2d"] if version == 3 else []))


def _our_name(name: str, version: int, path: str) -> tuple[str, int | None] | None:
    """(our parameter, shard) of a checkpoint tensor (name without `model.`); None: one to skip."""
    module, _, kind = name.rpartition(".")
    if version == 3 and module.startswith("midlayer."):  # its one layer (`layers.0.*` is taken as well)
        module = "layers.0." + module.removeprefix("midlayer.")
    layer = _LAYER_RE.fullmatch(module)
    if layer is not None and layer.group(2) in _LAYER_NAMES:
        if version == 1 and layer.group(1) == "0" and layer.group(2) == "input_layernorm":
            logger.info("EAGLE head %s: %s ignored (EAGLE-1's first layer has no input norm)", path, name)
            return None
        ours, shard = _LAYER_NAMES[layer.group(2)]
        return f"layers.{layer.group(1)}.{ours}.{kind}", shard
    if module in _TOP_NAMES:
        return f"{module}.{kind}", None
    generation = "EAGLE-3" if version == 3 else "EAGLE-1"
    raise ValueError(f"EAGLE head {path}: tensor {name!r} is not part of the {generation} layout "
                     f"(expected {_layout_names(version)})")


def load_head(head: EagleHead, tensors: Iterator[tuple[str, torch.Tensor]], path: str) -> None:
    from pagedllm.plugins.models.layers import load_shard

    params = dict(head.named_parameters())
    filled: set[tuple[str, int | None]] = set()
    optional = {"embed_tokens"} if head.version == 3 else {"embed_tokens", "lm_head"}
    for name, tensor in tensors:
        name = name.removeprefix("model.")
        if head.version == 3 and name in ("d2t", "t2d"):
            if name == "d2t":  # t2d is the inverse map: d2t says all the drafting needs
                head.d2t.copy_(tensor.to(torch.long))
            continue
        place = _our_name(name, head.version, path)
        if place is None:
            continue
        target, shard = place
        module = target.split(".")[0]
        if module in optional and getattr(head, module) is None:
            with torch.device(head.fc.weight.device):  # where the rest of the head was built
                setattr(head, module, VocabEmbedding(tensor.shape[0], tensor.shape[1], head.dtype))
            params.update({f"{module}.{k}": v for k, v in getattr(head, module).named_parameters()})
        if target not in params:
            raise ValueError(f"EAGLE head {path}: tensor {name!r} has no place in the head "
                             f"({len(head.layers)} layer(s) by its config)")
        try:
            load_shard(params[target], tensor, shard)
        except ValueError as exc:
            raise ValueError(f"EAGLE head {path}: tensor {name!r}: {exc}") from None
        filled.add((target, shard))
    missing = [_checkpoint_name(n, shard, head.version) for n, shard in _expected(params)
               if (n, shard) not in filled and n.split(".")[0] not in optional]
    if missing:
        raise ValueError(f"EAGLE head {path}: missing {', '.join(missing[:6])}")


def _expected(params: dict[str, torch.Tensor]) -> list[tuple[str, int | None]]:
    """(parameter, shard) pairs a complete checkpoint fills (a fused q/k/v one shard each)."""
    out = []
    for name in params:
        layer = _LAYER_RE.fullmatch(name.rpartition(".")[0])
        shards = sorted({shard for ours, shard in _LAYER_NAMES.values() if ours == layer.group(2)}, key=str) \
            if layer is not None else [None]
        out.extend((name, shard) for shard in shards)
    return out


def _checkpoint_name(ours: str, shard: int | None, version: int) -> str:
    module, _, kind = ours.rpartition(".")
    layer = _LAYER_RE.fullmatch(module)
    if layer is None:
        return ours
    sub = next(n for n, place in _LAYER_NAMES.items() if place == (layer.group(2), shard))
    return f"{'midlayer' if version == 3 else 'layers.' + layer.group(1)}.{sub}.{kind}"


class _EagleProposer(SpecProposer):
    """What both generations share: building and loading the head, its KV cache, and the
    drafting loop. A generation says how the target's rows become features and how its
    head is shaped."""

    needs_model = True

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        path = context.config.model
        cfg = head_config(path)
        if cfg.vocab_size != context.hf_config.vocab_size:
            raise ValueError(f"EAGLE head {path}: vocab_size {cfg.vocab_size}, "
                             f"the target's is {context.hf_config.vocab_size}")
        if context.model_context is None or context.metadata_builder is None:
            raise ValueError(f"{self.name} needs a worker that builds proposer layers (ProposerContext.model_context)")
        ctx = context.model_context(cfg)
        shape = self.head_shape(cfg, path, ctx)
        with torch.device(context.device):
            self.head = EagleHead(ctx, shape, context.max_model_len)
        load_head(self.head, head_tensors(path), path)
        process_after_loading(self.head)
        self.head.eval()
        self.embed = self.head.embed_tokens if self.head.embed_tokens is not None else \
            context.target.get_input_embeddings()
        self.kv_spec = KVCacheSpec(num_layers=len(self.head.layers), num_heads=cfg.num_attention_heads,
                                   num_kv_heads=cfg.num_key_value_heads, head_size=cfg.head_dim)
        self.build_metadata = context.metadata_builder(self.kv_spec)

    def head_shape(self, cfg: SimpleNamespace, path: str, ctx: ModelContext) -> HeadShape:
        raise NotImplementedError

    def features(self, step: TargetStep, rows: torch.Tensor) -> torch.Tensor:
        """The head's input features of the target's rows `rows` of the step."""
        raise NotImplementedError

    def draft_ids(self, x: torch.Tensor) -> torch.Tensor:
        head = self.head
        if head.lm_head is None:
            return self.context.target.compute_logits(x).argmax(dim=-1)
        best = head.lm_head.logits(x).argmax(dim=-1)
        return best + head.d2t[best]

    @property
    def needs_target_step(self) -> bool:
        return True

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
        """Features of rows (batch index, first row, count)."""
        qsl = step.layout.query_start_loc_cpu
        rows = torch.cat([torch.arange(int(qsl[i]) + first, int(qsl[i]) + first + count) for i, first, count in which])
        return self.features(step, rows.to(step.hidden_states.device))

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
        drafts = self.draft_ids(normed[ends]).tolist()
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
            for j, token in zip(live, self.draft_ids(normed).tolist()):
                out[members[j]].append(token)
            depth += 1


class Eagle3Proposer(_EagleProposer):
    name = "eagle3"

    def head_shape(self, cfg: SimpleNamespace, path: str, ctx: ModelContext) -> HeadShape:
        layers = getattr(cfg, "eagle_aux_hidden_state_layer_ids", None) or \
            (getattr(cfg, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
        n = self.context.hf_config.num_hidden_layers
        self.aux_layers = tuple(layers) if layers else (2, n // 2, n - 3)
        target_hidden = getattr(cfg, "target_hidden_size", None) or self.context.hf_config.hidden_size
        return HeadShape(version=3, fc_in=3 * target_hidden, fc_bias=False, num_layers=1, final_norm=True,
                         draft_vocab=cfg.draft_vocab_size)

    @property
    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        return self.aux_layers

    def features(self, step: TargetStep, rows: torch.Tensor) -> torch.Tensor:
        """fc of the three layers' states."""
        return self.head.fc(torch.cat([aux[rows] for aux in step.aux_hidden_states], dim=-1))


class EagleProposer(_EagleProposer):
    name = "eagle"

    def head_shape(self, cfg: SimpleNamespace, path: str, ctx: ModelContext) -> HeadShape:
        target_hidden = self.context.hf_config.hidden_size
        if cfg.hidden_size != target_hidden:
            raise ValueError(f"EAGLE head {path}: hidden_size {cfg.hidden_size}, the target's is {target_hidden} "
                             "(an EAGLE-1 head reads the target's last hidden state and feeds its lm_head)")
        tp, pp = ctx.parallel.tp.size, ctx.parallel.pp.size
        if tp > 1 or pp > 1:
            raise NotImplementedError(
                f"speculative method 'eagle' with tensor_parallel_size={tp}, pipeline_parallel_size={pp} is not "
                "supported yet (the head runs on the driver alone and would need the target's split lm_head and "
                "embedding gathered); use one rank")
        names = head_tensor_names(path)
        eagle3 = [n for n in names if n.startswith("midlayer.") or n in ("d2t", "t2d")]
        if eagle3:
            raise ValueError(f"EAGLE head {path} is an EAGLE-3 head (it has {eagle3[0]}); method 'eagle' loads "
                             "EAGLE-1 heads (fc 2H -> H, layers.N.*): use \"method\": \"eagle3\"")
        found = {int(m.group(1)) for m in map(_LAYER_RE.match, names) if m is not None}
        layers = int(getattr(cfg, "num_hidden_layers", None) or 1)
        if found and found != set(range(layers)):
            raise ValueError(f"EAGLE head {path}: its config has num_hidden_layers={layers}, its tensors the "
                             f"layers {sorted(found)}")
        # EAGLE's fc has a bias by default; some heads were trained without one
        return HeadShape(version=1, fc_in=2 * cfg.hidden_size, fc_bias="fc.bias" in names, num_layers=layers,
                         final_norm=False, draft_vocab=None)

    def features(self, step: TargetStep, rows: torch.Tensor) -> torch.Tensor:
        """The target's last hidden states, after its final norm (fc meets them in the head)."""
        return step.hidden_states[rows]
