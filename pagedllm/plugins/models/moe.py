"""The routed-experts layer of mixture-of-experts models (Qwen2/3-MoE, DeepSeek-V3).

Interface for model plugins (keep it: DeepSeek-V3 and any later MoE model build on it):

    experts = FusedMoE(ctx, num_experts, top_k, hidden_size, intermediate_size, prefix,
                       renormalize=..., scoring="softmax" | "sigmoid",
                       num_expert_group=None, topk_group=None,
                       has_correction_bias=False, routed_scaling_factor=1.0)
    out = experts(x [T, H], router_logits [T, E])   # -> [T, H], routing then the experts

* `prefix` is the sparse block's checkpoint name (`model.layers.3.mlp`), and the model
  registers the FusedMoE as that block's `experts` attribute, so its parameters are
  `<prefix>.experts.w13_weight` etc. The router (`<prefix>.gate`, a plain unquantized
  Linear) and any shared experts belong to the model's block, not to this layer.
* Weights come from `ctx.quant_config.moe_method(f"{prefix}.experts")` or, without a
  quantizer, `UnquantizedMoEMethod` (dense w13 [E, 2I, H], w2 [E, H, I], `ops.fused_moe`).
* Checkpoint names: `FusedMoE.checkpoint_target(name)` maps
  `<prefix>.experts.{e}.{gate_proj,up_proj,down_proj}.<suffix>` (and the stacked forms:
  transformers' `<prefix>.experts.gate_up_proj` / `.down_proj` [E, ...], GGUF's
  `<prefix>.experts.{gate,up,down}_proj.weight` [E, ...]), plus DeepSeek's
  `<prefix>.gate.e_score_correction_bias`, onto (parameter name, (expert, shard)); a
  model's `load_weights` hands that pair to `layers.load_shard`, whose parameter loaders
  take it as their shard argument. Anything else returns None (the model's own mapping).
* A MoE model calls `process_moe_after_loading(self)` at the end of its `load_weights`
  (it refuses a checkpoint that misses an expert); the core then calls the methods'
  `process_after_loading`, as for every linear and embedding method.
* A block that routes by itself calls `experts.run_experts(x, topk_weights, topk_ids)`
  with the model's expert ids, never `experts.method.apply` (which sees this rank's ids).

Parallelism (`ctx.parallel`, see `ExpertSplit`): with tensor_parallel_size > 1 every rank
holds every expert's slice of the intermediate dim (w13 rows [gate_r; up_r], w2 columns),
or, with `--enable-expert-parallel`, a contiguous range of whole experts. Either way the
router is replicated, every rank sees every token, and the layer's output is the sum of
the ranks' partial outputs: one all-reduce, done here (`reduce_results`), so a block adds
its replicated or already-reduced terms (a shared expert) to a full output. Loaders take
the rank's part of full checkpoint tensors; another rank's experts are never copied.
"""

from __future__ import annotations

from dataclasses import dataclass
import re
from typing import Any

import torch
from torch import nn

from pagedllm import ops
from pagedllm.core.contracts import ModelContext, MoEMethod
from pagedllm.core.parallel import ParallelState

# `<prefix>.experts.{e}.{proj}.<suffix>`, expert optional (GGUF stacks experts)
_PER_EXPERT = re.compile(r"^(?P<prefix>.+)\.experts\.(?:(?P<expert>\d+)\.)?"
                         r"(?P<proj>gate_proj|up_proj|down_proj|gate_up_proj)\.(?P<suffix>\w+)$")
# transformers >= 5's stacked parameters, no suffix: `<prefix>.experts.gate_up_proj` [E, 2I, H]
_STACKED = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_BIAS = re.compile(r"^(?P<prefix>.+)\.gate\.e_score_correction_bias$")
# checkpoint projection -> (our fused tensor, shard of it)
_PROJ = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "gate_up_proj": ("w13", None), "down_proj": ("w2", None)}


