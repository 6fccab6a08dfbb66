"""Built-in speculative-decoding proposers (`--speculative-config '{"method": ...}'`).

Each maps a method name to (module, class) under this package, imported when the plugin
manager asks; a proposer's heavy imports (a suffix-tree library, a draft model) wait for
its construction. The core verifies every proposal (core/sampler.py `Sampler.verify`),
so a proposer only decides how many tokens are accepted, never which tokens come out.
"""

from __future__ import annotations

import importlib

from pagedllm import hookimpl

_SPEC_METHODS = {
    "ngram": ("ngram", "NgramProposer"),
    "suffix": ("suffix", "SuffixProposer"),
    "draft_model": ("draft_model", "DraftModelProposer"),
    "eagle": ("eagle", "EagleProposer"),  # EAGLE-1 heads (fc over the target's last hidden state)
    "eagle3": ("eagle", "Eagle3Proposer"),
}


@hookimpl
def pagedllm_spec_methods():
    return {name: getattr(importlib.import_module(f"{__name__}.{module}"), cls)
            for name, (module, cls) in _SPEC_METHODS.items()}
