"""EAGLE and EAGLE-3 heads: not built yet; the methods are registered so that asking for
them says what is missing instead of "unknown method".

What they need beyond what the core already offers (hidden states of chosen target
layers, `CausalLM.set_aux_hidden_state_layers`; `TargetStep` in every `ProposalBatch`;
lookahead KV slots; `ProposerContext.load_model`): a loader for the published head
layout (`midlayer.*`, `fc` 3H -> H, a first layer taking 2H, `d2t` / `t2d` vocabulary
maps, an optional own `lm_head`), a proposer hook that sees prefill chunks that sample
nothing (the head's KV cache must cover the prompt), and the head's k-step loop.
"""

from __future__ import annotations

from pagedllm.core.contracts import ProposalBatch, SpecDecodeConfig, SpecProposer


class _NotYet(SpecProposer):
    @classmethod
    def validate(cls, config: SpecDecodeConfig) -> None:
        raise NotImplementedError(
            f"speculative method {cls.name!r} (EAGLE heads) is not supported yet: pagedllm cannot load "
            "EAGLE / EAGLE-3 head checkpoints (midlayer.*, fc, d2t/t2d) nor feed them the target's prefill; "
            "use \"ngram\", \"suffix\" or a \"draft_model\" for now")

    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        raise NotImplementedError(self.name)


class EagleProposer(_NotYet):
    name = "eagle"


class Eagle3Proposer(_NotYet):
    name = "eagle3"
