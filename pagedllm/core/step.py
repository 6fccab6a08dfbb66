"""The step message: what every rank needs to run one step, and nothing live.

The scheduler's `SchedulerOutput` holds `Request` objects, which exist only in the
driver's process. Each step the driver encodes it into a `StepMessage` that can be
pickled and broadcast: a request a rank has not seen (new, or back after preemption)
carries its token ids and block ids once; a running one carries only the tokens and
blocks added since the rank last saw it; finished and preempted ids travel so ranks
forget them. Each rank keeps its copy of every live request's tokens and block table
in a `RankRequests`, and rebuilds the batch from the message and that copy. One rank
(`uni`) goes through the same encoding, so the path multi-rank runs take is the one
every test takes.

The message also names the rows whose logits the step needs (`logit_rows`): computing
logits is a collective under tensor parallelism (the vocabulary is split), so every
rank must ask for the same rows in the same order; only the driver samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from pagedllm.core.scheduler import SchedulerOutput


@dataclass(frozen=True)
class ScheduledTokens:
    """One scheduled request, as a rank needs it."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int  # includes len(spec_token_ids)
    spec_token_ids: tuple[int, ...]
    # tokens and blocks the rank has not seen: all of them when `new`, else the suffix
    # added since the request's last step on the ranks
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    new: bool


@dataclass(frozen=True)
class StepMessage:
    scheduled: tuple[ScheduledTokens, ...]
    # requests whose state ranks drop before this step (finished, aborted, preempted)
    forgotten_ids: tuple[str, ...] = ()
    # hidden-state row indices whose logits the step needs, one tuple per logits call,
    # in the order every rank makes them
    logit_rows: tuple[tuple[int, ...], ...] = ()


@dataclass
class _Sent:
    num_tokens: int
    num_blocks: int


class StepEncoder:
    """The driver's side: remembers what the ranks hold of each request."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}
        self._forgotten: list[str] = []

    def forget(self, request_id: str) -> None:
        """The request is gone (finished or aborted): ranks drop it with the next step."""
        if self._sent.pop(request_id, None) is not None:
            self._forgotten.append(request_id)

    def encode(self, out: SchedulerOutput, logit_rows: Iterable[Iterable[int]] = ()) -> StepMessage:
        for request_id in out.preempted_ids:  # recomputed later: sent again in full then
            self.forget(request_id)
        scheduled = []
        for e in out.scheduled:
            req = e.request
            rid = req.request_id
            sent = self._sent.get(rid)
            tokens = req.all_token_ids
            new = sent is None or sent.num_tokens > len(tokens) or sent.num_blocks > len(e.block_ids)
            if new:
                if sent is not None:  # the rank's copy cannot be extended: replace it
                    self._forgotten.append(rid)
                sent = self._sent[rid] = _Sent(0, 0)
            # a rank needs the tokens up to the step's end (the drafts travel apart)
            upto = e.num_computed_tokens + e.num_new_tokens - len(e.spec_token_ids)
            scheduled.append(ScheduledTokens(
                rid, e.num_computed_tokens, e.num_new_tokens, tuple(e.spec_token_ids),
                tuple(tokens[sent.num_tokens:upto]), tuple(e.block_ids[sent.num_blocks:]), new))
            sent.num_tokens = max(sent.num_tokens, upto)
            sent.num_blocks = len(e.block_ids)
        forgotten, self._forgotten = tuple(self._forgotten), []
        return StepMessage(tuple(scheduled), forgotten, tuple(tuple(r) for r in logit_rows))


@dataclass
class _Held:
    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)


class RankRequests:
    """A rank's side: every live request's tokens and block table, kept from the messages."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def apply(self, msg: StepMessage) -> tuple[list[list[int]], list[list[int]]]:
        """Bring the copies up to date; the step's tokens and block tables, in batch order."""
        for request_id in msg.forgotten_ids:
            self._held.pop(request_id, None)
        tokens, tables = [], []
        for s in msg.scheduled:
            held = self._held.get(s.request_id)
            if s.new or held is None:
                if not s.new:
                    raise RuntimeError(f"step message continues request {s.request_id!r}, which this rank "
                                       "does not hold (the driver and the ranks disagree)")
                held = self._held[s.request_id] = _Held()
            held.token_ids.extend(s.token_ids)
            held.block_ids.extend(s.block_ids)
            start = s.num_computed_tokens
            end = start + s.num_new_tokens - len(s.spec_token_ids)
            if end > len(held.token_ids):
                raise RuntimeError(f"request {s.request_id!r}: the step reaches token {end}, the rank holds "
                                   f"{len(held.token_ids)}")
            tokens.append(held.token_ids[start:end] + list(s.spec_token_ids))
            tables.append(held.block_ids)
        return tokens, tables
