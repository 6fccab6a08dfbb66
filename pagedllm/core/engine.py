"""LLMEngine (add_request / step / abort) and the AsyncLLMEngine the server uses.

`step()` reads as the story of one iteration: schedule -> run the model -> update
requests -> detokenize and check stop strings -> emit outputs. A request with n > 1
becomes n sequences sharing one prompt (the prefix cache shares its blocks); their
outputs are gathered back into one RequestOutput.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import torch

from pagedllm.core import envs, heap
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.config import EngineConfig, default_model
from pagedllm.core.contracts import LogitsProcessorContext, LogitsProcessorFactory
from pagedllm.core.detokenizer import IncrementalDetokenizer
from pagedllm.core.loader import derived_max_model_len, open_configured_model
from pagedllm.core.plugins import get_registry
from pagedllm.core.request import (
    CompletionOutput,
    Logprob,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.core.spec_decode import PayoffGuard, position_verdicts, resolve_spec_config
from pagedllm.core.executor import EngineDeadError, make_executor
from pagedllm.core.worker import Worker, check_split

logger = logging.getLogger("pagedllm")

# What a server prefills at start-up (`LLMEngine.warm_up`): a wave of 32 x 32-token prompts.
WARM_UP_TOKENS = 1024


@dataclass
class EngineStats:
    """Counters the server's /metrics and the tests read."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    max_seqs_in_step: int = 0
    seqs_per_step: list[int] = field(default_factory=list)  # last 1000 steps


