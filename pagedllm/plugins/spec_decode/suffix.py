"""suffix decoding (arXiv 2411.04975): drafts from suffix trees over the request's own
tokens and over earlier requests' outputs.

Built on Snowflake's ArcticInference (`arctic_inference.suffix_decoding`, the package
vLLM's suffix method uses): one suffix tree per running request (its prompt and output)
and one global tree over cached responses. Each step the last `max_tree_depth` tokens
are matched in both trees and the most likely continuation is drafted, as long as its
estimated probability stays above `suffix_decoding_min_token_prob` and its length
within `suffix_decoding_max_spec_factor` x the match length: the number of drafts
adapts per request and per step (up to num_speculative_tokens, by default the depth).
Agentic and repetitive workloads, whose outputs repeat their inputs or earlier
outputs, gain most.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedllm.core.contracts import ProposalBatch, ProposerContext, SpecDecodeConfig, SpecProposer

INSTALL = ("suffix decoding needs ArcticInference's suffix trees: pip install cmake ninja nanobind==2.9.2, then "
           "pip install --no-build-isolation --no-deps arctic-inference (it builds against the installed torch); "
           "`make install` does both")
DEPTH_KEY = "suffix_decoding_max_tree_depth"


class SuffixProposer(SpecProposer):
    name = "suffix"
    options = {
        DEPTH_KEY: 24,
        "suffix_decoding_max_cached_requests": 10000,
        "suffix_decoding_max_spec_factor": 1.0,
        "suffix_decoding_min_token_prob": 0.1,
    }
    default_num_speculative_tokens = 24  # vLLM: the tree depth

    @classmethod
    def validate(cls, config: SpecDecodeConfig) -> None:
        o = config.options
        checks = [
            (DEPTH_KEY, isinstance(o[DEPTH_KEY], int) and o[DEPTH_KEY] >= 1, "an integer >= 1"),
            ("suffix_decoding_max_cached_requests", isinstance(o["suffix_decoding_max_cached_requests"], int)
             and 0 <= o["suffix_decoding_max_cached_requests"] < 2 ** 31, "an integer in [0, 2^31)"),
            ("suffix_decoding_max_spec_factor", isinstance(o["suffix_decoding_max_spec_factor"], (int, float))
             and o["suffix_decoding_max_spec_factor"] >= 0, "a number >= 0"),
            ("suffix_decoding_min_token_prob", isinstance(o["suffix_decoding_min_token_prob"], (int, float))
             and 0 <= o["suffix_decoding_min_token_prob"] <= 1, "a number in [0, 1]"),
        ]
        for key, ok, allowed in checks:
            if not ok:
                raise ValueError(f"--speculative-config: {key} must be {allowed}, got {o[key]!r}")
        try:
            import arctic_inference.suffix_decoding  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"{INSTALL} ({exc})") from None

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        o: dict[str, Any] = context.config.options
        self.depth = o[DEPTH_KEY]
        self.max_spec_factor = float(o["suffix_decoding_max_spec_factor"])
        self.min_token_prob = float(o["suffix_decoding_min_token_prob"])
        self.cache = SuffixDecodingCache(max_tree_depth=self.depth,
                                         max_cached_requests=o["suffix_decoding_max_cached_requests"])
        self.seen: dict[str, int] = {}  # request id -> tokens its trees hold

    def forget(self, request_id: str) -> None:
        if self.seen.pop(request_id, None) is not None:
            self.cache.stop_request(request_id)  # its response stays in the global tree

    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        out = []
        for rid, ids, new, prompt_len, cap in zip(batch.request_ids, batch.token_ids, batch.num_new_tokens,
                                                  batch.num_prompt_tokens, batch.max_drafts):
            n = len(ids)
            held = self.seen.get(rid)
            if held is None or held != n - new:  # first sight, or back after a preemption
                if held is not None:
                    self.cache.stop_request(rid)
                self.cache.start_request(rid, np.asarray(ids[:prompt_len], dtype=np.int32))
                if n > prompt_len:
                    self.cache.add_active_response(rid, np.asarray(ids[prompt_len:], dtype=np.int32))
            else:
                self.cache.add_active_response(rid, np.asarray(ids[n - new:], dtype=np.int32))
            self.seen[rid] = n
            if cap <= 0:
                out.append([])
                continue
            context = np.asarray(ids[max(0, n - self.depth):], dtype=np.int32)
            draft = self.cache.speculate(rid, context, max_spec_tokens=cap, max_spec_factor=self.max_spec_factor,
                                         min_token_prob=self.min_token_prob)
            out.append(list(draft.token_ids))
        return out
