"""Structured outputs under speculative decoding (ngram drafts, verified in one forward):
the processor accepts drafts tentatively to mask the later rows, then rolls them back, so
greedy constrained text is the same as without speculation, and valid."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.request import StructuredOutputsParams as SO
from pagedllm.plugins.structured_outputs.processor import StructuredOutputsProcessor
from tests.plugins.structured_outputs.conftest import LLM_ARGS, assert_valid_json, chat_prompt
from tests.plugins.structured_outputs.test_generate import SCHEMAS

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# the prompts repeat the schema's keys, so ngram drafts are often right
CASES = [(SCHEMAS[n][0] + " Use the keys " + ", ".join(SCHEMAS[n][1]["properties"]) + ".", SCHEMAS[n][1])
         for n in ("nested", "arrays", "person")]


def run(llm):
    prompts = [chat_prompt(llm, text) for text, _ in CASES]
    params = [SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=SO(json=schema))
              for _, schema in CASES]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("backend", ["auto", "guidance"])  # auto: xgrammar first
def test_same_text_with_and_without_speculation(backend, monkeypatch):
    # float32 products: under the GGUF default ("medium") a verify step's rows may take the
    # bf16 GEMM where a lone decode row takes the Q4_1 kernel (the row crossovers are
    # measured per machine), and a near-tie between two tokens can then flip
    monkeypatch.setenv("PAGEDLLM_FLOAT32_MATMUL_PRECISION", "highest")
    config = {"backend": backend}
    plain = run(LLM(**LLM_ARGS, structured_outputs_config=config))
    spec_llm = LLM(**LLM_ARGS, structured_outputs_config=config, speculative_config={**NGRAM, "adaptive": False})
    rolled_back = []
    real = StructuredOutputsProcessor.rollback
    monkeypatch.setattr(StructuredOutputsProcessor, "rollback",
                        lambda self, n: (rolled_back.append(n), real(self, n))[1])
    speculated = run(spec_llm)
    assert sum(rolled_back) > 10, "few drafts were verified: the test would prove nothing"
    for (text, schema), a, b in zip(CASES, plain, speculated):
        assert b.text == a.text, f"{backend}: speculation changed the output for {text!r}"
        assert_valid_json(b.text, schema, backend)
