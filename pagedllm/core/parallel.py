"""Ranks and process groups, and the collectives model layers call.

One process per rank. Ranks are numbered the way vLLM numbers them: rank =
pp_rank x tp_size + tp_rank, so a tensor-parallel group is tp_size consecutive ranks
and a pipeline stage's ranks are a stride of tp_size apart. The expert-parallel group
(`--enable-expert-parallel`) is the tensor-parallel group: experts are spread over the
ranks that would otherwise split each expert's matrices.

Every collective is a no-op on a group of one, so a layer calls `all_reduce` without
asking whether it runs alone, and a one-rank engine never touches torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelLayout:
    """How many ranks of each kind one engine uses."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def coords(self, rank: int) -> tuple[int, int]:
        """(pp_rank, tp_rank) of global `rank`."""
        return divmod(rank, self.tensor_parallel_size)

    def tp_ranks(self, pp_rank: int) -> list[int]:
        tp = self.tensor_parallel_size
        return list(range(pp_rank * tp, (pp_rank + 1) * tp))

    def pp_ranks(self, tp_rank: int) -> list[int]:
        return [p * self.tensor_parallel_size + tp_rank for p in range(self.pipeline_parallel_size)]


class Group:
    """One process group: its global ranks, this process's place in it, collectives.

    `group` is the torch.distributed group (None when the group is this process alone)."""

    def __init__(self, ranks: list[int], rank: int, group: Any = None) -> None:
        self.ranks = list(ranks)
        self.rank_in_group = self.ranks.index(rank)
        self.group = group

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's rank in the group (0 .. size - 1)."""
        return self.rank_in_group

    @property
    def first(self) -> bool:
        return self.rank_in_group == 0

    @property
    def last(self) -> bool:
        return self.rank_in_group == self.size - 1

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The elementwise sum (or "min", "max") over the group, in place; returns `x`."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        dist.all_reduce(x, op=ops[op], group=self.group)
        return x

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (each rank's KV blocks -> the one block count)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        # NCCL reduces GPU tensors only
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" \
            else torch.device("cpu")
        return int(self.all_reduce(torch.tensor([value], dtype=torch.int64, device=device), "min").item())

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` (same shape everywhere) concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """`obj` from the group's rank `src` (its index in the group), on every rank."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.group)
        return box[0]

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Point to point to the group's rank `dst` (pipeline stages hand tensors on)."""
        import torch.distributed as dist

        dist.send(x.contiguous(), dst=self.ranks[dst], group=self.group)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, device: torch.device | str = "cpu") -> torch.Tensor:
        import torch.distributed as dist

        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, src=self.ranks[src], group=self.group)
        return out

    def send_tensors(self, tensors: dict[str, torch.Tensor], dst: int) -> None:
        """Named tensors to the group's rank `dst`: their names, shapes and dtypes first (one
        small object), then each tensor, so the receiver needs to know nothing in advance."""
        import torch.distributed as dist

        header = [[(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]]
        dist.send_object_list(header, dst=self.ranks[dst], group=self.group)
        for t in tensors.values():
            self.send(t, dst)

    def recv_tensors(self, src: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        import torch.distributed as dist

        header: list = [None]
        dist.recv_object_list(header, src=self.ranks[src], group=self.group)
        return {name: self.recv(shape, dtype, src, device) for name, shape, dtype in header[0]}


@dataclass
class ParallelState:
    """This process's rank and groups: what model layers, the worker and the executor read.

    `ParallelState.single()` is the one-rank state every engine has unless it asks for
    more; its groups are all this process alone."""

    layout: ParallelLayout
    rank: int
    tp: Group
    pp: Group
    world: Group

    @classmethod
    def single(cls) -> "ParallelState":
        return cls(ParallelLayout(), 0, Group([0], 0), Group([0], 0), Group([0], 0))

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler, receives the logits and samples."""
        return self.rank == 0

    @property
    def ep(self) -> Group:
        """The expert-parallel group: the tensor-parallel ranks, when experts are spread."""
        return self.tp

    @property
    def expert_parallel(self) -> bool:
        return self.layout.enable_expert_parallel and self.tp.size > 1

    def stage_layers(self, num_layers: int) -> range:
        """The decoder layers this rank's pipeline stage holds (see `stage_layers`)."""
        return stage_layers(num_layers, self.pp.size, self.pp.rank)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Layers [start, end) of pipeline stage `pp_rank`: an even split, the first stages
    taking one fewer when it does not divide (the first stage also embeds, the last also
    computes logits, so neither should get the extra layers)."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} is larger than the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    # the last `extra` stages take base + 1
    sizes = [base + (1 if p >= pp_size - extra else 0) for p in range(pp_size)]
    start = sum(sizes[:pp_rank])
    return range(start, start + sizes[pp_rank])


def init_parallel_state(layout: ParallelLayout, rank: int, init_method: str, backend: str,
                        timeout_s: float = 600.0) -> ParallelState:
    """Join the job's process group (one call per rank, all ranks together) and make the
    tensor- and pipeline-parallel sub-groups. Every rank creates every group, in the same
    order, as torch.distributed requires."""
    import datetime

    import torch.distributed as dist

    world = layout.world_size
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank,
                                timeout=datetime.timedelta(seconds=timeout_s))
    pp_rank, tp_rank = layout.coords(rank)
    tp_group = pp_group = None
    for p in range(layout.pipeline_parallel_size):
        ranks = layout.tp_ranks(p)
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if p == pp_rank:
            tp_group = group
    for t in range(layout.tensor_parallel_size):
        ranks = layout.pp_ranks(t)
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if t == tp_rank:
            pp_group = group
    return ParallelState(layout, rank, Group(layout.tp_ranks(pp_rank), rank, tp_group),
                         Group(layout.pp_ranks(tp_rank), rank, pp_group),
                         Group(list(range(world)), rank, dist.group.WORLD if world > 1 else None))


def destroy_parallel_state() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
