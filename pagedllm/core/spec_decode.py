"""The core side of speculative decoding: the checked config, and the counters.

`resolve_spec_config` turns vLLM's `--speculative-config` JSON into a
`SpecDecodeConfig` (unknown keys and methods are refused with the valid ones listed);
the worker builds the method's proposer from it and asks it for drafts after every
step; the sampler verifies them (`Sampler.verify`). `SpecStats` holds the counters
vLLM's metrics name (drafts, draft tokens, accepted tokens, per position).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.contracts.spec import CORE_KEYS, SpecDecodeConfig
from pagedllm.core.plugins import PluginRegistry

# vLLM's spellings of one method
METHOD_ALIASES = {"draft": "draft_model", "[ngram]": "ngram"}


def resolve_spec_config(raw: dict[str, Any] | None, registry: PluginRegistry) -> SpecDecodeConfig | None:
    """The checked config, or None when speculation is off (no config, or `{}`)."""
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
    options = {key: values.get(key, default) for key, default in cls.options.items()}
    adaptive = values.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise ValueError(f"--speculative-config: adaptive must be true or false, got {adaptive!r}")
    config = SpecDecodeConfig(method=method, num_speculative_tokens=k, model=values.get("model"),
                              quantization=values.get("quantization"), disable_by_batch_size=cutoff,
                              adaptive=adaptive, options=options)
    cls.validate(config)
    return config


class PayoffGuard:
    """Speculates only where it pays: for each batch size (bucketed by powers of two) it
    runs epochs of steps with and without speculation, compares the tokens per second of
    the latest epoch of each (whole steps: scheduling, verification, proposing, output),
    and keeps to the faster mode, trying the other one again every REVISIT steps, since
    acceptance changes as the text and the traffic change.

    A verify step scores n x (1 + k) positions: on a GPU that is nearly free at small n,
    on a CPU it costs almost in proportion once a few requests batch (SmolLM2 on two
    Sapphire Rapids cores: a 64-row step takes 1.6x a 32-row one), so the same k helps a
    lone stream 1.5-2.3x and slows a batch of 32 (measured 0.88x when always on).
    """

    EPOCH = 32  # steps per measured epoch
    REVISIT = 1000  # steps in the winning mode before the other gets an epoch again
    MARGIN = 1.05  # speculation must be this much faster to be chosen (noise is ~5% a step)

    def __init__(self) -> None:
        # bucket -> {mode: (tokens, seconds) of its latest epoch}
        self.latest: dict[int, dict[bool, tuple[int, float]]] = {}
        self.current: dict[int, tuple[bool, int, int, float]] = {}  # bucket -> (mode, steps, tokens, seconds)
        self.winner_steps: dict[int, int] = {}

    @staticmethod
    def bucket(num_requests: int) -> int:
        return max(1, num_requests).bit_length()

    def record(self, num_requests: int, speculated: bool, tokens: int, seconds: float) -> None:
        """One step's outcome, in the mode `speculate` chose for it (steps outside an epoch
        of that mode, or of another batch size, are not measured)."""
        b = self.bucket(num_requests)
        if b not in self.current or self.current[b][0] != speculated:
            return
        mode, steps, got, spent = self.current[b]
        steps, got, spent = steps + 1, got + tokens, spent + seconds
        if steps >= self.EPOCH:
            self.latest.setdefault(b, {})[mode] = (got, spent)
            del self.current[b]
        else:
            self.current[b] = (mode, steps, got, spent)

    def speculate(self, num_requests: int) -> bool:
        b = self.bucket(num_requests)
        if b in self.current:  # an epoch is being measured
            return self.current[b][0]
        seen = self.latest.get(b, {})
        if len(seen) == 2:
            steps = self.winner_steps.get(b, 0) + 1
            if steps < self.REVISIT:
                self.winner_steps[b] = steps
                (got_s, spent_s), (got_p, spent_p) = seen[True], seen[False]
                return got_s * spent_p >= self.MARGIN * got_p * spent_s  # rate with >= MARGIN x rate without
            self.winner_steps[b] = 0
            seen.clear()  # measure both again
        mode = True not in seen  # speculation first, then without
        self.current[b] = (mode, 0, 0, 0.0)
        return mode


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
