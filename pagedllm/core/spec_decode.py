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
    config = SpecDecodeConfig(method=method, num_speculative_tokens=k, model=values.get("model"),
                              quantization=values.get("quantization"), disable_by_batch_size=cutoff,
                              options=options)
    cls.validate(config)
    return config


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