@dataclass(frozen=True)
class ExpertSplit:
    """Which experts of a layer, and which slice of each, one rank holds.

    Tensor parallel: all `num_experts`, each expert's intermediate dim cut in `tp_size`
    equal slices, slice `tp_rank` here. Expert parallel: whole experts
    [first_expert, first_expert + num_local_experts). One rank: everything."""

    num_experts: int  # the model's (what the router scores and checkpoints number)
    first_expert: int
    num_local_experts: int
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def for_rank(cls, parallel: ParallelState, num_experts: int, intermediate_size: int,
                 prefix: str) -> "ExpertSplit":
        """This rank's share of a layer of `num_experts` experts of `intermediate_size`."""
        if parallel.expert_parallel:
            ep = parallel.ep
            if num_experts % ep.size:
                raise ValueError(f"{prefix}: expert parallelism over {ep.size} ranks needs a number of experts "
                                 f"divisible by {ep.size}, the model has {num_experts}; use a tensor_parallel_size "
                                 "that divides it, or drop --enable-expert-parallel")
            n = num_experts // ep.size
            return cls(num_experts, ep.rank * n, n)
        tp = parallel.tp
        if intermediate_size % tp.size:
            raise ValueError(f"{prefix}: tensor_parallel_size={tp.size} does not divide the experts' intermediate "
                             f"size {intermediate_size}; pick a size that does, or --enable-expert-parallel")
        return cls(num_experts, 0, num_experts, tp.rank, tp.size)

    @property
    def is_expert_parallel(self) -> bool:
        return self.num_local_experts != self.num_experts

    def local_expert(self, expert: int) -> int | None:
        """This rank's index of the model's expert `expert` (None: another rank holds it)."""
        local = expert - self.first_expert
        return local if 0 <= local < self.num_local_experts else None

    def own_experts(self, stacked: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a tensor stacking every expert along dim 0 (a view)."""
        if stacked.shape[0] != self.num_experts:
            raise ValueError(f"stacked expert tensor of shape {tuple(stacked.shape)} does not hold the model's "
                             f"{self.num_experts} experts")
        return stacked.narrow(0, self.first_expert, self.num_local_experts)

    def intermediate_part(self, t: torch.Tensor, dim: int, num_blocks: int) -> torch.Tensor:
        """This rank's slice of `t` along the intermediate `dim`, which holds `num_blocks`
        consecutive full-size blocks (w13's fused [gate; up]: 2); the blocks' slices are
        concatenated in order ([gate_r; up_r])."""
        if self.tp_size == 1:
            return t
        block = t.shape[dim] // num_blocks
        if block * num_blocks != t.shape[dim] or block % self.tp_size:
            raise ValueError(f"expert tensor of shape {tuple(t.shape)} does not split into {num_blocks} block(s) "
                             f"of {self.tp_size} equal slices along dim {dim}")
        part = block // self.tp_size
        pieces = [t.narrow(dim, b * block + self.tp_rank * part, part) for b in range(num_blocks)]
        return pieces[0] if num_blocks == 1 else torch.cat(pieces, dim)


def _rank_part(param: torch.Tensor, loaded: torch.Tensor,
               where: tuple[int | None, int | None]) -> tuple[torch.Tensor, int | None] | None:
    """(the part of a full checkpoint tensor this rank holds, its local expert index), or
    None for another rank's expert. A parameter without `expert_split` takes it whole."""
    expert, shard = where
    split: ExpertSplit | None = getattr(param, "expert_split", None)
    if split is None:
        return loaded, expert
    if expert is None:
        loaded = split.own_experts(loaded)
    else:
        expert = split.local_expert(expert)
        if expert is None:
            return None
    dim = getattr(param, "intermediate_dim", None)
    if dim is not None:
        # the fused shards (w13's gate, up) lie along dim 0 of one expert's tensor
        blocks = len(param.shard_sizes) if shard is None and dim == 0 else 1  # type: ignore[attr-defined]
        loaded = split.intermediate_part(loaded, dim + (1 if where[0] is None else 0), blocks)
    return loaded, expert


def expert_loader(param: torch.Tensor, loaded: torch.Tensor, where: tuple[int | None, int | None]) -> None:
    """Copy one expert's shard (or every expert's, `expert` None) into a stacked expert
    parameter [E, rows, ...]: shard s of `param.shard_sizes` along dim 1 (None: all rows).
    `loaded` is the full checkpoint tensor; a parameter with an `expert_split` keeps this
    rank's part of it (another rank's expert is skipped, never copied). Values are
    converted to the parameter's dtype by the copy."""
    part = _rank_part(param, loaded, where)
    if part is None:
        return
    loaded, expert = part
    shard = where[1]
    target = param.data if expert is None else param.data[expert]
    if shard is not None:
        sizes = param.shard_sizes  # type: ignore[attr-defined]
        dim = 1 if expert is None else 0
        target = target.narrow(dim, sum(sizes[:shard]), sizes[shard])
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"expert {where[0]} shard {shard}: shape {tuple(loaded.shape)} does not match the "
                         f"parameter's {tuple(target.shape)}")
    target.copy_(loaded)
    param.loaded_parts.add((expert, shard))  # type: ignore[attr-defined]


def missing_parts(param: torch.Tensor, num_experts: int) -> list[tuple[int, int]]:
    """(expert, shard) pairs of a stacked expert parameter that no checkpoint tensor filled
    (`num_experts`: the experts it holds; indices are its own)."""
    parts = param.loaded_parts  # type: ignore[attr-defined]
    return [(e, s) for e in range(num_experts) for s in range(len(param.shard_sizes))  # type: ignore[attr-defined]
            if not {(None, None), (e, None), (None, s), (e, s)} & parts]


def expert_parameter(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                     shard_sizes: tuple[int, ...] | None = None,
                     intermediate_dim: int | None = None) -> nn.Parameter:
    """Register a stacked expert parameter [E, ...] loaded by `expert_loader` (shards of
    `shard_sizes` rows along its second dim: w13's gate and up). `shape` is this rank's.
    The layer's `expert_split` (FusedMoE sets it before `create_weights`) says which
    experts this rank loads; `intermediate_dim` is the dim of one expert's tensor that
    holds the intermediate size (w13: 0, w2: 1), which tensor parallelism slices (None:
    not sliced; a method that leaves it None cannot claim `supports_tensor_parallel`).
    (Not `tp_dim`: layers.load_shard reads that name and would narrow the tensor itself.)"""
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = expert_loader  # type: ignore[attr-defined]
    p.shard_sizes = shard_sizes or (shape[1],)  # type: ignore[attr-defined]
    p.loaded_parts = set()  # type: ignore[attr-defined]  # (expert, shard) pairs loaded so far
    p.expert_split = getattr(layer, "expert_split", None)  # type: ignore[attr-defined]
    p.intermediate_dim = intermediate_dim  # type: ignore[attr-defined]
    layer.register_parameter(name, p)
    return p


class UnquantizedMoEMethod(MoEMethod):
    """Dense experts in the compute dtype (or `ops.dense_weight_dtype()`, as dense linear
    weights): w13_weight [E, 2I, H], w2_weight [E, H, I] (E and I this rank's: it loads
    tensor- and expert-parallel shares)."""

    supports_tensor_parallel = True

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, params_dtype):
        params_dtype = ops.dense_weight_dtype() or params_dtype
        expert_parameter(layer, "w13_weight", (num_experts, 2 * intermediate_size, hidden_size), params_dtype,
                         (intermediate_size, intermediate_size), intermediate_dim=0)
        expert_parameter(layer, "w2_weight", (num_experts, hidden_size, intermediate_size), params_dtype,
                         intermediate_dim=1)

    def process_after_loading(self, layer):
        pack_dense_experts(layer)

    def apply(self, layer, x, topk_weights, topk_ids):
        return run_dense_experts(layer, x, topk_weights, topk_ids)


