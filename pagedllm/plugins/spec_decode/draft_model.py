"""draft_model: a smaller model with the target's tokenizer drafts k tokens greedily.

The draft is built by the target's own machinery (`ProposerContext.load_model`: the same
loader, quantizers, attention backend and step replay) and keeps its own KV-cache layers,
which share the target's block table: a request's slot for position p is the same in
both caches, so the scheduler's blocks (with `num_lookahead_slots` = k reserved past a
sampling step) hold the draft's keys too, and the memory plan counts its layers.

Per request the proposer remembers how many leading tokens its cache holds. After a
step it feeds the tokens it has not seen (the whole prompt on first sight, then the
target's token and any accepted draft it did not feed itself) as one chunk, takes the
argmax, then feeds each draft back for k - 1 single-token steps. Drafts are a function of
the context (argmax), so the rejection sampler treats them as one-hot: exact at any
temperature. A vocabulary mismatch with the target fails at start-up.
"""

from __future__ import annotations

import torch

from pagedllm.core.contracts import AttentionContext, KVCacheSpec, ProposalBatch, ProposerContext, SpecProposer

SAMPLE_TOKENS = 64  # token strings compared between the target's and the draft's tokenizer


class DraftModelProposer(SpecProposer):
    name = "draft_model"
    needs_model = True

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        self.draft = context.load_model(context.config.model, context.config.quantization)
        check_same_vocabulary(context.hf_config, context.tokenizer, self.draft.hf_config, self.draft.tokenizer,
                              context.config.model)
        self.cached: dict[str, int] = {}  # request id -> leading tokens whose keys the draft cache holds
        self.fed: dict[str, int] = {}  # request id -> drafts of its last proposal fed back (cached if accepted)

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.draft.kv_spec

    def forget(self, request_id: str) -> None:
        self.cached.pop(request_id, None)
        self.fed.pop(request_id, None)

    def _forward(self, tokens: list[list[int]], cached: list[int], blocks: list[list[int]]) -> torch.Tensor:
        """The draft's argmax after each request's chunk."""
        lens = [len(t) for t in tokens]
        layout = self.context.make_layout(tokens, cached, lens, blocks)
        attn = AttentionContext(self.draft.build_metadata(layout), self.kv_caches)
        hidden = self.draft.run(layout, attn)
        last = layout.query_start_loc_cpu[1:].to(torch.long) - 1
        return self.draft.model.compute_logits(hidden[last.to(hidden.device)]).argmax(dim=-1)

    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in batch.request_ids]
        active = [i for i, cap in enumerate(batch.max_drafts) if cap > 0]
        if not active:
            return out
        tokens, cached, blocks = [], [], []
        for i in active:
            rid, ids = batch.request_ids[i], batch.token_ids[i]
            n = len(ids)
            have = self.cached.get(rid)
            if have is None:  # first sight, or back after a preemption freed its blocks
                have = 0
            else:  # the drafts it fed back itself and the target accepted are cached too
                have = min(have + min(batch.num_accepted[i], self.fed.get(rid, 0)), n - 1)
            tokens.append(list(ids[have:]))
            cached.append(have)
            blocks.append(list(batch.block_ids[i]))
            self.cached[rid] = n
            self.fed[rid] = 0
        picked = self._forward(tokens, cached, blocks).tolist()
        for i, token in zip(active, picked):
            out[i].append(token)
        rows = list(active)
        positions = {i: len(batch.token_ids[i]) for i in active}
        while True:
            rows = [i for i in rows if len(out[i]) < batch.max_drafts[i]]
            if not rows:
                return out
            picked = self._forward([[out[i][-1]] for i in rows], [positions[i] + len(out[i]) - 1 for i in rows],
                                   [list(batch.block_ids[i]) for i in rows]).tolist()
            for i, token in zip(rows, picked):
                self.fed[batch.request_ids[i]] += 1
                out[i].append(token)


def check_same_vocabulary(target_config, target_tokenizer, draft_config, draft_tokenizer, path: str) -> None:
    """A draft must speak the target's token ids: same vocabulary size and the same strings
    for a spread of ids (a clear error names what differs)."""
    tv, dv = target_config.vocab_size, draft_config.vocab_size
    if tv != dv:
        raise ValueError(f"the draft model {path} has vocab_size {dv}, the target {tv}: a draft needs the "
                         "target's tokenizer")
    size = min(len(target_tokenizer), len(draft_tokenizer)) if hasattr(target_tokenizer, "__len__") else tv
    ids = sorted({int(i * (size - 1) / (SAMPLE_TOKENS - 1)) for i in range(SAMPLE_TOKENS)})
    theirs, ours = draft_tokenizer.convert_ids_to_tokens(ids), target_tokenizer.convert_ids_to_tokens(ids)
    differ = [(i, a, b) for i, a, b in zip(ids, ours, theirs) if a != b]
    if differ:
        i, a, b = differ[0]
        raise ValueError(f"the draft model {path} has another tokenizer than the target: token {i} is {b!r} "
                         f"there, {a!r} in the target ({len(differ)} of {len(ids)} sampled ids differ)")
