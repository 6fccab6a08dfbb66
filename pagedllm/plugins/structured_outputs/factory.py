"""The `structured_outputs` logits-processor factory: vLLM's structured outputs
(`SamplingParams.structured_outputs`, `--structured-outputs-config`) on the core's
per-request processor seam.

Engine options (context.options): backend ("auto", "guidance" alias "llguidance",
"xgrammar", "outlines"), disable_fallback (auto tries only its first backend),
disable_any_whitespace (engine-wide default of the request field of that name; so is
disable_additional_properties, accepted though objects are closed anyway: see spec.py),
compile_timeout_s (default 10), enable_in_reasoning
(constrain the reasoning section too; by default constraints start after
context.reasoning_end when the server runs a reasoning parser).
"""

from __future__ import annotations

from typing import Any, Sequence

from pagedllm.core.contracts import LogitsProcessorContext, LogitsProcessorFactory
from pagedllm.plugins.structured_outputs.backends import canonical_name
from pagedllm.plugins.structured_outputs.compiler import CompileJob, Compiler
from pagedllm.plugins.structured_outputs.processor import (
    MaskLayout,
    ReasoningGate,
    StructuredOutputsProcessor,
    reasoning_closed_by_prompt,
)
from pagedllm.plugins.structured_outputs.spec import CompileSpec

DEFAULT_TIMEOUT_S = 10.0
# "auto": the measured default first, then the others. scripts/structured_outputs_bench.py on
# SmolLM2's 49k vocabulary: xgrammar masks a token in ~19 us against llguidance's ~46 us
# (outlines ~49 us), and masks are computed on the engine thread every step, for every
# constrained sequence, while compiles run on the pool and are cached: xgrammar compiles
# closed-object schemas in ~2.4 ms (llguidance ~0.6 ms, outlines ~66 ms). llguidance takes
# what xgrammar refuses (whitespace_pattern, features it lacks) and is the one installed with
# pagedllm, so "auto" still works where xgrammar is not installed.
AUTO_ORDER = ("xgrammar", "guidance", "outlines")


class StructuredOutputsFactory(LogitsProcessorFactory):
    """Compiles each request's spec (cached) and makes one processor per sequence."""

    name = "structured_outputs"

    def __init__(self, context: LogitsProcessorContext) -> None:
        super().__init__(context)
        options = context.options
        self.backend = canonical_name(options.get("backend") or "auto")
        timeout = options.get("compile_timeout_s", DEFAULT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"structured_outputs_config compile_timeout_s must be a positive number of "
                             f"seconds; got {timeout!r}")
        self.enable_in_reasoning = bool(options.get("enable_in_reasoning"))
        tokenizer = context.tokenizer
        self.compiler = Compiler(tokenizer, context.vocab_size, context.eos_token_ids, self.backend, AUTO_ORDER,
                                 fallback=not options.get("disable_fallback"), timeout_s=float(timeout))
        size = len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else context.vocab_size
        self.layout = MaskLayout(context.vocab_size, size, context.eos_token_ids)

    def spec(self, params: Any) -> CompileSpec | None:
        """The canonical spec of these SamplingParams, or None when they ask for nothing."""
        so = getattr(params, "structured_outputs", None)
        return None if so is None else CompileSpec.from_params(so, self.context.options)

    def validate(self, params: Any) -> None:
        """Compile now (or find the compile cached), waiting at most compile_timeout_s; a
        ValueError starting "SamplingParams.structured_outputs: " otherwise."""
        spec = self.spec(params)
        if spec is not None:
            self.compiler.job(spec).wait()

    def create(self, params: Any, prompt_token_ids: Sequence[int]) -> StructuredOutputsProcessor | None:
        try:
            spec = self.spec(params)
        except ValueError as exc:  # reported through failure(): the engine ends the request
            return StructuredOutputsProcessor(CompileJob.failed(None, str(exc)), self.layout)
        if spec is None:
            return None
        end = self.context.reasoning_end
        gate = None
        if end and not self.enable_in_reasoning and not reasoning_closed_by_prompt(
                self.context.tokenizer, prompt_token_ids, end):
            gate = ReasoningGate(self.context.tokenizer, end)
        return StructuredOutputsProcessor(self.compiler.job(spec), self.layout, gate)

    def close(self) -> None:
        self.compiler.close()
