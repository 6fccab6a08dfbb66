"""Speculative-decoding proposers: none is built yet, so this package registers nothing.

`--speculative-config` is refused at start-up (`core/config.py`, SpecConfig) until the
speculative-decoding issue lands. What exists in the core, and where a proposer plugs in:

- contract: `core/contracts.py` `SpecProposer.propose(token_ids, k)`; hook
  `pagedllm_spec_methods` (core/hookspecs.py); lookup `PluginRegistry.spec_method`.
- scheduling: a request's `spec_token_ids` (core/request.py) are scheduled with its next
  token as 1 + k tokens, and `Scheduler.update_from_output` rolls back the KV of rejected
  proposals (tests/core/test_scheduler.py covers both).
- missing: a proposer call before each step (engine), verification of the k + 1
  positions with a rejection sampler (core/sampler.py), a step yielding several tokens
  per request (worker.StepResult already maps each request to a token list).
"""
