"""The plugin manager: loads every `pagedllm.plugins` entry point and answers lookups.

Built-ins and third-party packages load through the same entry-point path;
`PAGEDLLM_PLUGINS` (alias `VLLM_PLUGINS`) limits which entry points load. Every failed
lookup names what exists here, and a failed capability check names the reasons.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import threading
from typing import Any

import pluggy
import torch

from pagedllm.core import envs, hookspecs
from pagedllm.core.contracts import (
    AttentionBackend,
    AttentionSpec,
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

logger = logging.getLogger("pagedllm")
ENTRY_POINT_GROUP = "pagedllm.plugins"

# vLLM spellings accepted as aliases of our backend names.
ATTENTION_ALIASES = {"TRITON_ATTN": "TRITON", "TORCH_SDPA": "TORCH", "FLASH_ATTN_VLLM_V1": "FLASH_ATTN"}


class PluginRegistry:
    """The merged name → class tables of every loaded plugin."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self.attention_backends: dict[str, type[AttentionBackend]] = self._merge(
            pm.hook.pagedllm_attention_backends(), "attention backend")
        self.quant_methods: dict[str, type[QuantConfig]] = self._merge(
            pm.hook.pagedllm_quant_methods(), "quantization method")
        self.spec_methods: dict[str, type[SpecProposer]] = self._merge(
            pm.hook.pagedllm_spec_methods(), "speculative method")
        self.model_architectures: dict[str, type[CausalLM]] = self._merge(
            pm.hook.pagedllm_model_architectures(), "model architecture")
        self.checkpoint_formats: dict[str, type[CheckpointFormat]] = self._merge(
            pm.hook.pagedllm_checkpoint_formats(), "checkpoint format")
        self.graph_runners: dict[str, type[GraphRunner]] = self._merge(
            pm.hook.pagedllm_graph_runners(), "graph runner")
        self.logits_processors: dict[str, type[LogitsProcessorFactory]] = self._merge(
            pm.hook.pagedllm_logits_processors(), "logits processor")
        self.tool_parsers: dict[str, type[ToolParser]] = self._merge(
            pm.hook.pagedllm_tool_parsers(), "tool parser")
        self.reasoning_parsers: dict[str, type[ReasoningParser]] = self._merge(
            pm.hook.pagedllm_reasoning_parsers(), "reasoning parser")
        self.op_impls: dict[str, list[OpImpl]] = self._merge_op_impls(pm.hook.pagedllm_op_impls())

    @staticmethod
    def _merge(results: list[dict[str, Any]], kind: str) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for table in results:
            for name, cls in (table or {}).items():
                if name in merged and merged[name] is not cls:
                    raise ValueError(f"two plugins define the {kind} {name!r}: {merged[name]} and {cls}")
                merged[name] = cls
        return merged

    @staticmethod
    def _merge_op_impls(results: list[list[OpImpl]]) -> dict[str, list[OpImpl]]:
        """{op name: its implementations, highest priority first}."""
        by_op: dict[str, list[OpImpl]] = {}
        for impls in results:
            for impl in impls or []:
                if any(other.name == impl.name for other in by_op.get(impl.op, [])):
                    raise ValueError(f"two plugins define the implementation {impl.name!r} of op {impl.op!r}")
                by_op.setdefault(impl.op, []).append(impl)
        for impls in by_op.values():
            impls.sort(key=lambda i: -i.priority)
        return by_op

    def start_preparing_ops(self, device: torch.device) -> threading.Thread | None:
        """Run every op implementation's `prepare` for `device` on a background thread, so
        slow one-time set-up (the CPU plugin's kernel build, ~5 s on 2 cores) overlaps the
        engine's reading of the model's config and tokenizer. A failure is logged and left
        to the implementation's `check`. The thread is not a daemon: a process that fails
        early waits for the set-up rather than leaving a half-built cache behind."""
        prepares = list(dict.fromkeys(impl.prepare for impls in self.op_impls.values() for impl in impls
                                      if impl.prepare is not None))
        if not prepares:
            return None

        def run() -> None:
            for prepare in prepares:
                try:
                    prepare(device)
                except Exception as exc:  # noqa: BLE001 - the implementation's check reports it
                    logger.debug("op set-up %r for %s failed: %s", prepare, device, exc)

        thread = threading.Thread(target=run, name="pagedllm-prepare-ops")
        thread.start()
        return thread

    # ------------------------------------------------------------------ lookups

    def op_impl(self, op: str, device: torch.device, dtype: torch.dtype) -> OpImpl | None:
        """The runnable implementation of `op` with the highest priority for tensors of
        `device` and `dtype`; None where no plugin offers one (callers use the op's torch
        reference then). The layer ops of `pagedllm.ops` choose through this, and so does
        the core's sampler, which may not import `pagedllm.ops`."""
        for impl in self.op_impls.get(op, []):
            if not impl.check(device, dtype):
                return impl
        return None

    def model_class(self, architectures: list[str]) -> type[CausalLM]:
        for arch in architectures:
            if arch in self.model_architectures:
                return self.model_architectures[arch]
        raise ValueError(
            f"model architecture {architectures} is not supported. Supported here: "
            f"{', '.join(sorted(self.model_architectures))}. A plugin adds one by returning "
            "{'<HF architecture name>': YourCausalLM} from the pagedllm_model_architectures hook "
            f"and exposing it through the {ENTRY_POINT_GROUP!r} entry-point group."
        )

    def quant_class(self, name: str) -> type[QuantConfig]:
        """The quantizer named `name` (its `name` or one of its vLLM `aliases`,
        case-insensitive); an unknown name lists the installed ones."""
        key = name.lower().replace("_", "-")
        for cls_name, cls in self.quant_methods.items():
            names = {cls_name, *cls.aliases}
            if key in {n.lower().replace("_", "-") for n in names}:
                return cls
        installed = [f"{n} (also {', '.join(c.aliases)})" if c.aliases else n
                     for n, c in sorted(self.quant_methods.items())]
        raise ValueError(
            f"unknown quantization {name!r}; available here: {', '.join(installed) or '(none)'}. A quantized "
            "checkpoint names its own method (its config.json's quantization_config: leave --quantization out); "
            "a GGUF file carries its quantization (serve the .gguf file); fp8 quantizes a float checkpoint "
            "while loading; another method comes from a plugin returning {'<name>': YourQuantConfig} from "
            f"the pagedllm_quant_methods hook through the {ENTRY_POINT_GROUP!r} entry-point group"
        )

    def quant_config(self, name: str, config: dict[str, Any], options: dict[str, Any] | None = None) -> QuantConfig:
        """Build the quantizer `name` from a checkpoint's quantization_config and the
        engine's plugin options (kept apart: see `QuantConfig.from_config`)."""
        return self.quant_class(name).from_config(dict(config), dict(options or {}))

    def spec_method(self, name: str) -> type[SpecProposer]:
        if name not in self.spec_methods:
            raise ValueError(
                f"unknown speculative method {name!r}; available here: "
                f"{', '.join(sorted(self.spec_methods)) or '(none)'}"
            )
        return self.spec_methods[name]

    def checkpoint_format(self, load_format: str, path: str,
                          options: dict[str, Any] | None = None) -> CheckpointFormat | None:
        """The format plugin for `path` (built with the engine's plugin options), or None
        when the core's HF-directory loader applies."""
        if load_format in ("auto", "safetensors", "hf", "pt"):
            if load_format == "auto":
                for fmt in self.checkpoint_formats.values():
                    if fmt.detect(path):
                        return fmt(path, options)
            return None
        if load_format not in self.checkpoint_formats:
            raise ValueError(
                f"unknown load format {load_format!r}; available here: auto, safetensors, "
                + ", ".join(sorted(self.checkpoint_formats))
            )
        return self.checkpoint_formats[load_format](path, options)

    def attention_backend(self, requested: str | None, spec: AttentionSpec) -> type[AttentionBackend]:
        """The backend to use: the requested one (which must be able to run), else the
        runnable backend with the highest priority for this device."""
        reasons = {name: self.backend_reasons(cls, spec) for name, cls in self.attention_backends.items()}
        runnable = sorted(name for name, r in reasons.items() if not r)
        if requested:
            name = ATTENTION_ALIASES.get(requested.upper(), requested.upper())
            var = envs.source("PAGEDLLM_ATTENTION_BACKEND")
            origin = f" ({var}={envs.get('PAGEDLLM_ATTENTION_BACKEND')})" if var and envs.get(
                "PAGEDLLM_ATTENTION_BACKEND", "").upper() == requested.upper() else ""
            remedy = f"; unset {var} or set it to one that can" if origin else ""
            if name not in self.attention_backends:
                raise ValueError(
                    f"unknown attention backend {requested!r}{origin}; known here: "
                    f"{', '.join(sorted(self.attention_backends))} (runnable: {', '.join(runnable) or 'none'})"
                    f"{remedy}"
                )
            if reasons[name]:
                raise ValueError(
                    f"attention backend {name}{origin} cannot run here: {'; '.join(reasons[name])}. "
                    f"Backends that can: {', '.join(runnable) or 'none'}{remedy}"
                )
            return self.attention_backends[name]
        if not runnable:
            details = "; ".join(f"{n}: {', '.join(r)}" for n, r in reasons.items())
            raise ValueError(f"no attention backend can run here ({details})")
        device = spec.device.type
        best = max(runnable, key=lambda n: self.attention_backends[n].priority.get(device, -1))
        return self.attention_backends[best]

    def backend_reasons(self, cls: type[AttentionBackend], spec: AttentionSpec) -> list[str]:
        """Why backend `cls` cannot run `spec` here (none when it can): the attention kind or
        chunked local layers it does not serve (naming the backends that do), else its own
        `check`."""
        return self._kind_reasons(cls, spec) or cls.check(spec)

    def _kind_reasons(self, cls: type[AttentionBackend], spec: AttentionSpec) -> list[str]:
        reasons = []
        if spec.kind not in cls.kinds:
            serving = sorted(n for n, c in self.attention_backends.items() if spec.kind in c.kinds)
            reasons.append(f"it does not serve {spec.kind.upper()} attention "
                           f"(backends that do: {', '.join(serving) or 'none'})")
        if spec.chunked and not cls.supports_attention_chunks:
            serving = sorted(n for n, c in self.attention_backends.items() if c.supports_attention_chunks)
            reasons.append("it does not support chunked local attention (attention_chunk_size) "
                           f"(backends that do: {', '.join(serving) or 'none'})")
        return reasons

    def graph_runner(self, device: torch.device, backend: type[AttentionBackend]) -> type[GraphRunner] | None:
        """The runnable graph runner with the highest priority for `device`, or None."""
        runnable = [cls for cls in self.graph_runners.values() if not cls.check(device, backend)]
        if not runnable:
            return None
        return max(runnable, key=lambda cls: cls.priority.get(device.type, -1))


