"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeded generators.

Every row is processed in one batch. A draw takes one uniform number per row, mapped
through the row's cumulative distribution (`_inverse_cdf`): a race of one exponential
per vocabulary entry samples the same distribution but drew 1.5M random numbers per
step for 32 rows (35 ms on a CPU core, longer than the model's step). A seeded request
draws its number from its own generator, so its tokens do not depend on the batch
around it. Top-k / top-p look only at each row's leading candidates (`_candidates`),
not at a full sort of the vocabulary. Logprobs are those of the model's raw
distribution (before any processing), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from pagedllm.core.contracts.logits import bitmask_bias, bitmask_empty, bitmask_words, pack_bitmask
from pagedllm.core.plugins import get_registry
from pagedllm.core.request import Request, SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: (sampled token logprob, sampled token rank, top ids, top logprobs) or None
    logprobs: list[tuple[float, int, list[int], list[float]] | None]


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator | None:
        if req.params.seed is None:
            return None
        gen = self.request_generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(req.params.seed)
            self.request_generators[req.request_id] = gen
        return gen

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits [len(requests), vocab] float32 -> one token per row."""
        raw = logits
        logits = self._penalize(logits, requests)
        params = [r.params for r in requests]
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        if bool(greedy.all()):
            tokens = _argmax(logits)
        else:
            tokens = self._random(logits, requests, greedy)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw, tokens, requests))

    # ------------------------------------------------------------------ processing

    def _penalize(self, logits: torch.Tensor, requests: list[Any],
                  drafts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """The logits to sample from: token rules (allowed_token_ids, bad_words,
        logit_bias), min_tokens bans, repetition penalties, then the logits processors'
        masks (structured outputs). A copy where any applies (the raw logits stay for
        logprobs), `logits` itself where none does. `drafts` (verify steps): each
        request's drafts, whose rows `requests` lists one per verified position."""
        bans = []
        for i, req in enumerate(requests):
            p = req.params
            if req.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + list(req.eos_token_ids)
                if banned:
                    bans.append((i, banned))
        ruled = [i for i, r in enumerate(requests) if r.params.has_token_rules]
        needs = [i for i, r in enumerate(requests) if _has_penalty(r.params)]
        constrained = any(r.logits_processors for r in requests)
        if not bans and not needs and not ruled and not constrained:
            return logits
        logits = logits.clone()
        for i in ruled:
            _apply_token_rules(logits[i], requests[i])
        for i, banned in bans:
            logits[i, banned] = float("-inf")
        vocab = logits.shape[1]
        for i in needs:
            req, p = requests[i], requests[i].params
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
                seen[torch.tensor(req.all_token_ids, device=logits.device)] = True
                penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row = torch.where(seen, penalized, row)
            if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
                counts = torch.bincount(torch.tensor(req.output_token_ids, device=logits.device),
                                        minlength=vocab)[:vocab].to(row.dtype)
                row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
            logits[i] = row
        if constrained:
            _apply_processors(logits, requests, drafts)
        return logits

    def _distributions(self, logits: torch.Tensor, requests: list[Request]):
        """Each row's sampling distribution after temperature, top-k / top-p and min-p:
        yields (row indices, probabilities [rows, W] (unnormalized where min-p cut),
        their token ids [rows, W], or None where W is the whole vocabulary)."""
        params = [r.params for r in requests]
        dev = logits.device
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
        scaled = logits / temps[:, None]
        vocab = logits.shape[-1]
        top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        truncated = (top_k > 0) | (top_p < 1.0)
        for rows, cut in ((truncated, True), (~truncated, False)):
            if not bool(rows.any()):
                continue
            index = rows.nonzero().squeeze(1)
            part = scaled[index] if len(index) < len(requests) else scaled
            ids = None
            if cut:
                part, ids = _candidates(part, top_k[index], top_p[index])
            probs = torch.softmax(part, dim=-1)
            floor = min_p[index]
            if bool((floor > 0).any()):
                keep = probs >= floor[:, None] * probs.max(dim=-1, keepdim=True).values
                probs = torch.where(keep, probs, torch.zeros_like(probs))
            yield index, probs, ids

    def _random(self, logits: torch.Tensor, requests: list[Request], greedy: torch.Tensor) -> torch.Tensor:
        uniforms = self._uniforms(requests)
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        for index, probs, ids in self._distributions(logits, requests):
            picked = _inverse_cdf(probs, uniforms[index])
            tokens[index] = picked if ids is None else ids.gather(1, picked[:, None]).squeeze(1)
        if bool(greedy.any()):
            tokens = torch.where(greedy, _argmax(logits), tokens)
        return tokens

    # ------------------------------------------------------------------ speculative decoding

    def verify(self, logits: torch.Tensor, requests: list[Request], drafts: list[Sequence[int]],
               draft_probs: torch.Tensor | None = None) -> tuple[list[list[int]], list[list[Any]]]:
        """Rejection sampling of speculative drafts: each request's tokens and logprobs.

        logits: [sum(len(d) + 1), vocab] float32, request i's len(drafts[i]) + 1 rows in
        order (row j scores the token after draft j - 1; the last row is the bonus).
        draft_probs: [sum(len(d)), vocab], the proposer's distribution q at each draft, or
        None where drafts are deterministic (ngram, suffix, greedy drafting: q one-hot).

        A greedy request keeps drafts while each equals the target's argmax, then the
        argmax. A sampled one accepts draft x with probability min(1, p(x) / q(x)) and
        at the first rejection draws from norm(max(p - q, 0)); with every draft accepted
        it draws the bonus token from p. p is the distribution the request would sample
        from (penalties, temperature, top-k/p, min-p), with the drafts before a position
        counted as generated: the tokens are distributed exactly as without speculation.
        """
        rows = _ahead_rows(requests, drafts)
        n = len(rows)
        if logits.shape[0] != n:
            raise ValueError(f"verify: {logits.shape[0]} logits rows for {n} rows (each request's drafts + 1)")
        raw = logits
        logits = self._penalize(logits, rows, drafts)
        dev = logits.device
        offsets = [0]
        for d in drafts:
            offsets.append(offsets[-1] + len(d) + 1)
        if all(r.params.greedy for r in rows):
            # greedy: one argmax over the rows and a comparison in Python (the tensor
            # bookkeeping below cost ~0.2 ms of a ~7 ms single-stream verify step)
            token_list = _argmax(logits).tolist()
            accepted_list = [False] * n
            for i, d in enumerate(drafts):
                for j, x in enumerate(d):
                    accepted_list[offsets[i] + j] = token_list[offsets[i] + j] == x
        else:
            token_list, accepted_list = self._verify_sampled(logits, rows, drafts, offsets, draft_probs)
        out_tokens: list[list[int]] = []
        emitted_rows: list[int] = []
        for i, d in enumerate(drafts):
            base = offsets[i]
            taken: list[int] = []
            for j in range(len(d) + 1):
                emitted_rows.append(base + j)
                if j < len(d) and accepted_list[base + j]:
                    taken.append(int(d[j]))
                    continue
                taken.append(token_list[base + j])
                break
            out_tokens.append(taken)
        logprobs: list[list[Any]] = [[] for _ in drafts]
        if any(r.params.logprobs is not None for r in requests):
            index = torch.tensor(emitted_rows, device=dev)
            chosen = torch.tensor([t for ts in out_tokens for t in ts], device=dev)
            entries = self._logprobs(raw[index], chosen, [rows[r] for r in emitted_rows])
            at = 0
            for i, ts in enumerate(out_tokens):
                logprobs[i] = entries[at:at + len(ts)] if requests[i].params.logprobs is not None else []
                at += len(ts)
        return out_tokens, logprobs

    def _verify_sampled(self, logits: torch.Tensor, rows: list[Any], drafts: list[Sequence[int]],
                        offsets: list[int], draft_probs: torch.Tensor | None) -> tuple[list[int], list[bool]]:
        """`verify`'s tokens and acceptances where some row samples: per row, the token it
        takes at a rejection (or after its last draft) and whether its draft is accepted."""
        n, dev = len(rows), logits.device
        flat_drafts = torch.full((n,), -1, dtype=torch.long)
        draft_row = []  # row of each draft token, in draft_probs order
        for i, d in enumerate(drafts):
            if d:
                flat_drafts[offsets[i]:offsets[i] + len(d)] = torch.tensor(list(d), dtype=torch.long)
                draft_row.extend(range(offsets[i], offsets[i] + len(d)))
        flat_drafts = flat_drafts.to(dev)
        greedy = torch.tensor([r.params.greedy for r in rows], device=dev)
        token = _argmax(logits)
        accepted = token == flat_drafts
        q_index = torch.full((n,), -1, dtype=torch.long, device=dev)
        if draft_probs is not None and draft_row:
            q_index[torch.tensor(draft_row, device=dev)] = torch.arange(len(draft_row), device=dev)
        u_accept, u_draw = self._uniforms(rows), self._uniforms(rows)
        sampled_rows = (~greedy).nonzero().squeeze(1)
        part = [rows[i] for i in sampled_rows.tolist()]
        for index, probs, ids in self._distributions(logits[sampled_rows], part):
            index = sampled_rows[index]
            x = flat_drafts[index]
            probs = probs.to(torch.float64)
            probs = probs / probs.sum(dim=-1, keepdim=True)
            has_draft = x >= 0
            if draft_probs is None and ids is None:
                # q one-hot at x: accept with probability p(x); max(p - q, 0) is p without x
                # (gathers and one scatter, not [rows, vocab] one-hot products)
                at = x.clamp(min=0)[:, None]
                p_x = torch.where(has_draft, probs.gather(1, at).squeeze(1), torch.zeros_like(x, dtype=probs.dtype))
                accepted[index] = has_draft & (u_accept[index] < p_x)
                picked = _inverse_cdf(_residual(probs, x, has_draft), u_draw[index])
                token[index] = picked
                continue
            at_x = (ids == x[:, None]) if ids is not None else \
                torch.nn.functional.one_hot(x.clamp(min=0), probs.shape[-1]).bool() & (x[:, None] >= 0)
            p_x = (probs * at_x).sum(dim=-1)
            qi = q_index[index]
            if draft_probs is None:
                q = at_x.to(probs.dtype)
            else:
                q_rows = draft_probs[qi.clamp(min=0)].to(torch.float64)
                q = q_rows if ids is None else q_rows.gather(1, ids)
                q = torch.where((qi >= 0)[:, None], q, torch.zeros_like(q))
            q_x = (q * at_x).sum(dim=-1)
            accepted[index] = has_draft & (u_accept[index] * q_x < p_x)
            residual = _residual(probs, q, has_draft)
            picked = _inverse_cdf(residual, u_draw[index])
            token[index] = picked if ids is None else ids.gather(1, picked[:, None]).squeeze(1)
        return token.tolist(), accepted.tolist()

    def _uniforms(self, requests: list[Request]) -> torch.Tensor:
        """One uniform number in [0, 1) per row (float64): from the request's own generator
        where it has a seed, else from the sampler's."""
        u = torch.rand(len(requests), dtype=torch.float64, generator=self.generator, device=self.device)
        for i, req in enumerate(requests):
            gen = self._generator(req)
            if gen is not None:
                u[i] = torch.rand(1, dtype=torch.float64, generator=gen, device=self.device)[0]
        return u

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, requests: list[Any]):
        return logprob_entries(raw, tokens, [r.params.logprobs for r in requests])


