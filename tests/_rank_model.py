"""Helpers for the tensor- and pipeline-parallel model tests that spawned ranks import:
load a tiny checkpoint on a rank's `ParallelState`, and run a batch of prompts through a
prefill and greedy decode steps on the TORCH backend, the stages handing each other their
IntermediateTensors with `state.pp.send / recv` (what the engine's worker does).

`generate(state, path, ...)` returns, on every rank, the greedy tokens, and on a last
pipeline stage also each step's logits; `ParallelState.single()` gives the one-rank
reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from pagedllm.core.contracts import (
    AttentionContext,
    BatchLayout,
    IntermediateTensors,
    ModelContext,
)
from pagedllm.core.parallel import Group, ParallelLayout, ParallelState

BLOCK_SIZE = 16
PROMPTS = ([5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 128, 33, 2, 77, 150, 9, 200, 11, 45],  # > one block
           [8, 260, 31, 4, 90, 6, 321])
STEPS = 8  # decode steps after the prefill
INTERMEDIATE = ("hidden_states", "residual")


def fake_state(tp: int, pp: int, rank: int) -> ParallelState:
    """Rank `rank`'s groups of a tp x pp layout without torch.distributed: enough to build
    and load a model (which calls no collective), not to run it."""
    layout = ParallelLayout(tp, pp)
    pp_rank, tp_rank = layout.coords(rank)
    return ParallelState(layout, rank, Group(layout.tp_ranks(pp_rank), rank), Group(layout.pp_ranks(tp_rank), rank),
                         Group(list(range(layout.world_size)), rank))


def model_context(hf_config: Any, state: ParallelState, quant_config: Any = None) -> ModelContext:
    from pagedllm.core.plugins import get_registry

    return ModelContext(hf_config=hf_config, dtype=torch.float32, device=torch.device("cpu"),
                        attention_backend=get_registry().attention_backends["TORCH"], block_size=BLOCK_SIZE,
                        quant_config=quant_config, parallel=state)


def build_model(state: ParallelState, path: str | Path) -> tuple[torch.nn.Module, Any]:
    """The checkpoint's model class built on `state`, not loaded yet, and its ModelSource."""
    from pagedllm.core.loader import open_model
    from pagedllm.core.plugins import get_registry

    registry = get_registry()
    source = open_model(str(path), "auto", registry, {})
    model_cls = registry.model_class(list(source.hf_config.architectures))
    return model_cls(model_context(source.hf_config, state)), source


def load_model(state: ParallelState, path: str | Path) -> torch.nn.Module:
    """`build_model`, loaded (this rank's part) and packed as the worker packs it."""
    from pagedllm.core.worker import process_after_loading

    model, source = build_model(state, path)
    model.load_weights(source.weights())
    process_after_loading(model)
    return model.eval()


