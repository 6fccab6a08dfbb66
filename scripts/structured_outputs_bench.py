"""Structured-outputs backends side by side on the bundled SmolLM2 tokenizer (49152 tokens).

For each backend (llguidance, xgrammar, outlines-core) and each spec (six JSON schemas, a
regex, a choice): the one-time vocabulary set-up, the cold compile time (no cache), and the
per-token cost of constraining a valid output (fill_bitmask + accept through the plugin's
processor, so the EOS and padding fix-ups are counted), mean and p99 over the tokens of a
valid instance. What "auto" picks first comes from these numbers (factory.AUTO_ORDER).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/structured_outputs_bench.py [--repeat 3]

Numbers on a shared machine are noisy: compare backends within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedllm.core.contracts import bitmask_words
from pagedllm.plugins.structured_outputs.backends import UnsupportedSpec, load_backend
from pagedllm.plugins.structured_outputs.compiler import CompileJob
from pagedllm.plugins.structured_outputs.processor import MaskLayout, StructuredOutputsProcessor
from pagedllm.core.request import StructuredOutputsParams
from pagedllm.plugins.structured_outputs.spec import CompileSpec

def json_spec(schema: dict) -> CompileSpec:
    """The spec the engine compiles for this schema (objects closed, as requests get them)."""
    return CompileSpec.from_params(StructuredOutputsParams(json=schema), {})


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {
        "id": {"type": "integer"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]}},
        "required": ["id", "address"]}},
    "required": ["user"]}
ENUMS = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
    "status": {"const": "ok"}}, "required": ["color", "size", "status"]}
ARRAYS = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
    "scores": {"type": "array", "items": {"type": "number"}}}, "required": ["tags", "scores"]}
# bounds on numbers (outlines-core cannot honour them: refused there)
BOUNDED = {"type": "object", "properties": {
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "ratio": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["age", "ratio"]}
OPTIONAL = {"type": "object", "properties": {
    "title": {"type": "string"}, "subtitle": {"type": "string"}, "year": {"type": "integer"},
    "draft": {"type": "boolean"}}, "required": ["title"]}
WIDE = {"type": "object", "properties": {
    f"field_{i}": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "number"}][i % 4]
    for i in range(20)}, "required": [f"field_{i}" for i in range(20)]}

CASES = [
    ("json person", json_spec(PERSON), json.dumps({"name": "Ada Lovelace", "age": 36})),
    ("json nested", json_spec(NESTED),
     json.dumps({"user": {"id": 7, "address": {"city": "Paris", "zip": "75001"}}})),
    ("json enums", json_spec(ENUMS),
     json.dumps({"color": "green", "size": "XL", "status": "ok"})),
    ("json arrays", json_spec(ARRAYS),
     json.dumps({"tags": ["fast", "small", "safe"], "scores": [0.5, 12.25, -3]})),
    ("json bounded", json_spec(BOUNDED), json.dumps({"age": 42, "ratio": 0.75})),
    ("json optional", json_spec(OPTIONAL), json.dumps({"title": "Dune", "year": 1965})),
    ("json wide (20)", json_spec(WIDE),
     json.dumps({f"field_{i}": ["text", i, True, i + 0.5][i % 4] for i in range(20)})),
    ("regex phone", CompileSpec("regex", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"), "(555) 123-4567"),
    ("choice", CompileSpec("choice", json.dumps(["positive", "negative", "neutral"])), "negative"),
]


def load_tokenizer():
    from pagedllm import LLM

    llm = LLM(max_model_len=256, kv_cache_memory=64 << 20)
    engine = llm.engine
    return engine.tokenizer, engine.vocab_size, engine.eos_token_ids


class _Done(CompileJob):
    """A job already holding its grammar (the bench compiles synchronously)."""

    def __init__(self, grammar) -> None:
        super().__init__(CompileSpec("regex", ""), 0.0)
        self.future.set_result(grammar)


def per_token_us(grammar, layout: MaskLayout, token_ids: list[int], vocab_size: int, eos: int) -> list[float]:
    proc = StructuredOutputsProcessor(_Done(grammar), layout)
    assert proc.ready()
    bitmask = torch.full((1, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    times = []
    for token in [*token_ids, eos]:
        start = time.perf_counter()
        proc.fill_bitmask(bitmask, 0)
        ok = proc.accept([token])
        times.append((time.perf_counter() - start) * 1e6)
        if not ok:
            raise RuntimeError(f"token {token} of a valid instance was refused")
        bitmask.fill_(-1)
    assert proc.is_terminated()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="cold compiles per case (the median is shown)")
    parser.add_argument("--backends", default="guidance,xgrammar,outlines")
    args = parser.parse_args()
    tokenizer, vocab_size, eos_ids = load_tokenizer()
    layout = MaskLayout(vocab_size, len(tokenizer), eos_ids)
    print(f"tokenizer: {len(tokenizer)} tokens, logits width {vocab_size}; torch threads {torch.get_num_threads()}")
    summary = {}
    for name in args.backends.split(","):
        start = time.perf_counter()
        backend = load_backend(name, tokenizer, vocab_size, eos_ids)
        setup = time.perf_counter() - start
        print(f"\n== {name}: vocabulary set-up {setup * 1e3:.0f} ms")
        _, warm_spec, warm_text = CASES[0]  # first-call costs (lazy tables, caches) out of the timings
        per_token_us(backend.compile(warm_spec), layout, tokenizer.encode(warm_text, add_special_tokens=False),
                     vocab_size, eos_ids[0])
        print(f"{'case':<16} {'compile ms':>11} {'mask+accept us: mean':>21} {'p99':>8} {'tokens':>7}")
        compiles, means = [], []
        for label, spec, text in CASES:
            token_ids = tokenizer.encode(text, add_special_tokens=False)
            try:
                runs = []
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    grammar = backend.compile(spec)
                    runs.append((time.perf_counter() - t0) * 1e3)
            except UnsupportedSpec as exc:
                print(f"{label:<16} refused: {exc}")
                continue
            times = per_token_us(grammar, layout, token_ids, vocab_size, eos_ids[0])
            p99 = sorted(times)[min(len(times) - 1, int(0.99 * len(times)))]
            compile_ms = statistics.median(runs)
            compiles.append(compile_ms)
            means.append(statistics.fmean(times))
            print(f"{label:<16} {compile_ms:>11.2f} {statistics.fmean(times):>21.1f} {p99:>8.1f} {len(times):>7}")
        summary[name] = (setup * 1e3, statistics.fmean(compiles), statistics.fmean(means), len(compiles))
    print("\n== summary (mean over the cases each backend compiled)")
    print(f"{'backend':<10} {'set-up ms':>10} {'compile ms':>11} {'per-token us':>13} {'cases':>6}")
    for name, (setup, comp, tok, n) in summary.items():
        print(f"{name:<10} {setup:>10.0f} {comp:>11.2f} {tok:>13.1f} {n:>6}/{len(CASES)}")


if __name__ == "__main__":
    main()