def logprob_entries(raw: torch.Tensor, tokens: torch.Tensor, wanted: Sequence[int | None]) -> list[Any]:
    """Per row of `raw` logits: (logprob of `tokens[row]`, its rank, the `wanted[row]` most
    likely ids and their logprobs), or None where `wanted[row]` is None. What sampled
    tokens and prompt tokens (`prompt_logprobs`) both report."""
    if all(w is None for w in wanted):
        return [None] * len(wanted)
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    k = max(w or 0 for w in wanted)
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    ids = top_ids.tolist() if k else [[]] * len(wanted)
    vals = top_vals.tolist() if k else [[]] * len(wanted)
    return [None if w is None else (c, r, i[:w], v[:w])
            for w, c, r, i, v in zip(wanted, chosen.tolist(), ranks.tolist(), ids, vals)]


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index, as `argmax` (NaN counts as the maximum there too).

    A plugin's implementation of the `argmax_rows` op serves it where one runs here (the
    native CPU kernel reads the logits once: 0.18 ms for 32 x 49152 against 0.95 ms);
    else `max(dim).indices`, which gives argmax's answer in 0.6x its time on the CPU."""
    impl = get_registry().op_impl("argmax_rows", logits.device, logits.dtype) if logits.dim() == 2 else None
    return impl.fn(logits) if impl is not None else logits.max(dim=-1).indices


