"""ngram (prompt lookup): propose what followed the last n tokens where they occurred before.

For every request at once, the tokens so far are laid right-aligned in one matrix, and
the length of the common suffix between each earlier position and the sequence's end is
grown one column shift at a time (`prompt_lookup_max` vectorised passes over the matrix,
no Python per token). The longest match of at least `prompt_lookup_min` tokens wins; of
its occurrences, the latest one still followed by k tokens (else the earliest: in a
periodic run the latest is followed by little). The k tokens after it are the drafts.
vLLM's defaults: both bounds 5 when neither is given, one given sets the other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedllm.core.contracts import ProposalBatch, ProposerContext, SpecDecodeConfig, SpecProposer


class NgramProposer(SpecProposer):
    name = "ngram"
    options = {"prompt_lookup_min": None, "prompt_lookup_max": None}

    @classmethod
    def validate(cls, config: SpecDecodeConfig) -> None:
        lo, hi = _bounds(config.options)
        for key, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--speculative-config: {key} must be an integer >= 1, got {value!r}")
        if lo > hi:
            raise ValueError(f"--speculative-config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        self.min_n, self.max_n = _bounds(context.config.options)
        self.tokens: dict[str, np.ndarray] = {}  # request id -> its tokens so far

    def forget(self, request_id: str) -> None:
        self.tokens.pop(request_id, None)

    def _history(self, request_id: str, token_ids: Any, num_new: int) -> np.ndarray:
        seen = self.tokens.get(request_id)
        n = len(token_ids)
        if seen is None or len(seen) != n - num_new:  # first sight, or after a preemption
            seen = np.asarray(token_ids, dtype=np.int64)
        else:
            seen = np.concatenate([seen, np.asarray(token_ids[n - num_new:], dtype=np.int64)])
        self.tokens[request_id] = seen
        return seen

    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        histories = [self._history(rid, ids, new) for rid, ids, new
                     in zip(batch.request_ids, batch.token_ids, batch.num_new_tokens)]
        return propose_ngram(histories, self.min_n, self.max_n, batch.max_drafts)


def _bounds(options: dict[str, Any]) -> tuple[Any, Any]:
    lo, hi = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
    if lo is None and hi is None:
        return 5, 5
    return (hi if lo is None else lo), (lo if hi is None else hi)


def propose_ngram(histories: list[np.ndarray], min_n: int, max_n: int, max_drafts: list[int]) -> list[list[int]]:
    """For each token history, the tokens that followed the latest earlier occurrence of
    its longest suffix of min_n..max_n tokens (see the module doc); [] where none."""
    out: list[list[int]] = [[] for _ in histories]
    rows = [i for i, (h, k) in enumerate(zip(histories, max_drafts)) if k > 0 and len(h) > min_n]
    if not rows:
        return out
    width = max(len(histories[i]) for i in rows)
    table = np.full((len(rows), width), -1, dtype=np.int64)
    lengths = np.array([len(histories[i]) for i in rows])
    for r, i in enumerate(rows):
        table[r, width - lengths[r]:] = histories[i]
    # match[r, c]: how many tokens ending at column c equal the tokens ending the row
    # (columns up to width - 2: an occurrence must end before the last token)
    alive = np.ones((len(rows), width - 1), dtype=bool)
    match = np.zeros((len(rows), width - 1), dtype=np.int64)
    for j in range(max_n):
        if j >= width - 1:
            break
        tail = table[:, width - 1 - j]
        same = np.zeros_like(alive)
        same[:, j:] = table[:, :width - 1 - j] == tail[:, None]
        alive &= same & (j < lengths)[:, None]
        if not alive.any():
            break
        match += alive
    best = match.max(axis=1)
    for r, i in enumerate(rows):
        if best[r] < min_n:
            continue
        k = max_drafts[i]
        where = np.flatnonzero(match[r] == best[r])
        full = where[where <= width - 1 - k]
        c = int(full[-1]) if len(full) else int(where[0])
        out[i] = table[r, c + 1:min(c + 1 + k, width)].tolist()
    return out
