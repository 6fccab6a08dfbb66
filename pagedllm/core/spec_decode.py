"""The core side of speculative decoding: the checked config, and the counters.

`resolve_spec_config` turns vLLM's `--speculative-config` JSON into a
`SpecDecodeConfig` (unknown keys and methods are refused with the valid ones listed);
the worker builds the method's proposer from it and asks it for drafts after every
step; the sampler verifies them (`Sampler.verify`). `SpecStats` holds the counters
vLLM's metrics name (drafts, draft tokens, accepted tokens, per position).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from pagedllm.core.contracts.spec import CORE_KEYS, SpecDecodeConfig
from pagedllm.core.plugins import PluginRegistry

# vLLM's spellings of one method
METHOD_ALIASES = {"draft": "draft_model", "[ngram]": "ngram"}


def resolve_spec_config(raw: dict[str, Any] | None, registry: PluginRegistry) -> SpecDecodeConfig | None:
    """The checked config, or None when speculation is off (no config; `{}` is refused by SpecConfig)."""
    if not raw:
        return None
    values = dict(raw)
    method = values.get("method")
    if method is None:  # vLLM: a config without a method names a draft model
        model = values.get("model")
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model" if model else None
        if method is None:
            raise ValueError("--speculative-config needs a \"method\" (one of: "
                             f"{', '.join(sorted(registry.spec_methods)) or 'none installed'}) "
                             "or a draft \"model\"")
        if method == "ngram":
            values.pop("model")
    method = METHOD_ALIASES.get(method, method)
    cls = registry.spec_method(method)
    valid = dict(CORE_KEYS) | {key: "" for key in cls.options}
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"--speculative-config: unknown key(s) {', '.join(unknown)} for method {method!r}; "
                         f"valid keys: {', '.join(sorted(valid))}")
    k = values.get("num_speculative_tokens", cls.default_num_speculative_tokens)
    if k is None:
        raise ValueError(f"--speculative-config: method {method!r} needs \"num_speculative_tokens\" "
                         "(draft tokens per step, e.g. 3 to 5)")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer >= 1, got {k!r}")
    tp = values.get("draft_tensor_parallel_size", 1)
    if tp != 1:
        raise ValueError(f"--speculative-config: draft_tensor_parallel_size={tp!r} is not supported: "
                         "pagedllm runs the draft on one rank (use 1, or leave the key out)")
    cutoff = values.get("disable_by_batch_size")
    if cutoff is not None and (not isinstance(cutoff, int) or isinstance(cutoff, bool) or cutoff < 2):
        raise ValueError(f"--speculative-config: disable_by_batch_size must be an integer >= 2, got {cutoff!r}")
    if cls.needs_model and not values.get("model"):
        raise ValueError(f"--speculative-config: the {method} method needs \"model\": the path of what it loads")
    options = {key: values.get(key, default) for key, default in cls.options.items()}
    adaptive = values.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise ValueError(f"--speculative-config: adaptive must be true or false, got {adaptive!r}")
    config = SpecDecodeConfig(method=method, num_speculative_tokens=k, model=values.get("model"),
                              quantization=values.get("quantization"), disable_by_batch_size=cutoff,
                              adaptive=adaptive, options=options)
    cls.validate(config)
    return config


def position_verdicts(drafts: Sequence[tuple[int, int]]) -> tuple[int, list[tuple[int, int]]]:
    """From each drafting request's (drafts verified, drafts accepted): how many first
    drafts were accepted, and for positions 2, 3, ... (drafts that reached the position,
    drafts accepted there): what `PayoffGuard.record_acceptance` takes."""
    longest = max((n for n, _ in drafts), default=0)
    deeper = [(sum(a >= i - 1 for n, a in drafts if n >= i), sum(a >= i for n, a in drafts if n >= i))
              for i in range(2, longest + 1)]
    return sum(a >= 1 for _, a in drafts), deeper


class PayoffGuard:
    """How many drafts a step should verify: the k in 0..k_max that maximizes expected
    tokens per second, n x E(k) / cost(n, k), from two things measured as the engine runs.

    - cost: a step's time as a function of its rows (n x (1 + k) query rows), learnt from
      every step of decodes and verifies (moving average per row bucket, interpolated
      between buckets), plus the proposer's time per drafted position. It is a
      property of the machine and model, not of the traffic, so a burst of prefills or the
      end of a batch job does not bias it the way comparing runs of steps would.
    - E(k) = 1 + c1 + c1 c2 + ... + c1 ... ck, the expected tokens a request gets from k
      drafts, where ci is the measured acceptance of draft i given draft i - 1 was accepted
      (moving averages per position; c1 over every decoding request: fillers included, and
      a request without a draft in a probe counts as a rejection). A position not reached
      in the last STALE steps takes the rate of the one before it (so a guard drafting
      little is never stuck on an old verdict about drafts it no longer makes: it falls
      back to the geometric model, drafts wider if that pays, and measures again).
      Measured per position because acceptance is far from geometric: n-gram drafts on a
      grounded workload were accepted 0.77 at the first position and 0.87-0.90 at the later
      ones (given the earlier), so a geometric model from the first undervalued wide steps
      and settled on 3 drafts where 5 paid.

    A verify step is nearly free on a GPU at small n and almost proportional to its rows on
    a CPU once a few requests batch (SmolLM2, two Sapphire Rapids cores: 64 rows take 1.6x
    the time of 32), so the same config drafts k for a lone stream and fewer or none in a
    batch of 32.

    Acceptance is measured first, by a probe: one draft for the requests with a real
    proposal. A row count not measured yet is tried (every EXPLORE steps, until its bucket
    is trusted) before the model would extrapolate past it. A step that stays small at
    k_max (WIDE_ROWS: a lone stream) tries k_max at once, at every step until it is
    trusted (a try whose request had nothing to propose measures nothing), and every k
    between then interpolates. A wide batch widens only where the measured acceptance
    could pay (EXPLORE_ACCEPT) and while the widest known k is still the best, k doubling
    each time: it never runs a k_max-wide step to learn that drafting does not pay (suffix
    decoding's k_max is 24: 32 requests x 25 rows is a prefill-sized step). A row count
    not measured for COST_STALE steps is tried again, and its next time replaces the old
    average: a few slow early steps (eager warm-ups, a busy machine) must not keep a k
    unchosen for good.

    Acceptance belongs to the requests, cost to the machine: in a small step a request
    that starts decoding brings an acceptance nobody has measured, so the first-draft
    estimate goes back up to the neutral PRIOR if it had fallen below (`request_started`).
    Without that, a lone stream that followed a request whose drafts all failed (a chat
    greeting before a code edit) stayed at no drafts for hundreds of steps, probes
    coming at doubling intervals and each moving the estimate by ALPHA.
    """

    ALPHA = 0.1  # weight of the newest measurement in the moving averages
    EXPLORE = 4  # steps between a wide step's tries of a row count not measured TRUSTED times yet
    # a row bucket's first WARMUP measurements are not averaged in: a new shape's first steps
    # run eagerly (CPU replay warms up, records, then checks its first replay against an
    # eager run; CUDA graphs capture), slower than its later ones, and an exploration
    # measured that way would never look worth repeating
    WARMUP = 3
    TRUSTED = 2  # measurements of a row bucket after its warm-up before it is used
    # while drafting does not pay, a probe drafts 1 to measure acceptance: PROBE steps after
    # the first, then at doubling intervals up to MAX_PROBE while nothing changes
    PROBE = 32
    MAX_PROBE = 512
    # wider steps are explored only once a probe measured a first-draft acceptance above
    # this: below it even free verify rows would gain under 10% (E(k) < 1 / (1 - a))
    EXPLORE_ACCEPT = 0.1
    WIDE_ROWS = 64  # a step of at most this many rows at k_max is explored at k_max at once
    STALE = 64  # steps after which a draft position's acceptance, not measured since, is not trusted
    COST_STALE = 256  # steps after which a row bucket's time, not measured since, is tried again
    PRIOR = 0.5  # first-draft acceptance of requests nobody has measured

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        # row bucket -> [mean rows, mean seconds, count, step last measured]
        self.time: dict[int, list[float]] = {}
        self.accept = self.PRIOR  # first-draft acceptance until measured
        # draft position (2, 3, ...) -> [acceptance given the one before, step last measured]
        self.deeper: dict[int, list[float]] = {}
        self.propose_s = 0.0  # proposer seconds per drafted position
        self.steps = 0
        self.last_try = -self.EXPLORE
        self.accept_seen = False
        self.probe_every = self.PROBE
        self.last_probe = 0
        self.probing = False  # whether the last drafts() answer was an acceptance probe

    @staticmethod
    def bucket(rows: int) -> int:
        """Row buckets about 12% wide (exact below 9 rows)."""
        return int(math.log(max(1, rows)) / math.log(1.125))

    def record_step(self, rows: int, seconds: float) -> None:
        """A step of decodes and verifies only: `rows` query rows took `seconds`."""
        entry = self.time.setdefault(self.bucket(rows), [float(rows), seconds, 0, self.steps])
        seen, stale = entry[2], self._stale(entry)
        entry[2] += 1
        entry[3] = self.steps
        if seen <= self.WARMUP or stale:  # the warm-up steps, then the first after them, start the averages
            entry[0], entry[1] = float(rows), seconds
            return
        entry[0] += self.ALPHA * (rows - entry[0])
        entry[1] += self.ALPHA * (seconds - entry[1])

    def _small(self, n: int) -> bool:
        """Whether a step of n requests stays small (WIDE_ROWS) even at k_max drafts each."""
        return n * (1 + self.k_max) <= self.WIDE_ROWS

    def _stale(self, entry: list[float]) -> bool:
        return self.steps - entry[3] > self.COST_STALE

    def request_started(self, n: int) -> None:
        """A request starts decoding in a step of `n` requests: in a small step (see the
        class doc) the first-draft estimate goes back up to PRIOR."""
        if self.k_max and self._small(n) and self.accept < self.PRIOR:
            self.accept = self.PRIOR
            self.probe_every = self.PROBE

    def record_acceptance(self, drafts: int, first_accepted: int,
                          deeper: Sequence[tuple[int, int]] = ()) -> None:
        """A step's verdicts: `first_accepted` of `drafts` first drafts were accepted;
        deeper[i] = (drafts that reached position i + 2, i.e. whose draft i + 1 was
        accepted, and how many of them had that one accepted too)."""
        if drafts:
            rate = first_accepted / drafts
            self.accept = rate if not self.accept_seen else self.accept + self.ALPHA * (rate - self.accept)
            self.accept_seen = True
        for position, (reached, accepted) in enumerate(deeper, start=2):
            if reached:
                rate, old = accepted / reached, self._measured(position)
                self.deeper[position] = [rate if old is None else old + self.ALPHA * (rate - old), self.steps]

    def _measured(self, position: int) -> float | None:
        """Draft position's acceptance given the one before, if measured in the last STALE steps."""
        seen = self.deeper.get(position)
        return seen[0] if seen is not None and self.steps - seen[1] <= self.STALE else None

    def expected_tokens(self, k: int) -> float:
        """E(k): a request's expected tokens from a verify step with k drafts."""
        total, reach, rate = 1.0, 1.0, min(self.accept, 0.999)
        for position in range(1, k + 1):
            measured = self._measured(position) if position > 1 else None
            if measured is not None:
                rate = min(measured, 0.999)
            reach *= rate
            total += reach
        return total

    def record_proposal(self, positions: int, seconds: float) -> None:
        if positions:
            self.propose_s += self.ALPHA * (seconds / positions - self.propose_s)

    def cost(self, rows: int) -> float | None:
        """Estimated step time for `rows` rows, None when no trusted measurement is above."""
        known = sorted((e[0], e[1]) for e in self.time.values()
                       if e[2] >= self.WARMUP + self.TRUSTED and not self._stale(e))
        if not known:
            return None
        above = [(r, t) for r, t in known if r >= rows]
        if not above:
            return None
        below = [(r, t) for r, t in known if r <= rows]
        (r1, t1), (r0, t0) = above[0], below[-1] if below else (0.0, 0.0)
        return t1 if r1 == r0 else t0 + (t1 - t0) * (rows - r0) / (r1 - r0)

    def drafts(self, n: int) -> int:
        """Drafts per request for the next step of n requests (`probing` then says whether
        the answer is an acceptance probe: the caller verifies real proposals only, no
        fillers, so a probe in a large batch costs a few rows, not n)."""
        self.steps += 1
        self.probing = False
        best, best_rate = 0, None
        for k in range(self.k_max + 1):
            cost = self.cost(n * (1 + k))
            if cost is None:
                if k and self._small(n):
                    # a small step even at k_max: measure the widest first, then every k in
                    # between interpolates
                    self.last_try = self.steps
                    return self.k_max if self.cost(n * (1 + self.k_max)) is None else k
                if k and self.steps - self.last_try >= self.EXPLORE:
                    if best == k - 1 and self.accept_seen and self.accept > self.EXPLORE_ACCEPT:
                        # a wide batch: widen only while widening paid so far, doubling k
                        # from the widest known (1, 2, 4, ... k_max), so a batch where drafts
                        # do not pay never runs an n x (1 + k_max) row step to learn that
                        self.last_try = self.steps
                        return min(self.k_max, max(1, 2 * (k - 1)))
                break
            rate = n * self.expected_tokens(k) / (cost + k * n * self.propose_s)
            if best_rate is None or rate > best_rate:
                best, best_rate = k, rate
        if best:
            self.probe_every = self.PROBE
        elif self.k_max and (self.steps - self.last_probe >= self.probe_every
                             or not self.accept_seen and not self.last_probe):  # the first probe: now
            # a verify step now and then keeps the acceptance estimate current; while they
            # keep finding that drafting does not pay, they come half as often each time
            self.probe_every = min(self.MAX_PROBE, self.probe_every * 2) if self.last_probe else self.probe_every
            self.last_probe = self.steps
            self.probing = True
            return 1
        return best


@dataclass
class SpecStats:
    """vLLM's spec-decode counters: a draft is one request's proposal verified in a step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position.extend([0] * (num_drafted - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step of a request: 1 (the target's own) + accepted drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
