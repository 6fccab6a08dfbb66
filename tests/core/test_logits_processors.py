"""The per-request logits-processor seam and the sampler's token rules, through the engine.

A toy processor (an allowed set of token ids) must give exactly what
`allowed_token_ids` gives for the same set (two mechanisms, one answer), and
transformers' greedy argmax restricted to that set; it must wait in the queue while
not ready without holding up the requests behind it, end its request on failure, see
exactly the tokens appended (also under speculative decoding, where it accepts drafts
tentatively and rolls them back), and stop its request when it terminates.
"""

from __future__ import annotations

import json
import shutil
import threading
from typing import Sequence

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.contracts import (
    LogitsProcessor,
    LogitsProcessorFactory,
    bitmask_bias,
    bitmask_empty,
    bitmask_words,
    pack_bitmask,
    unpack_bitmask,
)


def test_bitmask_round_trip():
    g = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 33, 100, 49152):
        mask = torch.rand(3, vocab, generator=g) > 0.5
        packed = pack_bitmask(mask)
        assert packed.dtype == torch.int32 and packed.shape == (3, bitmask_words(vocab))
        assert torch.equal(unpack_bitmask(packed, vocab), mask)
    assert bool(unpack_bitmask(torch.full((1, 2), -1, dtype=torch.int32), 64).all())
    mask = torch.rand(4, 100, generator=g) > 0.7
    mask[2] = False
    packed = pack_bitmask(mask)
    packed[2, -1] = -1 << 4  # bits past the vocabulary (100 = 3 * 32 + 4) do not count as allowed
    bias = bitmask_bias(packed, 100)
    assert torch.equal(bias == 0, mask) and bool(torch.isneginf(bias[~mask]).all())
    assert bitmask_empty(packed, 100).tolist() == [False, False, True, False] or not mask[[0, 1, 3]].any(dim=1).all()


class SetProcessor(LogitsProcessor):
    """Allows only `allowed`; records what it is told; optional readiness gate and
    termination after `stop_after` tokens."""

    def __init__(self, allowed: list[int], vocab: int, gate: threading.Event | None = None,
                 stop_after: int | None = None, fail: str | None = None) -> None:
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[allowed] = True
        self.row = pack_bitmask(mask)
        self.allowed = set(allowed)
        self.gate, self.stop_after, self.fail = gate, stop_after, fail
        self.accepted: list[int] = []
        self.rollbacks = 0

    def ready(self) -> bool:
        return self.fail is None and (self.gate is None or self.gate.is_set())

    def failure(self) -> str | None:
        return self.fail

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.row

    def accept(self, token_ids: Sequence[int]) -> bool:
        if any(t not in self.allowed for t in token_ids):
            return False
        self.accepted.extend(token_ids)
        return True

    def rollback(self, num_tokens: int) -> None:
        self.rollbacks += 1
        del self.accepted[len(self.accepted) - num_tokens:]

    def is_terminated(self) -> bool:
        return self.stop_after is not None and len(self.accepted) >= self.stop_after


class SetFactory(LogitsProcessorFactory):
    """Makes a SetProcessor for requests whose extra_args carry "allowed"."""

    name = "test_set"

    def __init__(self, context) -> None:
        super().__init__(context)
        self.made: list[SetProcessor] = []

    def validate(self, params) -> None:
        allowed = (params.extra_args or {}).get("allowed")
        if allowed is not None and not allowed:
            raise ValueError("SamplingParams.extra_args: 'allowed' must not be empty")

    def create(self, params, prompt_token_ids):
        args = params.extra_args or {}
        if "allowed" not in args:
            return None
        proc = SetProcessor(args["allowed"], self.context.vocab_size, args.get("gate"), args.get("stop_after"),
                            args.get("fail"))
        self.made.append(proc)
        return proc


ALLOWED = [5, 17, 40, 41, 99, 200, 301]
PROMPTS = [[3, 8, 22, 9], [11, 4, 30, 60, 2, 7, 19]]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine_llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", enforce_eager=True)
    factory = SetFactory(engine_llm.engine.logits_factories[0].context if engine_llm.engine.logits_factories
                         else _context(engine_llm))
    engine_llm.engine.logits_factories.append(factory)
    yield engine_llm, factory
    engine_llm.engine.logits_factories.remove(factory)


def _context(llm):
    from pagedllm.core.contracts import LogitsProcessorContext

    e = llm.engine
    return LogitsProcessorContext(e.tokenizer, e.vocab_size, e.eos_token_ids)


def _hf_restricted_greedy(model_dir, prompt: list[int], allowed: list[int], num_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(allowed[int(logits[allowed].argmax())])
    return ids[len(prompt):]


def test_processor_equals_allowed_token_ids_and_transformers(llm, tiny_model_dir):
    engine_llm, factory = llm
    by_processor = engine_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, extra_args={"allowed": ALLOWED}), use_tqdm=False)
    by_rule = engine_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=ALLOWED), use_tqdm=False)
    for p, a, b in zip(PROMPTS, by_processor, by_rule):
        tokens = a.outputs[0].token_ids
        assert set(tokens) <= set(ALLOWED)
        assert tokens == b.outputs[0].token_ids
        assert tokens == _hf_restricted_greedy(tiny_model_dir("llama"), p, ALLOWED, 12)
    # each processor saw exactly its request's tokens
    for proc, out in zip(factory.made[-2:], by_processor):
        assert proc.accepted == out.outputs[0].token_ids