def layout(tokens: Sequence[Sequence[int]], computed: Sequence[int], block_ids: Sequence[Sequence[int]]) -> BatchLayout:
    """The flattened batch of `tokens[i]` new tokens after `computed[i]` cached ones per
    request, over the blocks `block_ids[i]` (the worker's layout, for a few requests)."""
    input_ids, positions, slots, qsl = [], [], [], [0]
    for ids, done, blocks in zip(tokens, computed, block_ids):
        for j, t in enumerate(ids):
            p = done + j
            input_ids.append(t)
            positions.append(p)
            slots.append(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        qsl.append(qsl[-1] + len(ids))
    width = max(len(b) for b in block_ids)
    tables = torch.tensor([list(b) + [0] * (width - len(b)) for b in block_ids], dtype=torch.int32)
    seq_lens = torch.tensor([d + len(t) for d, t in zip(computed, tokens)], dtype=torch.int32)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    return BatchLayout(input_ids=torch.tensor(input_ids), positions=torch.tensor(positions),
                       slot_mapping=torch.tensor(slots), block_tables=tables, query_start_loc=qsl_t,
                       seq_lens=seq_lens, query_start_loc_cpu=qsl_t, seq_lens_cpu=seq_lens,
                       max_query_len=max(len(t) for t in tokens), max_seq_len=int(seq_lens.max()),
                       block_size=BLOCK_SIZE)


def kv_caches(model: torch.nn.Module, state: ParallelState, num_blocks: int) -> list[torch.Tensor]:
    """One cache per decoder layer (indexed by global layer), shaped by this rank's head
    counts; layers of other stages get empty tensors."""
    backend = model.context.attention_backend
    spec = type(model).kv_cache_spec(model.context.hf_config).for_tensor_parallel(state.tp.size)
    shape = backend.cache_shape(num_blocks, BLOCK_SIZE, spec)
    held = state.stage_layers(spec.num_layers)
    return [torch.zeros(shape) if i in held else torch.empty(0) for i in range(spec.num_layers)]


def run_stage(model: torch.nn.Module, state: ParallelState, batch: BatchLayout,
              attn: AttentionContext) -> torch.Tensor | None:
    """One forward of this rank's stage: receive the previous stage's tensors, run, hand
    them on; the last stage returns its hidden states (others None)."""
    pp, hidden = state.pp, model.context.hf_config.hidden_size
    intermediate = None
    if not pp.first:
        shape = (batch.num_tokens, hidden)
        intermediate = IntermediateTensors({k: pp.recv(shape, torch.float32, src=pp.rank - 1) for k in INTERMEDIATE})
    out = model(batch.input_ids, batch.positions, attn, intermediate)
    if pp.last:
        return out
    for k in INTERMEDIATE:
        pp.send(out[k], dst=pp.rank + 1)
    return None


def generate(state: ParallelState, path: str | Path, prompts: Sequence[Sequence[int]] = PROMPTS,
             steps: int = STEPS) -> dict[str, Any]:
    """Greedy tokens of every prompt (a batched prefill, then `steps` batched decodes);
    a last stage also returns each step's logits of the sampled rows. The model is built
    outside inference mode, as the worker builds it."""
    model = load_model(state, path)
    with torch.inference_mode():
        return _decode(model, state, prompts, steps)


def _decode(model: torch.nn.Module, state: ParallelState, prompts: Sequence[Sequence[int]],
            steps: int) -> dict[str, Any]:
    per_seq = -(-(max(map(len, prompts)) + steps + 1) // BLOCK_SIZE)
    block_ids = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(prompts))]
    caches = kv_caches(model, state, 1 + len(prompts) * per_seq)
    spec = type(model).kv_cache_spec(model.context.hf_config).for_tensor_parallel(state.tp.size)
    builder = model.context.attention_backend.builder_cls()(  # as the worker's: MLA's kind too
        model.context.attention_spec(*_rank_heads(model, state), kind=spec.kind, value_size=spec.value_size))
    # the tokens come from tp rank 0 of the last stage (every rank of it has the same logits)
    sampler_rank = (state.pp.size - 1) * state.tp.size
    new, computed = [list(p) for p in prompts], [0] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    logits_per_step: list[torch.Tensor] = []
    for _ in range(steps + 1):
        batch = layout(new, computed, block_ids)
        hidden = run_stage(model, state, batch, AttentionContext(builder.build(batch), caches))
        picked = None
        if hidden is not None:
            logits = model.compute_logits(hidden[batch.query_start_loc[1:].long() - 1])
            logits_per_step.append(logits)
            picked = logits.argmax(dim=-1).tolist()
        picked = state.world.broadcast_object(picked, src=sampler_rank)
        computed = [c + len(n) for c, n in zip(computed, new)]
        new = [[t] for t in picked]
        for seq, t in zip(tokens, picked):
            seq.append(t)
    out: dict[str, Any] = {"tokens": tokens}
    if state.pp.last:
        out["logits"] = torch.stack(logits_per_step)
    return out


def _rank_heads(model: torch.nn.Module, state: ParallelState) -> tuple[int, int, int]:
    spec = type(model).kv_cache_spec(model.context.hf_config).for_tensor_parallel(state.tp.size)
    return spec.num_heads, spec.num_kv_heads, spec.head_size


def generate_all(state: ParallelState, paths: Sequence[str]) -> list[dict[str, Any]]:
    """`generate` for several checkpoints in one set of spawned ranks (spawning is the slow part)."""
    return [generate(state, p) for p in paths]


def assert_same_as_one_rank(ranks: Sequence[dict[str, Any]], ref: dict[str, Any], last: Sequence[int],
                            atol: float = 1e-4) -> None:
    """Every rank decoded the one-rank reference's greedy tokens, and the ranks of the last
    pipeline stage (`last`, global ranks) also got its logits within `atol` (float32)."""
    assert all(len(set(seq)) > 3 for seq in ref["tokens"]), "a degenerate reference proves nothing"
    for rank, got in enumerate(ranks):
        assert got["tokens"] == ref["tokens"], f"rank {rank}"
        assert ("logits" in got) == (rank in last), f"rank {rank}"
        if rank in last:
            assert got["logits"].shape == ref["logits"].shape, f"rank {rank}"
            torch.testing.assert_close(got["logits"], ref["logits"], atol=atol, rtol=0, msg=f"rank {rank}")


def assert_one_rank_is_transformers_greedy(checkpoints: dict[str, str], one_rank: dict[str, dict[str, Any]]) -> None:
    """Anchors a one-rank reference: its greedy tokens are transformers' on each checkpoint."""
    from tests.test_llm import hf_greedy

    for name, path in checkpoints.items():
        want = [tokens for tokens, _ in hf_greedy(path, [list(p) for p in PROMPTS], STEPS + 1)]
        assert one_rank[name]["tokens"] == want, name


def assert_layout_decodes_what_one_rank_does(layout, checkpoints: dict[str, str], names: Sequence[str],
                                             one_rank: dict[str, dict[str, Any]]) -> None:
    """`names` run on the ranks of `layout` (a ParallelLayout) in one spawn: every rank
    decodes one rank's tokens, the last stage's ranks get its logits."""
    from tests._distributed import run_ranks

    per_rank = run_ranks(generate_all, layout, [checkpoints[n] for n in names])
    last_stage = range((layout.pipeline_parallel_size - 1) * layout.tensor_parallel_size, layout.world_size)
    for i, name in enumerate(names):
        assert_same_as_one_rank([rank[i] for rank in per_rank], one_rank[name], last=list(last_stage))