CANDIDATES = 1024  # leading tokens a nucleus (top-p) row is first looked for in


def _candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-k and nucleus (top-p) set: (logits [rows, K], their token ids), best
    first, -inf past each row's set; K is at most the vocabulary.

    top-p applies to the distribution renormalized over the row's top-k (vLLM's order),
    or over the whole vocabulary where the row has no top-k. A row with top-k only
    needs its k best tokens; a nucleus row is looked for among the best CANDIDATES
    tokens, then 8x as many, then the whole vocabulary (a full sort), until the
    candidates hold its mass top_p.
    """
    vocab = logits.shape[-1]
    nucleus_only = (top_k == 0) & (top_p < 1.0)
    k = int(top_k.max())
    want = max(k, CANDIDATES) if bool(nucleus_only.any()) else k
    full_lse = torch.logsumexp(logits, dim=-1) if bool(nucleus_only.any()) else None
    while True:
        width = min(vocab, want)
        vals, ids = logits.topk(width, dim=-1, sorted=True)
        ranks = torch.arange(width, device=logits.device)[None, :]
        limit = torch.where(top_k > 0, top_k, torch.full_like(top_k, width))
        vals = vals.masked_fill(ranks >= limit[:, None], float("-inf"))
        lse = torch.logsumexp(vals, dim=-1)
        if full_lse is not None:
            lse = torch.where(nucleus_only, full_lse, lse)
        probs = torch.exp(vals - lse[:, None]).to(torch.float64)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token (float64: exact cut)
        held = before[:, -1] + probs[:, -1]
        if width == vocab or not bool((nucleus_only & (held < top_p)).any()):
            break
        want = width * 8 if width * 8 < vocab // 2 else vocab
    cut = before >= top_p[:, None]
    cut[:, 0] = False  # always keep the most likely token
    return vals.masked_fill(cut, float("-inf")), ids


CHUNK = 1024  # tokens per first-level slice of `_inverse_cdf`


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the index whose cumulative-probability interval holds u x (the row's
    total): an exact draw from the row's (unnormalized) distribution with one random
    number. Two levels in float64, so that no float32 running sum over a whole
    vocabulary blurs the small probabilities: the slice of CHUNK entries the draw falls
    in, then the entry within it. Never returns an entry of probability 0."""
    rows, width = probs.shape
    slices = -(-width // CHUNK)
    if slices * CHUNK != width:
        probs = torch.nn.functional.pad(probs, (0, slices * CHUNK - width))
    chunks = probs.view(rows, slices, CHUNK)
    cum = chunks.sum(dim=-1).to(torch.float64).cumsum(dim=-1)
    target = u * cum[:, -1]
    which = torch.searchsorted(cum, target[:, None], right=True).squeeze(1).clamp(max=slices - 1)
    before = torch.where(which > 0, cum.gather(1, (which - 1).clamp(min=0)[:, None]).squeeze(1),
                         torch.zeros_like(target))
    inner = chunks[torch.arange(rows, device=probs.device), which].to(torch.float64).cumsum(dim=-1)
    # Rounding can leave the target at or past the slice's own total: stay inside it.
    rest = torch.minimum(target - before, inner[:, -1] * (1 - 2.0 ** -40))
    within = torch.searchsorted(inner, rest[:, None], right=True).squeeze(1).clamp(max=CHUNK - 1)
    return which * CHUNK + within


def _residual(probs: torch.Tensor, q: torch.Tensor, has_draft: torch.Tensor) -> torch.Tensor:
    """What a row draws from when its draft is rejected: max(p - q, 0) (unnormalized),
    or p itself on a bonus row (no draft) or where p - q has no mass left (p == q, where
    a rejection cannot happen exactly but rounding might). `q` may be the draft token ids
    [rows] (integers): q one-hot there, so max(p - q, 0) is p with that token's entry 0."""
    if not q.is_floating_point():
        at = q.clamp(min=0)[:, None]
        residual = probs.scatter(1, at, torch.where(has_draft[:, None], 0.0, probs.gather(1, at)))
    else:
        residual = torch.where(has_draft[:, None], (probs - q).clamp(min=0), probs)
    empty = residual.sum(dim=-1) <= 0
    return torch.where(empty[:, None], probs, residual)


class _Ahead:
    """A request as seen from a later position of its speculative run: the drafts before
    that position count as generated (penalties and min_tokens read them)."""

    __slots__ = ("request_id", "params", "eos_token_ids", "output_token_ids", "all_token_ids",
                 "bad_words_token_ids", "logits_processors")

    def __init__(self, req: Request, drafts: Sequence[int]) -> None:
        self.request_id = req.request_id
        self.params = req.params
        self.eos_token_ids = req.eos_token_ids
        self.bad_words_token_ids = req.bad_words_token_ids
        self.logits_processors = req.logits_processors
        self.output_token_ids = req.output_token_ids + list(drafts)
        self.all_token_ids = req.all_token_ids + list(drafts)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def _has_penalty(params: SamplingParams) -> bool:
    """Whether the request's logits depend on the tokens generated so far (penalties)."""
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty)


