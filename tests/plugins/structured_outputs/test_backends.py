"""Each backend, chosen by --structured-outputs-config's "backend" (vLLM's names,
"llguidance" as the alias of "guidance"), constrains SmolLM2 end to end: JSON schemas
validate greedy and sampled, regex and choice outputs match; outlines refuses what it
cannot honour, naming the backends that can."""

from __future__ import annotations

import re

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.request import StructuredOutputsParams as SO
from tests.plugins.structured_outputs.conftest import LLM_ARGS, assert_valid_json, chat_prompt
from tests.plugins.structured_outputs.test_generate import SCHEMAS

PER_BACKEND = {"llguidance": ["nested", "bounds"], "xgrammar": ["nested", "bounds", "arrays"],
               "outlines": ["nested", "enums", "arrays"]}


@pytest.fixture(scope="module", params=list(PER_BACKEND))
def backend_llm(request):
    llm = LLM(**LLM_ARGS, structured_outputs_config={"backend": request.param})
    yield request.param, llm
    for factory in llm.engine.logits_factories:
        factory.close()


def test_backend_json_regex_choice(backend_llm):
    name, llm = backend_llm
    schemas = PER_BACKEND[name]
    prompts, params = [], []
    for temperature in (0.0, 0.8):
        for s in schemas:
            prompts.append(chat_prompt(llm, SCHEMAS[s][0]))
            so = SO(json=SCHEMAS[s][1])
            params.append(SamplingParams(temperature=temperature, seed=3, n=1 if temperature == 0 else 2,
                                         max_tokens=128, structured_outputs=so))
    regex = r"[A-Z][a-z]{2,8} [0-9]{1,2}, [0-9]{4}"
    prompts.append(chat_prompt(llm, "When was the Eiffel Tower finished? Give the date."))
    params.append(SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=SO(regex=regex)))
    choices = ["Paris", "London", "Rome"]
    prompts.append(chat_prompt(llm, "What is the capital of Italy?"))
    params.append(SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=8, structured_outputs=SO(choice=choices)))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs[:-2], params):
        for c in out.outputs:
            assert c.finish_reason == "stop", f"{name}: {c.text!r}"
            assert_valid_json(c.text, p.structured_outputs.json, f"{name} T={p.temperature}")
    assert re.fullmatch(regex, outs[-2].outputs[0].text), f"{name}: {outs[-2].outputs[0].text!r}"
    assert all(c.text in choices for c in outs[-1].outputs), [c.text for c in outs[-1].outputs]


def test_grammar_and_bounds_only_where_honoured(backend_llm):
    """outlines refuses a grammar and number bounds (naming who can); the others serve them."""
    name, llm = backend_llm
    cases = ((SO(grammar='root ::= "yes" | "no"'), "does not support grammar; backends that do: guidance, xgrammar"),
             (SO(json=SCHEMAS["bounds"][1]), "would ignore the schema keywords ['maximum', 'minimum']"))
    for so, why in cases:
        params = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=so)
        prompt = chat_prompt(llm, SCHEMAS["bounds"][0])
        if name == "outlines":
            with pytest.raises(ValueError, match=r"^SamplingParams\.structured_outputs: ") as info:
                llm.generate([prompt], params, use_tqdm=False)
            assert why in str(info.value)
            continue
        text = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
        if so.grammar:
            assert text in ("yes", "no"), text
        else:
            assert_valid_json(text, so.json, name)