def test_sampled_rows_stay_inside_the_mask(llm):
    engine_llm, _ = llm
    outs = engine_llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(
        temperature=1.5, seed=3, n=3, max_tokens=16, ignore_eos=True, extra_args={"allowed": ALLOWED}),
        use_tqdm=False)
    for c in outs[0].outputs:
        assert set(c.token_ids) <= set(ALLOWED) and len(c.token_ids) == 16


def test_termination_stops_the_request(llm):
    engine_llm, _ = llm
    out = engine_llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, extra_args={"allowed": ALLOWED, "stop_after": 3}),
        use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "stop"


def test_unready_request_waits_without_holding_up_others(llm):
    engine_llm, _ = llm
    engine = engine_llm.engine
    gate = threading.Event()
    engine.add_request("slow", None, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                    extra_args={"allowed": ALLOWED, "gate": gate}), PROMPTS[0])
    engine.add_request("fast", None, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), PROMPTS[1])
    finished = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if "fast" in finished:
            break
    assert "fast" in finished and "slow" not in finished
    assert engine.scheduler.requests["slow"].num_computed_tokens == 0  # never scheduled
    gate.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished["slow"].outputs[0].token_ids) <= set(ALLOWED)


def test_failed_processor_ends_its_request_with_the_error(llm):
    engine_llm, _ = llm
    engine = engine_llm.engine
    engine.add_request("bad", None, SamplingParams(max_tokens=4, extra_args={"allowed": ALLOWED,
                                                                            "fail": "grammar did not compile"}),
                       PROMPTS[0])
    engine.add_request("good", None, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), PROMPTS[1])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["bad"].error == "grammar did not compile"
    assert finished["bad"].outputs[0].finish_reason == "abort"
    assert finished["good"].error is None and len(finished["good"].outputs[0].token_ids) == 3


def test_validate_refuses_before_anything_is_queued(llm):
    engine_llm, _ = llm
    with pytest.raises(ValueError, match="extra_args"):
        engine_llm.generate(["hi"], SamplingParams(extra_args={"allowed": []}), use_tqdm=False)
    assert not engine_llm.engine.has_unfinished_requests()


def test_speculative_drafts_are_rolled_back(tiny_model_dir):
    """ngram drafts over a repetitive prompt: the processor fills masks for drafted
    positions by accepting drafts tentatively, rolls them back, and ends up having
    accepted exactly the output; tokens equal those without speculation."""
    prompt = [5, 17, 40, 41] * 6
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, extra_args={"allowed": ALLOWED})
    outs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                        "prompt_lookup_max": 4}):
        engine_llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", enforce_eager=True,
                         speculative_config=spec)
        factory = SetFactory(_context(engine_llm))
        engine_llm.engine.logits_factories.append(factory)
        outs[spec is None] = engine_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        assert factory.made[0].accepted == outs[spec is None].outputs[0].token_ids
        if spec is not None:
            assert factory.made[0].rollbacks > 0, "no draft was verified: the test proves nothing"
            assert engine_llm.engine.scheduler.spec_stats.num_draft_tokens > 0
    assert outs[True].outputs[0].token_ids == outs[False].outputs[0].token_ids


def test_logit_bias_bad_words_and_allowed_ids(llm, tiny_model_dir):
    engine_llm, _ = llm
    base = engine_llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    first = base[0]
    biased = engine_llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logit_bias={first: -100.0}), use_tqdm=False)[0]
    assert biased.outputs[0].token_ids[0] != first
    pushed = engine_llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logit_bias={123: 100.0}), use_tqdm=False)[0]
    assert pushed.outputs[0].token_ids == [123] * 4
    # a bad word is never generated: ban the text of the greedy output's first token
    tok = engine_llm.get_tokenizer()
    word = tok.decode([first]).strip()
    if word:
        banned = engine_llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True, bad_words=[word]), use_tqdm=False)[0].outputs[0]
        assert banned.token_ids[0] != first
    with pytest.raises(ValueError, match="logit_bias"):
        engine_llm.generate(["hi"], SamplingParams(logit_bias={10**7: 1.0}), use_tqdm=False)


def test_every_eos_id_stops(tiny_model_dir, tmp_path):
    """generation_config.json's list of eos ids: any of them ends a request."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    first = LLM(str(model_dir), dtype="float32", device="cpu", enforce_eager=True)
    tokens = first.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    stopper = tokens[2]
    cut = tokens.index(stopper)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, stopper]}))
    second = LLM(str(model_dir), dtype="float32", device="cpu", enforce_eager=True)
    assert stopper in second.engine.eos_token_ids and 1 in second.engine.eos_token_ids
    out = second.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(temperature=0, max_tokens=8),
                          use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:cut + 1] and out.finish_reason == "stop"
    # min_tokens bans every eos id until reached
    held = second.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(
        temperature=0, max_tokens=8, min_tokens=cut + 2), use_tqdm=False)[0].outputs[0]
    assert stopper not in held.token_ids[:cut + 2]


def test_an_eos_id_outside_the_vocabulary_is_dropped_with_a_warning(tiny_model_dir, tmp_path, caplog):
    """A generation config left from another model (an eos id past the vocabulary) must not
    reach the sampler: banning it under min_tokens would index past the logits (a device-side
    assert on CUDA)."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [vocab + 7, 1]}))
    with caplog.at_level("WARNING", logger="pagedllm"):
        llm = LLM(str(model_dir), dtype="float32", device="cpu", enforce_eager=True)
    assert vocab + 7 not in llm.engine.eos_token_ids and 1 in llm.engine.eos_token_ids
    assert any(f"eos_token_id {vocab + 7} outside" in r.message for r in caplog.records)
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(temperature=0, max_tokens=4, min_tokens=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 3