def _ahead_rows(requests: list[Request], drafts: list[Sequence[int]]) -> list[Any]:
    """One entry per verified row: the request itself where nothing reads its history
    (no penalty, min_tokens reached), else the request as of that row (`_Ahead`)."""
    rows: list[Any] = []
    for req, d in zip(requests, drafts):
        if not _has_penalty(req.params) and not req.bad_words_token_ids and \
                req.num_output_tokens >= req.params.min_tokens:
            rows.extend([req] * (len(d) + 1))
        else:
            rows.append(req)
            rows.extend(_Ahead(req, d[:j]) for j in range(1, len(d) + 1))
    return rows


def _apply_token_rules(row: torch.Tensor, req: Any) -> None:
    """allowed_token_ids, bad_words and logit_bias on one row of logits, in place."""
    p = req.params
    if p.allowed_token_ids is not None:
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[torch.tensor(p.allowed_token_ids, device=row.device)] = True
        row.masked_fill_(~keep, float("-inf"))
    if req.bad_words_token_ids:
        history = req.all_token_ids
        banned = [seq[-1] for seq in req.bad_words_token_ids
                  if len(seq) == 1 or (len(history) >= len(seq) - 1 and history[-(len(seq) - 1):] == seq[:-1])]
        if banned:
            row[banned] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=row.device)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)