@dataclass
class _Parent:
    """A user request: its n sequences and how to report them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: dict[str, IncrementalDetokenizer]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        envs.warn_deprecated()
        with heap.built_once():
            self._build(config)

    def _build(self, config: EngineConfig) -> None:
        self.config = config
        registry = get_registry()
        path = config.model.model or default_model()
        self.model_path = path
        registry.start_preparing_ops(torch.device(config.device.resolved_device()))
        source = open_configured_model(config, registry)
        self.tokenizer = source.tokenizer
        self.hf_config = source.hf_config
        # token facts (length, vocabulary, eos) are the language model's: a composite
        # (vision-language) config keeps them under its text part
        text_config = source.text_config
        self.max_model_len, budget, self.spec_config = engine_limits(config, source, registry)
        self.payoff = PayoffGuard(self.spec_config.num_speculative_tokens if self.spec_config else 0)
        self._propose_s = 0.0
        # ranks in other processes open the same model (the default one by its path)
        rank_config = dataclasses.replace(config, model=dataclasses.replace(config.model, model=source.path))
        if config.parallel.world_size > 1:  # what every rank would refuse, refused before any starts
            check_split(config, source, registry)
        self.executor = make_executor(rank_config, lambda state: Worker(
            config, source, registry, self.max_model_len, budget, self.spec_config, state))
        self.worker = self.executor.driver
        self.block_manager = BlockManager(self.worker.budget.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching, self.worker.kv_window)
        proposer = self.worker.proposer
        self.scheduler = Scheduler(self.block_manager, config.scheduler.max_num_seqs, budget,
                                   self.max_model_len, config.scheduler.enable_chunked_prefill,
                                   num_lookahead_slots=proposer.num_lookahead_slots if proposer else 0)
        self.vocab_size = text_config.vocab_size
        self.eos_token_ids = _eos_token_ids(self.tokenizer, self.hf_config, text_config, source.path,
                                            self.vocab_size)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.logits_factories = self._logits_factories(registry, config)
        self._pending: list[Request] = []  # requests whose processors are not ready yet
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, str] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, longer than max_model_len="
                             f"{self.max_model_len}; shorten it or raise --max-model-len")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def validate_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the ranges this model sets (token ids)."""
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            bad = [t for t in getattr(params, name) or () if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.{name} has token ids {bad[:5]} outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        for factory in self.logits_factories:
            factory.validate(params)

    def _logits_factories(self, registry: Any, config: EngineConfig) -> list[LogitsProcessorFactory]:
        """One factory per registered logits-processor plugin, built once."""
        options = {**config.plugin_options, **config.structured.options}
        reasoning_end = options.pop("reasoning_end", None)
        context = LogitsProcessorContext(self.tokenizer, self.vocab_size, self.eos_token_ids, options,
                                         reasoning_end)
        return [cls(context) for _, cls in sorted(registry.logits_processors.items())]

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """The token sequences each bad word may be generated as: alone and after a space
        (vLLM's rule), without special tokens."""
        sequences: list[list[int]] = []
        for word in words:
            for text in (word, " " + word.lstrip(" ")):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def add_request(self, request_id: str | None, prompt: str | None, params: SamplingParams,
                    prompt_token_ids: list[int] | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError on bad input (nothing queued)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = list(prompt_token_ids)
        self.validate_prompt(prompt_token_ids)
        self.validate_params(params)
        bad_words = self._bad_words_token_ids(params.bad_words) if params.bad_words else []
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else params.seed + i)
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            child = Request(child_id, prompt_token_ids, child_params, self.eos_token_ids, prompt)
            child.bad_words_token_ids = bad_words
            child.logits_processors = [proc for f in self.logits_factories
                                       if (proc := f.create(child_params, prompt_token_ids)) is not None]
            if child.logits_processors and not child.processors_ready:
                self._pending.append(child)
            children.append(child)
        parent = _Parent(request_id, prompt, prompt_token_ids, children, {
            c.request_id: IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                 params.stop, params.include_stop_str_in_output)
            for c in children})
        self.parents[request_id] = parent
        for child in children:
            self.child_to_parent[child.request_id] = request_id
            self.scheduler.add_request(child)
        self.stats.num_prompt_tokens += len(prompt_token_ids) * params.n
        return request_id

    def warm_up(self, num_tokens: int = WARM_UP_TOKENS, prompt_len: int = 64) -> int:
        """Prefill dummy prompts of `num_tokens` together (at most the step's token budget) and
        forget them; returns the tokens prefilled.

        Why: a process's first large step pays one-time costs that its later steps do not. On the
        CPU its activations are fresh memory: a server's first 1,024-token prefill took 8,000-
        83,000 page faults (2-vCPU Xeon VM) and 215-536 ms against 205-231 offline, and that step
        is the first wave's time to first token. vLLM runs a dummy batch at start-up for the same
        reason. The prompts' blocks go back to the cache, and the counters start from zero."""
        limits = self.scheduler
        seqs = max(1, min(limits.max_num_seqs, num_tokens // prompt_len))
        prompt_len = max(1, min(prompt_len, self.max_model_len - 1, limits.max_num_batched_tokens // seqs))
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        ids = [self.add_request(None, None, params, [(7 * (r * prompt_len + i) + 1) % self.vocab_size
                                                     for i in range(prompt_len)]) for r in range(seqs)]
        while any(request_id in self.parents for request_id in ids):
            self.step()
        self.stats = EngineStats()
        return seqs * prompt_len

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output (or None if unknown)."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            self.scheduler.abort(child.request_id)
        return self._finish_parent(parent)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def check_health(self) -> None:
        """Raise EngineDeadError when a rank of this engine is gone."""
        self.executor.check_health()

    def idle_work(self) -> bool:
        """Work an idle engine may do between requests, a few milliseconds at a time: fault in
        the next IDLE_FAULT_IN_BYTES of this process's CPU KV cache (worker.IdleFaultIn;
        other ranks' caches fault as they are written). True while some remains."""
        fault_in = getattr(self.worker, "idle_fault_in", None)
        return fault_in is not None and fault_in.step(IDLE_FAULT_IN_BYTES)

    def shutdown(self) -> None:
        """Stop the ranks (a one-rank engine has none); the engine is unusable after."""
        self.executor.shutdown()
        heap.release()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        failed = self._check_pending()
        out = self.scheduler.schedule()
        if out.is_empty:
            if self._pending:
                time.sleep(0.001)  # only compiling requests: wait for them without spinning a core
            return [self._finish_parent(p) for p in failed if p.request_id in self.parents]
        result = self.executor.execute(out)
        for request_id, entries in result.prompt_logprobs.items():
            req = self.scheduler.requests.get(request_id)
            if req is not None and req.prompt_logprobs is not None:
                req.prompt_logprobs.extend(self._logprob_record(t, e) for t, e in entries)
        touched = self.scheduler.update_from_output(out, result.sampled)
        changed: dict[str, _Parent] = {p.request_id: p for p in failed}
        generated = 0
        for req, new_tokens in touched:
            parent = self.parents[self.child_to_parent[req.request_id]]
            self._append_logprobs(req, new_tokens, result.logprobs.get(req.request_id))
            detokenizer = parent.detokenizers[req.request_id]
            matched = detokenizer.add_tokens(new_tokens)
            if matched is not None:
                req.truncate_output(len(new_tokens) - detokenizer.num_used)
                req.stop_reason = matched
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            generated += detokenizer.num_used if matched is not None else len(new_tokens)
            changed[parent.request_id] = parent
        self._record(len(out.scheduled), generated)
        if self.worker.proposer is not None:
            self._propose(touched)
        outputs = []
        for parent in changed.values():
            if all(c.is_finished for c in parent.children):
                outputs.append(self._finish_parent(parent))
            else:
                outputs.append(self._output(parent))
        if self.worker.proposer is not None:
            self._measure(out, touched, time.perf_counter() - start)
        return outputs

    def _check_pending(self) -> list[_Parent]:
        """Drop requests whose processors became ready from the pending list; end those
        whose processors failed (their error is reported). Returns the parents ended."""
        if not self._pending:
            return []
        failed: dict[str, _Parent] = {}
        still = []
        for req in self._pending:
            if req.is_finished:
                continue
            why = next((w for p in req.logits_processors if (w := p.failure()) is not None), None)
            if why is not None:  # the request and its siblings (n > 1) end with the error
                req.error = why
                parent = self.parents[self.child_to_parent[req.request_id]]
                for child in parent.children:
                    self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
                failed[parent.request_id] = parent
            elif not req.processors_ready:
                still.append(req)
        self._pending = still
        return list(failed.values())

    def _measure(self, out: SchedulerOutput, touched: list[tuple[Request, list[int]]], seconds: float) -> None:
        """What the payoff guard learns from a step: its time per row (decode and verify
        steps only, the proposal's own time taken out) and the first drafts' acceptance."""
        guard = self.payoff
        decoding = [e for e in out.scheduled if e.samples and e.num_new_tokens == 1 + len(e.spec_token_ids)]
        # even steps only: an uneven one (an acceptance probe) is a shape step replay has not
        # recorded, which would bias the time of its row count
        if len(decoding) == len(out.scheduled) and len({len(e.spec_token_ids) for e in decoding}) == 1:
            guard.record_step(out.num_scheduled_tokens, seconds - self._propose_s)
        drafted = [e for e in out.scheduled if e.spec_token_ids]
        if drafted:
            # per decoding request: one without a draft (a probe verifies real proposals only)
            # counts as a rejected one, as its filler would have been
            got = {req.request_id: len(t) for req, t in touched}
            first, deeper = position_verdicts([(len(e.spec_token_ids), got.get(e.request.request_id, 1) - 1)
                                               for e in drafted])
            guard.record_acceptance(max(len(decoding), len(drafted)), first, deeper)

    def _propose(self, touched: list[tuple[Request, list[int]]]) -> None:
        """Ask the proposer for the drafts the next step verifies (running requests only),
        as many per request as the payoff guard expects to pay at this batch size."""
        live = [(req, tokens) for req, tokens in touched if not req.is_finished]
        spec = self.spec_config
        k = spec.num_speculative_tokens
        probe = False
        if spec.disable_by_batch_size is not None and len(live) >= spec.disable_by_batch_size:
            k = 0
        elif spec.adaptive and live:
            if any(req.num_output_tokens == len(tokens) for req, tokens in live):  # its first tokens
                self.payoff.request_started(len(live))
            k = self.payoff.drafts(len(live))
            probe = self.payoff.probing
        start = time.perf_counter()
        proposals = self.worker.propose(live, [self.block_manager.block_ids(r.request_id) for r, _ in live], k,
                                        even=not probe)
        self._propose_s = time.perf_counter() - start
        if k:
            self.payoff.record_proposal(k * len(live), self._propose_s)
        for request_id, drafts in proposals.items():
            self.scheduler.requests[request_id].spec_token_ids = drafts

    def _record(self, num_seqs: int, num_tokens: int) -> None:
        s = self.stats
        s.num_steps += 1
        s.num_generation_tokens += num_tokens
        s.max_seqs_in_step = max(s.max_seqs_in_step, num_seqs)
        s.seqs_per_step.append(num_seqs)
        del s.seqs_per_step[:-1000]

    def _append_logprobs(self, req: Request, tokens: list[int], logprobs: list[Any] | None) -> None:
        if req.logprobs is None or not logprobs:
            return
        for token, entry in zip(tokens, logprobs):
            req.cumulative_logprob += entry[0]
            req.logprobs.append(self._logprob_record(token, entry))

    def _logprob_record(self, token: int, entry: Any) -> dict[int, Logprob]:
        """One position's record: the chosen token first, then the top alternatives."""
        chosen, rank, top_ids, top_vals = entry
        record = {token: Logprob(chosen, rank, self._token_text(token))}
        for r, (tid, val) in enumerate(zip(top_ids, top_vals), 1):
            record.setdefault(tid, Logprob(val, r, self._token_text(tid)))
        return record

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _output(self, parent: _Parent) -> RequestOutput:
        completions = []
        for i, child in enumerate(parent.children):
            finished = child.is_finished
            completions.append(CompletionOutput(
                index=i, text=parent.detokenizers[child.request_id].output_text(finished),
                token_ids=list(child.output_token_ids),
                cumulative_logprob=child.cumulative_logprob if child.logprobs is not None else None,
                logprobs=child.logprobs, finish_reason=child.status.value if finished else None,
                stop_reason=child.stop_reason))
        first = parent.children[0]
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions,
                             finished=all(c.is_finished for c in parent.children),
                             num_cached_tokens=first.num_cached_tokens, metrics=first.metrics,
                             prompt_logprobs=first.prompt_logprobs,
                             error=next((c.error for c in parent.children if c.error), None))

    def _finish_parent(self, parent: _Parent) -> RequestOutput:
        output = self._output(parent)
        self.parents.pop(parent.request_id, None)
        for child in parent.children:
            self.child_to_parent.pop(child.request_id, None)
            self.worker.forget(child.request_id)
        return output


def engine_limits(config: EngineConfig, source: Any, registry: Any) -> tuple[int, int, Any]:
    """(max_model_len, the step's token budget, the resolved speculative config): what the
    engine and every rank derive from the config and the model alike."""
    # the config's length, stretched by its rope scaling (as vLLM derives it)
    model_max, derived = derived_max_model_len(source.text_config)
    max_model_len = config.model.max_model_len or model_max
    if max_model_len > model_max:
        if envs.get("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN", "").strip().lower() in ("1", "true", "yes"):
            logger.warning("max_model_len=%d is longer than the model's %s (%s is set): positions past it were "
                           "never trained and may give wrong outputs", max_model_len, derived,
                           envs.source("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN"))
        else:
            raise ValueError(f"max_model_len={max_model_len} is longer than the model's {derived}; lower "
                             "--max-model-len, extend the context with a rope scaling (--hf-overrides "
                             "'{\"rope_scaling\": {...}}'), or set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it anyway")
    return (max_model_len, config.max_num_batched_tokens(max_model_len),
            resolve_spec_config(config.spec.speculative_config, registry))


def _eos_token_ids(tokenizer: Any, hf_config: Any, text_config: Any, path: str,
                   vocab_size: int) -> tuple[int, ...]:
    """Every id that ends a sequence, first the tokenizer's: the configs' `eos_token_id`
    (an int or a list, as Llama 3's <|eot_id|> and <|eom_id|>) and generation_config.json's.
    An id outside the model's vocabulary (a config left from another model) is dropped with
    a warning: no logit can sample it, and banning it (min_tokens) would index past the
    logits (on CUDA, a device-side assert that kills the engine)."""
    found: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in found:
                found.append(v)

    add(getattr(tokenizer, "eos_token_id", None))
    add(getattr(hf_config, "eos_token_id", None))
    add(getattr(text_config, "eos_token_id", None))
    generation = os.path.join(path, "generation_config.json") if os.path.isdir(path) else None
    if generation and os.path.exists(generation):
        try:
            with open(generation) as f:
                add(json.load(f).get("eos_token_id"))
        except (OSError, ValueError, AttributeError):
            logger.warning("could not read %s; ignoring its eos_token_id", generation)
    outside = [t for t in found if not 0 <= t < vocab_size]
    if outside:
        logger.warning("eos_token_id %s outside the model's vocabulary of %d tokens: ignored",
                       ", ".join(map(str, outside)), vocab_size)
    return tuple(t for t in found if t not in outside)


class _Latest:
    """One stream's mailbox: the newest output of its request, or the error ending it.

    Outputs are cumulative, so a consumer that falls behind loses nothing by skipping
    to the newest one: each delivery replaces the one not taken yet, and a stream
    nobody reads holds one output however long its request runs (a queue of every
    step's output grew with tokens squared). A final item (an error, or the finished
    output) is never replaced. Used on its event loop's thread only.
    """

    __slots__ = ("item", "ready")

    def __init__(self) -> None:
        self.item: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        current = self.item
        if isinstance(current, BaseException) or (current is not None and current.finished):
            return
        self.item = item
        self.ready.set()

    async def take(self) -> RequestOutput | BaseException:
        await self.ready.wait()
        self.ready.clear()
        item, self.item = self.item, None
        assert item is not None
        return item


def _put_all(puts: list[tuple[_Latest, Any]]) -> None:
    for box, item in puts:
        box.put(item)


SETTLE_LIMIT_S = 0.02  # the longest an idle engine waits for a burst to finish arriving
SETTLE_QUIET_ROUNDS = 3  # ... and how many rounds of event-loop turns must bring no request
# KV cache bytes an idle engine faults in per turn: ~2 huge pages, ~10 ms where a fresh one
# costs ~5 ms, the longest a request arriving meanwhile waits for it ...
IDLE_FAULT_IN_BYTES = 4 << 20
IDLE_PAUSE_S = 0.02  # ... the pause between two turns (a third of a core at most: clients, other processes) ...
# ... and how long the engine must have been idle before the first: a pause between two bursts, or
# between a client's first request and its burst, is no time for it (at 0.2 s, `bench compare`'s
# serve burst, sent right after its probe request, met an engine faulting pages on one of two cores)
IDLE_WORK_AFTER_S = 2.0


class AsyncLLMEngine:
    """Runs `LLMEngine.step()` in one background thread; coroutines stream outputs.

    The event loop never waits on the model: adds and aborts go through a queue the
    engine thread drains between steps. Bad input fails only its own request (its
    stream raises the ValueError). An error inside a step fails every request in flight
    at that moment (their streams raise a RuntimeError naming it, their blocks are
    freed), and the loop goes on serving the requests that arrive after. A stream
    buffers at most one output (`_Latest`): a slow consumer gets the newest one.
    """

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        """`engine` is a built engine or, better, a function that builds one: the engine
        thread then builds it itself, so that loading, warm-up and every step run their
        OpenMP regions on one thread. libgomp keeps one thread pool per thread that opens
        regions; a second pool (the loading thread's, idle) makes it count more OpenMP
        threads than CPUs and cut its spin-waiting short, so each of a step's ~200
        kernels ended with the threads going to sleep and being woken (serving ran a
        third idle). Before it serves, the engine thread runs `LLMEngine.warm_up`, on the
        same thread for the same reason. Construction and warm-up errors are raised here."""
        self.engine: LLMEngine = engine if isinstance(engine, LLMEngine) else None  # type: ignore[assignment]
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Latest]] = {}
        self._refusal: Callable[[], BaseException] | None = None
        self._dead: EngineDeadError | None = None
        self._wake = threading.Event()
        self._stopped = False
        self._ids = itertools.count()
        built = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(engine, built, failure),
                                        name="pagedllm-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            self._thread.join()
            raise failure[0]

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLMEngine":
        return cls(lambda: LLMEngine(config))

    async def generate(self, prompt: str | None, params: SamplingParams, request_id: str | None = None,
                       prompt_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs until the request finishes. Leaving the
        iterator early (client gone) aborts the request and frees its blocks.

        A consumer slower than the engine gets the newest output each time it asks
        (the ones in between are skipped, never queued); the last one it gets is
        always the finished output. After `abort_all`, raises its error.

        Bad input (a prompt the engine refuses) raises its ValueError from the iterator;
        it is checked on the engine thread, not here. A text prompt is tokenized here, on
        the caller's thread: callers on an event loop pass `prompt_token_ids` (the server
        always does), so the loop never does per-request CPU work."""
        if self._refusal is not None:
            raise self._refusal()
        request_id = request_id or f"req-{next(self._ids)}-{time.monotonic_ns()}"
        if prompt_token_ids is None:
            prompt_token_ids = self.engine.tokenizer.encode(prompt)
        loop = asyncio.get_running_loop()
        box = _Latest()
        self._streams[request_id] = (loop, box)
        self._commands.put(("add", (request_id, prompt, params, prompt_token_ids)))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await box.take()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    break
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    @property
    def is_alive(self) -> bool:
        """False once the engine thread has stopped (shut down or crashed)."""
        return self._thread.is_alive()

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def abort_all(self, error: Callable[[], BaseException]) -> int:
        """End every open stream by raising `error()` in it, and abort its request (its
        blocks are freed); every later `generate` raises `error()` too. For a server
        shutting down; call it on the event loop the streams run on. Returns how many
        streams it ended."""
        self._refusal = error
        streams = list(self._streams.items())
        for request_id, (loop, box) in streams:
            loop.call_soon_threadsafe(box.put, error())
            self.abort(request_id)
        return len(streams)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        for factory in self.engine.logits_factories:
            factory.close()
        self.engine.shutdown()

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine stopped on its own (a rank failed), or None."""
        return self._dead

    def _deliver(self, request_id: str, item: Any) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, Any]]) -> None:
        """Hand each item to its stream: one wake-up per event loop for the whole list
        (a step's outputs), not one per request, since each wake-up is a write to the
        loop's self-pipe and a turn of the loop, taken on the cores the model runs on."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Latest, Any]]] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def _apply_commands(self) -> int:
        """Apply the queued adds and aborts; returns how many requests were added."""
        added = 0
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return added
            if kind == "add":
                added += 1
                try:
                    self.engine.add_request(*arg)
                except Exception as exc:  # bad input reaches only its own stream
                    self._deliver(arg[0], exc)
            else:
                self.engine.abort(arg)

    def _loops_turned(self, deadline: float) -> bool:
        """Wait until each event loop streaming to this engine has turned twice (False if
        `deadline`, a time.monotonic(), came first), so that the requests it was already
        handling (a client's burst: parsed, tokenized, handed over one after another) are
        handed over too. The engine repeats this before a pause's first step until a
        round brings no new request (or SETTLE_LIMIT_S has passed).

        Why: an idle engine woken by a burst's first request used to start a prefill step
        with the part of the burst that had arrived, taking both cores from the loop still
        handing over the rest; those requests then waited for that whole step (~500 ms for
        23 of 32 SmolLM2 prompts on two cores) before their own, and the wave's p99 TTFT
        rose by as much. Two turns: the first runs what the loop had queued, the second
        what its next poll of the sockets found. A lone request waits two turns, well
        under a millisecond."""
        for loop in {loop for loop, _ in list(self._streams.values())}:
            turned = threading.Event()
            try:
                loop.call_soon_threadsafe(loop.call_soon, turned.set)
            except RuntimeError:  # a loop closed meanwhile: nothing arrives from it
                continue
            if not turned.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def _run(self, engine: LLMEngine | Callable[[], LLMEngine], built: threading.Event,
             failure: list[BaseException]) -> None:
        try:
            if not isinstance(engine, LLMEngine):
                self.engine = engine()
            start = time.perf_counter()
            tokens = self.engine.warm_up()
            logger.info("warm-up: %d prompt tokens prefilled in %.2f s (the first wave's step pays no first-use "
                        "costs)", tokens, time.perf_counter() - start)
        except BaseException as exc:  # handed to the constructor, which raises it
            failure.append(exc)
            return
        finally:
            built.set()
        try:
            self._loop()
        except EngineDeadError as exc:  # a rank is gone: nothing can run any more
            logger.error("engine stopped: %s", exc)
            self._dead = dead = exc
            self._refusal = lambda: EngineDeadError(f"engine stopped: {dead}")
            self._deliver_all([(request_id, EngineDeadError(f"engine stopped: {dead}"))
                               for request_id in list(self._streams)])

    def _loop(self) -> None:
        idle, idle_since = True, time.monotonic()
        while not self._stopped:
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                self.engine.check_health()
                if not idle:
                    idle, idle_since = True, time.monotonic()
                quiet = time.monotonic() - idle_since
                if quiet < IDLE_WORK_AFTER_S:  # a pause between two bursts is no time for it
                    timeout = IDLE_WORK_AFTER_S - quiet
                else:
                    timeout = IDLE_PAUSE_S if self.engine.idle_work() else 0.5
                self._wake.wait(timeout=timeout)
                self._wake.clear()
                continue
            if idle:  # the first step after a pause: let a burst of requests finish arriving
                idle = False
                deadline, quiet = time.monotonic() + SETTLE_LIMIT_S, 0
                while quiet < SETTLE_QUIET_ROUNDS and self._loops_turned(deadline):
                    quiet = 0 if self._apply_commands() else quiet + 1
            try:
                outputs = self.engine.step()
            except EngineDeadError:
                raise
            except Exception as exc:
                logger.exception("engine step failed; failing the requests in flight")
                for request_id in list(self.engine.parents):
                    self.engine.abort(request_id)
                    self._deliver(request_id, RuntimeError(f"engine error: {exc}"))
                continue
            self._deliver_all([(out.request_id, ValueError(out.error) if out.error else out) for out in outputs])
