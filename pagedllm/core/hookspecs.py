"""The pluggy hookspecs: the plugin author's manual.

A plugin is a module (or object) with functions marked `@pagedllm.hookimpl`, exposed
through the `pagedllm.plugins` entry-point group, exactly as the built-ins are:

    [project.entry-points."pagedllm.plugins"]
    my_plugin = "my_package.pagedllm_plugin"

When they are called: every registry hook once, when the plugin registry is first built
in a process (`core.plugins.get_registry()`, at engine start-up; again only if
`PAGEDLLM_PLUGINS` changes). `pagedllm_add_cli_args` is called whenever a command
builds its parser. None of them is `firstresult`: pluggy calls every plugin's
implementation and the core merges the results.

What they return, and how duplicates resolve: each registry hook returns a mapping from
public name to class (`pagedllm_op_impls` a list of `OpImpl`). Returning None or an
empty mapping is fine. The core merges all plugins' mappings; the same name bound to
the same class twice is harmless, but one name bound to two different classes is an
error at start-up that names both, so a third-party plugin can never silently replace
a built-in. Choose a new name (and select it by name) instead.

Keep every hook cheap: it runs in every process that builds an engine. Import kernel
libraries inside the classes' `check` / `impl_cls` / `fn`, never at module import, and
report a missing library as a reason from `check`, never as an import error. Hooks take
no arguments today; pluggy lets later versions add opt-in arguments without breaking
existing plugins. The classes they return implement the ABCs in `core/contracts.py`.
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
        GraphRunner,
        LogitsProcessorFactory,
        OpImpl,
        QuantConfig,
        ReasoningParser,
        SpecProposer,
        ToolParser,
    )

PROJECT = "pagedllm"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def pagedllm_attention_backends() -> dict[str, type[AttentionBackend]]:
    """Attention backends this plugin provides, by name (e.g. {"TRITON": TritonBackend}).

    Returns: {NAME: AttentionBackend subclass}; names are upper case, as users type them
    in `--attention-backend` / `PAGEDLLM_ATTENTION_BACKEND`.

    Used: a requested backend must pass its `check(spec)`, else start-up fails with the
    reasons; without a request, the runnable backend with the highest `priority` for the
    device is chosen (a backend with no priority for the device only when no other
    can run).
    """


@hookspec
def pagedllm_quant_methods() -> dict[str, type[QuantConfig]]:
    """Quantization formats by the name used in `quantization_config.quant_method` and
    `--quantization` (e.g. {"fp8": Fp8Config}).

    Returns: {lower-case name: QuantConfig subclass} (its `aliases` select it too). Used
    when a checkpoint's config or the flag names the format: `from_config(
    quantization_config, plugin_options)` builds it, then its `check(device, dtype)` must
    find no reason, else start-up fails with the reasons. A flag naming a format the
    checkpoint is not saved in is refused unless the class `quantizes_dense` (and the
    checkpoint is a float one).
    """


@hookspec
def pagedllm_spec_methods() -> dict[str, type[SpecProposer]]:
    """Speculative-decoding proposers by method name (e.g. {"ngram": NgramProposer}).

    Returns: {method name as in `--speculative-config '{"method": ...}'`: SpecProposer
    subclass}. A proposer only proposes; the core verifies every proposal against the
    target model, so output is unchanged whatever a proposer returns.
    """


@hookspec
def pagedllm_model_architectures() -> dict[str, type[CausalLM]]:
    """Model classes keyed by Hugging Face architecture name ("LlamaForCausalLM").

    Returns: {architecture name from config.json "architectures": CausalLM subclass}.
    The first name in a checkpoint's "architectures" list that some plugin registers is
    used. To stay cheap, a plugin may import its model modules only when the mapping is
    built (the built-in models do; see plugins/models/__init__.py).
    """


@hookspec
def pagedllm_checkpoint_formats() -> dict[str, type[CheckpointFormat]]:
    """Checkpoint formats by `--load-format` name (e.g. {"gguf": GGUFFormat}).

    Returns: {load-format name: CheckpointFormat subclass}. With `--load-format auto`
    each format's `detect(path)` is asked in turn and the first that claims the path
    reads it; a Hugging Face directory (the core's own format) is read when none does.
    """


@hookspec
def pagedllm_op_impls() -> list[OpImpl]:
    """Implementations of the layer ops in `pagedllm.ops` (rms_norm, rotary_qkv,
    silu_and_mul, gather_rows, pack_linear): how a CUDA RMSNorm or a fused kernel joins
    without editing the layers.

    Returns: a list of `OpImpl(op, name, fn, check, priority)`. For each (device type,
    dtype) an op meets, it uses the runnable implementation (empty `check`) with the
    highest priority, chosen on first use and logged; the op's torch reference
    (priority 0) runs where none can. An `op` that `pagedllm.ops` does not define, or
    one (op, name) pair offered twice, is an error naming it.
    """


@hookspec
def pagedllm_graph_runners() -> dict[str, type[GraphRunner]]:
    """Graph runners (capture a step's forward once per batch shape, replay it after)
    by name (e.g. {"cpu_replay": CpuStepReplayer}).

    Returns: {name: GraphRunner subclass}. After the model loads (unless
    --enforce-eager), the worker builds the runnable one (empty `check(device,
    backend)`) with the highest `priority` for the device; with none, steps run eagerly.
    """


@hookspec
def pagedllm_logits_processors() -> dict[str, type[LogitsProcessorFactory]]:
    """Per-request logits processors by name (e.g. {"structured_outputs": ...}).

    Returns: {name: LogitsProcessorFactory subclass}. Every factory is built once per
    engine (with a `LogitsProcessorContext`) and asked, for each request, to `validate`
    its SamplingParams and `create` a processor (or None: most requests need none).
    See `core/contracts/logits.py` for when each method is called. A factory reads its
    own request fields (`structured_outputs`, or its keys in `extra_args`).
    """


@hookspec
def pagedllm_tool_parsers() -> dict[str, type[ToolParser]]:
    """Tool-call parsers by `--tool-call-parser` name (e.g. {"hermes": HermesToolParser}).

    Returns: {name: ToolParser subclass}. Text only (see `core/contracts/tools.py`): a
    parser never imports the server. `--tool-parser-plugin FILE` loads a Python file
    that registers more the same way (vLLM's flag).
    """


@hookspec
def pagedllm_reasoning_parsers() -> dict[str, type[ReasoningParser]]:
    """Reasoning parsers by `--reasoning-parser` name (e.g. {"qwen3": Qwen3ReasoningParser}).

    Returns: {name: ReasoningParser subclass}. Text only (see `core/contracts/reasoning.py`):
    a parser never imports the server. The server builds one per choice it answers; its
    `end_tag` tells structured outputs where the constrained content begins.
    """


@hookspec
def pagedllm_add_cli_args(parser: argparse._ArgumentGroup) -> None:
    """Add plugin-specific flags to `pagedllm serve` (and the other commands that build
    an engine).

    Called each time such a command builds its parser, with the "plugin options"
    argument group (call `parser.add_argument`). Values reach the plugin through
    `EngineConfig.plugin_options`, keyed by each flag's dest (also
    `LLM(..., plugin_options={...})`), and from there `ModelContext.extra`, the quant
    config and `CheckpointFormat.options`. A flag name another plugin or the core
    already defines is an argparse error at start-up: prefix yours with the plugin name.
    """