def _apply_processors(logits: torch.Tensor, rows: list[Any], drafts: Sequence[Sequence[int]] | None) -> None:
    """Mask `logits` in place with the logits processors' bitmasks, one row per sampled
    position. In a verify step a request's rows are its next token and each of its
    drafts: its processors accept the drafts tentatively to fill the later rows, then
    roll them back (the accepted tokens are accepted for real after sampling); rows past
    a draft a processor refuses stay unmasked (that draft is masked out, so they are never
    used). A row that allows nothing keeps the end-of-sequence tokens, so the request ends
    instead of sampling from nothing."""
    vocab = logits.shape[1]
    groups = [(r, ()) for r in rows] if drafts is None else _first_rows(rows, drafts)
    width = max(len(r.logits_processors) for r, _ in groups)
    masks = [torch.full((logits.shape[0], bitmask_words(vocab)), -1, dtype=torch.int32) for _ in range(width)]
    touched: list[int] = []
    base = 0
    for req, d in groups:
        for mask, proc in zip(masks, req.logits_processors):
            accepted = 0
            for j in range(len(d) + 1):
                proc.fill_bitmask(mask, base + j)
                if j == len(d) or not proc.accept([d[j]]):
                    break
                accepted += 1
            if accepted:
                proc.rollback(accepted)
        if req.logits_processors:
            touched.extend(range(base, base + len(d) + 1))
        base += len(d) + 1
    bitmask = masks[0]
    for mask in masks[1:]:
        bitmask &= mask
    index = torch.tensor(touched)
    rows_mask = bitmask[index]
    for i in bitmask_empty(rows_mask, vocab).nonzero().flatten().tolist():
        eos = [t for t in rows[touched[i]].eos_token_ids if t < vocab]
        rows_mask[i] = pack_bitmask(torch.isin(torch.arange(vocab), torch.tensor(eos, dtype=torch.long)))
    bias = bitmask_bias(rows_mask, vocab).to(logits.device, logits.dtype)
    if len(touched) == logits.shape[0]:
        logits += bias
    else:
        index = index.to(logits.device)
        logits[index] += bias


def _first_rows(rows: list[Any], drafts: Sequence[Sequence[int]]) -> list[tuple[Any, Sequence[int]]]:
    """(request, its drafts) per verified request, from the flat rows of a verify step."""
    out, at = [], 0
    for d in drafts:
        out.append((rows[at], d))
        at += len(d) + 1
    return out
