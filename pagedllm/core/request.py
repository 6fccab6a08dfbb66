"""Request state and the public request/response types (vLLM's names and fields).

A request's tokens are `prompt_token_ids + output_token_ids`; the scheduler only
advances `num_computed_tokens` towards `num_tokens` (plus speculative tokens). A
request is in exactly one of: waiting, running, finished.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

# The sampler works in float32, where 3.5e38 is already infinite: a temperature that large
# turns the -inf of a banned token (min_tokens) into NaN, and a repetition penalty of 1e-39
# turns a seen token's logit into inf; either way every draw is token 0. Past these bounds
# nothing changes anyway (at 1e6 every realistic logit divides to about 0: the distribution
# is uniform), so larger values are refused rather than clamped.
MAX_TEMPERATURE = 1e6
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's `StructuredOutputsParams`): exactly one of the
    constraint fields. The structured-outputs plugin compiles it; the core only carries it.

    json: a JSON schema (dict or its JSON text); regex: a regular expression; choice:
    one of these strings; grammar: an EBNF / Lark grammar; json_object: any JSON object;
    structural_tag: a structural-tag specification (JSON text: free text with tagged,
    schema-constrained regions, as tool calls need)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("SamplingParams.structured_outputs must set exactly one of "
                             f"{', '.join(self.KINDS)}; got {', '.join(given) or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("SamplingParams.structured_outputs choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"SamplingParams.structured_outputs {name} must be a string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("SamplingParams.structured_outputs json must be a JSON schema (an object or its text)")

    @property
    def kind(self) -> str:
        """The constraint field that is set ("json", "regex", ...)."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> Any:
        """The value of that field."""
        return getattr(self, self.kind)


@dataclass
class SamplingParams:
    """How to sample one request's completion; validated at construction."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words never generated (each token sequence they encode to)
    # for plugins (a logits processor reads its own keys here), as vLLM's SamplingParams.extra_args
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
        checks = [
            ("n", self.n >= 1, ">= 1"),
            ("temperature", 0.0 <= self.temperature <= MAX_TEMPERATURE, f"in [0, {MAX_TEMPERATURE:g}]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", self.top_k >= 0, "-1, 0 (off) or >= 1"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, ">= 1"),
            ("min_tokens", self.min_tokens >= 0, ">= 0"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("repetition_penalty", MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
             f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, ">= 0"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0, ">= 0"),
            ("logit_bias", all(-MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in (self.logit_bias or {}).values()),
             f"a map of token ids to values in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
            ("allowed_token_ids", self.allowed_token_ids is None or bool(self.allowed_token_ids),
             "a non-empty list of token ids"),
            ("bad_words", all(isinstance(w, str) and w for w in self.bad_words or []), "a list of non-empty strings"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {allowed}, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if any(not s for s in self.stop):
            raise ValueError("SamplingParams.stop must not contain empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_token_rules(self) -> bool:
        """Whether the sampler must edit this request's logits beyond penalties
        (logit_bias, allowed_token_ids, bad_words)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    def clone(self, **changes: Any) -> "SamplingParams":
        values = {k: getattr(self, k) for k in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # per prompt token (the first has none: nothing predicts it), when prompt_logprobs is set
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # set when the engine ended the request (a logits processor failed)


@dataclass(eq=False)
class Request:
    """One sequence being generated (a request with n > 1 becomes n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()  # any of them ends the request (unless ignore_eos)
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    spec_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # plugins' constraints on the next tokens (structured outputs, ...): see contracts.LogitsProcessor
    logits_processors: list[Any] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # why the request was ended by the engine (a processor that failed)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def processors_ready(self) -> bool:
        return all(p.ready() for p in self.logits_processors)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_dropped: int) -> None:
        """Drop the last output tokens (those after a stop string inside one step's
        accepted drafts) and their logprobs."""
        if num_dropped <= 0:
            return
        del self.output_token_ids[-num_dropped:]
        del self.all_token_ids[-num_dropped:]
        if self.logprobs is not None and len(self.logprobs) > len(self.output_token_ids):
            for record in self.logprobs[len(self.output_token_ids):]:  # the sampled token comes first
                self.cumulative_logprob -= next(iter(record.values())).logprob
            del self.logprobs[len(self.output_token_ids):]