def pack_dense_experts(layer: nn.Module) -> None:
    """After loading: hand a layer's dense w13_weight / w2_weight to `ops.pack_moe` (a
    kernel's own layout where one is offered, e.g. the native CPU MoE kernel), dropping
    the plain tensors when the packed form holds its own copy."""
    layer.packed_experts = ops.pack_moe(layer.w13_weight, layer.w2_weight)
    if layer.packed_experts.owns_copy:
        del layer.w13_weight, layer.w2_weight


def run_dense_experts(layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """The dense experts' output, through the packed form once `pack_dense_experts` ran."""
    packed = layer.__dict__.get("packed_experts")
    if packed is not None:
        return packed(x, topk_weights, topk_ids, layer.activation)
    return ops.fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.activation)


class FusedMoE(nn.Module):
    """A layer's routed experts: `forward(x, router_logits)` routes (`ops.select_experts`)
    and runs the chosen experts through its MoEMethod (see the module docstring).

    `num_experts` / `intermediate_size` are the model's; the attributes of those names
    are what this rank holds (what its method's tensors stack), `global_num_experts` the
    model's count. `reduce_results=False` leaves the all-reduce of the ranks' partial
    outputs to the caller (a block that sums several partial terms before one reduce)."""

    def __init__(self, ctx: ModelContext, num_experts: int, top_k: int, hidden_size: int,
                 intermediate_size: int, prefix: str, *, renormalize: bool, scoring: str = "softmax",
                 num_expert_group: int | None = None, topk_group: int | None = None,
                 has_correction_bias: bool = False, routed_scaling_factor: float = 1.0,
                 activation: str = "silu", reduce_results: bool = True) -> None:
        super().__init__()
        if top_k > num_experts:
            raise ValueError(f"{prefix}: top_k {top_k} exceeds the {num_experts} experts")
        self.prefix = f"{prefix}.experts"
        parallel = ctx.parallel
        self.expert_split = ExpertSplit.for_rank(parallel, num_experts, intermediate_size, self.prefix)
        split = self.expert_split
        self.global_num_experts, self.top_k = num_experts, top_k
        self.num_experts = split.num_local_experts
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size // split.tp_size
        self.routing: dict[str, Any] = dict(renormalize=renormalize, scoring=scoring,
                                            num_expert_group=num_expert_group, topk_group=topk_group,
                                            routed_scaling_factor=routed_scaling_factor)
        self.activation = activation
        # the ranks' partial outputs add up over the group that split the experts
        self.reduce_group = parallel.ep if split.is_expert_parallel else parallel.tp
        self.reduce_results = reduce_results
        quant = ctx.quant_config
        method = quant.moe_method(self.prefix) if quant is not None else None
        self.method: MoEMethod = method or UnquantizedMoEMethod()
        if parallel.tp.size > 1 and not self.method.supports_tensor_parallel:
            raise NotImplementedError(f"{self.prefix}: quantized experts ({type(self.method).__name__}) with "
                                      "tensor_parallel_size > 1 are not supported yet")
        self.method.create_weights(self, self.num_experts, hidden_size, self.intermediate_size, ctx.dtype)
        if has_correction_bias:  # DeepSeek-V3: added to the scores when choosing experts (all of them)
            bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            bias.weight_loader = expert_loader  # type: ignore[attr-defined]
            bias.shard_sizes = (num_experts,)  # type: ignore[attr-defined]
            bias.loaded_parts = set()  # type: ignore[attr-defined]
            self.e_score_correction_bias = bias
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = ops.select_experts(router_logits, self.top_k, correction_bias=self.e_score_correction_bias,
                                          **self.routing)
        return self.run_experts(x, weights, ids)

    def run_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' output [T, H] for tokens x [T, H] routed to the model's
        experts `topk_ids` [T, k] with `topk_weights` [T, k] (float32), summed over ranks
        unless `reduce_results` is off.

        Expert parallel: activations are replicated over the group (every rank holds every
        token and computes the same routing), so no token needs to travel: the dispatch
        all-gather of a token-sharded design is the identity here, each rank runs its own
        experts on the tokens routed to them (pairs of another rank's expert get weight 0
        and a local index, so any kernel takes them), and the combine is the sum over
        ranks, which reduce-scatter followed by all-gather (what a replicated output needs)
        amounts to: one all-reduce."""
        split = self.expert_split
        if split.is_expert_parallel:
            local = topk_ids - split.first_expert
            mine = (local >= 0) & (local < split.num_local_experts)
            topk_ids = torch.where(mine, local, torch.zeros_like(local))
            topk_weights = torch.where(mine, topk_weights, torch.zeros_like(topk_weights))
        out = self.method.apply(self, x, topk_weights, topk_ids)
        return self.reduce_group.all_reduce(out) if self.reduce_results else out

    def check_loaded(self) -> None:
        """Refuse a checkpoint that left some expert's tensor unfilled (the model's loader
        sees each stacked parameter as loaded once any expert's tensor arrives)."""
        missing = []
        for name, param in self.named_parameters(recurse=False):
            if not hasattr(param, "loaded_parts") or getattr(param, "optional", False):
                continue
            for e, s in missing_parts(param, self.num_experts):
                if name == "e_score_correction_bias":
                    missing.append(f"{self.prefix.rpartition('.')[0]}.gate.e_score_correction_bias")
                    break
                fused, _, suffix = name.partition("_")
                proj = "down_proj" if fused == "w2" else ("gate_proj", "up_proj")[s]
                missing.append(f"{self.prefix}.{e + self.expert_split.first_expert}.{proj}.{suffix}")
        if missing:
            raise ValueError(f"checkpoint is missing expert weights: {missing[:8]}{' …' if len(missing) > 8 else ''}")

    @staticmethod
    def checkpoint_target(name: str) -> tuple[str, tuple[int | None, int | None]] | None:
        """(our parameter name, (expert, shard)) for a checkpoint tensor of routed experts
        or the routing bias; None for any other tensor (see the module docstring)."""
        m = _PER_EXPERT.match(name)
        if m:
            fused, shard = _PROJ[m["proj"]]
            expert = int(m["expert"]) if m["expert"] is not None else None
            return f"{m['prefix']}.experts.{fused}_{m['suffix']}", (expert, shard)
        m = _STACKED.match(name)
        if m:
            fused, shard = _PROJ[m["proj"]]
            return f"{m['prefix']}.experts.{fused}_weight", (None, shard)
        m = _BIAS.match(name)
        if m:
            return f"{m['prefix']}.experts.e_score_correction_bias", (None, None)
        return None


def process_moe_after_loading(model: nn.Module) -> None:
    """Refuse a checkpoint that left any expert's shard unfilled (a stacked parameter looks
    loaded once one expert fills it). The core then calls each method's
    process_after_loading, as for linear layers."""
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.check_loaded()
