"""Structured outputs (JSON schema, regex, choice, grammar, json_object, structural tags)
as a logits-processor plugin, over three grammar engines: llguidance, xgrammar and
outlines-core (see factory.py for the options, backends/ for what each engine takes).

Registration imports nothing heavy: the factory module loads here, each grammar library
only when its backend is first used.
"""

from __future__ import annotations

from pagedllm.core.hookspecs import hookimpl


@hookimpl
def pagedllm_logits_processors():
    from pagedllm.plugins.structured_outputs.factory import StructuredOutputsFactory

    return {StructuredOutputsFactory.name: StructuredOutputsFactory}
