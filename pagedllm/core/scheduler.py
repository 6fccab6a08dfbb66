"""Continuous batching with one currency: new tokens per request per step.

Each step spends a token budget: running requests first (one decode token, 1 + k
with speculative tokens, or the rest of a prefill chunk), then waiting requests as
prefill chunks of any length. When the block pool runs dry the newest running
request is preempted (its blocks freed, recomputed later). Invariant: every running
request owns blocks for all of its computed and scheduled tokens.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.spec_decode import SpecStats

logger = logging.getLogger("pagedllm")


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # includes len(spec_token_ids) when speculating
    num_computed_tokens: int  # tokens already in the cache before this step
    block_ids: tuple[int, ...]
    samples: bool  # this step reaches the end of the request's tokens, so a token is sampled
    # the drafts this step verifies: the request's proposal, cut where the token budget cut it
    spec_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    """The only thing that crosses from the scheduler into the worker."""

    scheduled: tuple[ScheduledRequest, ...]
    preempted_ids: tuple[str, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True, num_lookahead_slots: int = 0) -> None:
        self.block_manager = block_manager
        # KV slots reserved past a sampling request's scheduled tokens (a draft model's writes)
        self.num_lookahead_slots = num_lookahead_slots
        self.spec_stats = SpecStats()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        kept: list[Request] = []
        queue = list(self.running)
        while queue and budget > 0:
            req = queue.pop(0)
            num_new = min(req.num_tokens_with_spec - req.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(req, self._slots(req, num_new)):
                victim = queue.pop() if queue else req
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                kept.append(req)
                scheduled.append(self._entry(req, num_new))
                budget -= num_new
        kept.extend(queue)  # running requests the budget did not reach stay running
        self.running = kept

        compiling: list[Request] = []  # waiting requests whose logits processors are not ready
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            if req.logits_processors and not req.processors_ready:
                compiling.append(self.waiting.popleft())  # the requests behind it go first
                continue
            computed, num_cached = self.block_manager.get_computed_blocks(req)
            num_new = req.num_tokens - num_cached
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not self.block_manager.allocate_slots(req, self._slots(req, num_new, num_cached), computed):
                break
            self.waiting.popleft()
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
                req.num_cached_tokens = num_cached
                self.block_manager.record_query(req.num_prompt_tokens)
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(self._entry(req, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))
        return SchedulerOutput(tuple(scheduled), tuple(preempted))

    def _slots(self, req: Request, num_new: int, computed: int | None = None) -> int:
        """New tokens plus the lookahead slots of a step that samples, within max_model_len."""
        computed = req.num_computed_tokens if computed is None else computed
        if not self.num_lookahead_slots or computed + num_new < req.num_tokens:
            return num_new
        return max(num_new, min(num_new + self.num_lookahead_slots, self.max_model_len - computed))

    def _entry(self, req: Request, num_new: int) -> ScheduledRequest:
        end = req.num_computed_tokens + num_new
        drafts = tuple(req.spec_token_ids[:end - req.num_tokens]) if end > req.num_tokens else ()
        return ScheduledRequest(req, num_new, req.num_computed_tokens,
                                tuple(self.block_manager.block_ids(req.request_id)),
                                samples=end >= req.num_tokens, spec_token_ids=drafts)

    def _preempt(self, req: Request) -> None:
        """Free the request's blocks and send it back to the head of the queue (recompute)."""
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(self, out: SchedulerOutput,
                           sampled: dict[str, list[int]]) -> list[tuple[Request, list[int]]]:
        """Advance computed tokens, append sampled tokens (the accepted drafts and the
        target's own token), and finish requests that hit a token-level stop (EOS,
        stop_token_ids, max_tokens, max_model_len): tokens after a stop inside an accepted
        run are dropped. Returns each request that received tokens with the ones appended."""
        touched = []
        for entry in out.scheduled:
            req = entry.request
            tokens = sampled.get(req.request_id, [])
            # drafts past the first rejected one were computed in vain
            num_rejected = len(entry.spec_token_ids) - (len(tokens) - 1) if tokens else 0
            if entry.spec_token_ids and tokens:
                self.spec_stats.record(len(entry.spec_token_ids), len(tokens) - 1)
            req.num_computed_tokens = entry.num_computed_tokens + entry.num_new_tokens - num_rejected
            req.spec_token_ids = []
            reason = None
            appended = 0
            for token in tokens:
                req.append_token(token)
                appended += 1
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = time.monotonic()
                reason = self._token_stop(req, token)
                if reason:
                    break
            if req.logits_processors and appended:
                processors_stop = self._advance_processors(req, tokens[:appended])
                reason = reason or processors_stop
            self.block_manager.cache_full_blocks(req)
            if reason:
                self.finish(req, reason)
            if tokens:
                touched.append((req, tokens[:appended]))
        return touched

    @staticmethod
    def _advance_processors(req: Request, tokens: list[int]) -> RequestStatus | None:
        """Tell the request's logits processors what was appended; a stop when one is
        complete (a finished grammar) or refused a token (which its mask had allowed
        away only when it left nothing else: the request cannot go on)."""
        stop = None
        for proc in req.logits_processors:
            if not proc.accept(tokens):
                logger.warning("request %s: logits processor %s refused token(s) %s; stopping it",
                               req.request_id, type(proc).__name__, tokens)
                stop = RequestStatus.FINISHED_STOPPED
            elif proc.is_terminated():
                stop = RequestStatus.FINISHED_STOPPED
        return stop

    def _token_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark finished, drop from the queues and free its blocks (idempotent)."""
        if req.is_finished:
            return
        req.status = status
        req.metrics.finished_time = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req)
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req