def _allowed_names() -> set[str] | None:
    value = envs.get("PAGEDLLM_PLUGINS")
    if value is None or not value.strip():
        return None
    return {n.strip() for n in value.split(",") if n.strip()}


def build_plugin_manager() -> pluggy.PluginManager:
    """A fresh manager with every allowed entry point loaded (a broken one is logged, not fatal)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    allowed = _allowed_names()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if allowed is not None and ep.name not in allowed:
            continue
        if pm.has_plugin(ep.name):
            continue
        try:
            plugin = ep.load()
        except Exception:
            logger.exception("failed to load pagedllm plugin %r (%s)", ep.name, ep.value)
            continue
        pm.register(plugin, name=ep.name)
    if allowed is not None:
        missing = allowed - {name for name, _ in pm.list_name_plugin()}
        if missing:
            logger.warning("PAGEDLLM_PLUGINS names plugins that are not installed: %s", sorted(missing))
    pm.check_pending()
    return pm


@functools.lru_cache(maxsize=4)
def _registry_for(allowed_key: str | None) -> PluginRegistry:
    return PluginRegistry(build_plugin_manager())


def get_registry() -> PluginRegistry:
    """The registry for the current PAGEDLLM_PLUGINS setting (cached per setting)."""
    return _registry_for(envs.get("PAGEDLLM_PLUGINS"))

