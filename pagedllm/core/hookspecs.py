"""The pluggy hookspecs: the plugin author's manual.

A plugin is a module (or object) with functions marked `@pagedllm.hookimpl`, exposed
through the `pagedllm.plugins` entry-point group, exactly as the built-ins are. Every
registry hook returns a mapping from public name to class; results from all plugins
are merged, and a name defined twice is an error that names both plugins. Hooks may
take no arguments today; pluggy lets later versions add opt-in arguments without
breaking existing plugins.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from pagedllm.core.contracts import (
        AttentionBackend,
        CausalLM,
        CheckpointFormat,
        QuantConfig,
        SpecProposer,
    )

PROJECT = "pagedllm"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def pagedllm_attention_backends() -> dict[str, type[AttentionBackend]]:
    """Attention backends this plugin provides, by name (e.g. {"TRITON": TritonBackend}).

    Called once when the plugin manager loads. Keep it cheap: import kernel libraries
    inside the backend's `check`/`impl_cls`, never at module import.
    """


@hookspec
def pagedllm_quant_methods() -> dict[str, type[QuantConfig]]:
    """Quantization formats by the name used in `quantization_config.quant_method`
    and `--quantization` (e.g. {"fp8": Fp8Config})."""


@hookspec
def pagedllm_spec_methods() -> dict[str, type[SpecProposer]]:
    """Speculative-decoding proposers by method name (e.g. {"ngram": NgramProposer})."""


@hookspec
def pagedllm_model_architectures() -> dict[str, type[CausalLM]]:
    """Model classes keyed by Hugging Face architecture name ("LlamaForCausalLM").

    To stay cheap, a plugin may return a lazily-imported class through a module-level
    `__getattr__`; the registry only touches the class when that architecture loads.
    """


@hookspec
def pagedllm_checkpoint_formats() -> dict[str, type[CheckpointFormat]]:
    """Checkpoint formats by `--load-format` name (e.g. {"gguf": GGUFFormat}).

    With `--load-format auto` each format's `detect(path)` is asked in turn.
    """


@hookspec
def pagedllm_add_cli_args(parser: argparse._ArgumentGroup) -> None:
    """Add plugin-specific flags to `pagedllm serve` (and the other commands that build
    an engine). `parser` is the "plugin options" argument group of the command's
    parser (call `parser.add_argument`). Values reach the plugin through
    `EngineConfig.plugin_options`, keyed by each flag's dest."""
