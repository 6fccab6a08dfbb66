"""Engine arguments on the command line: flags in, `LLM(**kwargs)` / `EngineConfig` out.

Every command that builds an engine (`pagedllm serve`, `pagedllm chat`, the `pagedllm
bench` subcommands) takes the same engine flags and must read them back the same
way, so both directions live here once. The flags are generated from the fields of
the config dataclasses in `pagedllm.core.config` (`--max-model-len` for
`ModelConfig.max_model_len`; help text, group and choices from the field metadata
that `opt(...)` records), so a new config field is a new flag everywhere with no
edit here. Plugins add their own flags through the `pagedllm_add_cli_args` hook;
their values travel in `plugin_options`. Defaults stay with the dataclasses: only
flags given on the command line are passed on. vLLM's flags that pagedllm does not take
(`pagedllm.core.vllm_args`) are known flags too, refused or warned about with the
reason, and `engine_config_from_args` reports every problem it can find before loading
(config, plugin values, environment values) in one error, spelled as flags.

The core never imports this module: it depends on argparse conventions, the core
does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from typing import Any, Callable, Sequence

from pagedllm.core import envs
from pagedllm.core.config import CONCERNS, ConfigError, EngineConfig
from pagedllm.core.vllm_args import VLLM_ONLY_ARGS

GROUP_TITLES = {
    "model": "model",
    "cache": "KV cache",
    "scheduler": "scheduler",
    "parallel": "parallelism",
    "device": "device and kernels",
    "spec": "speculative decoding",
    "structured": "structured outputs",
    "server": "server",
}
FLAG_ALIASES = {"tensor_parallel_size": ["-tp"], "pipeline_parallel_size": ["-pp"], "data_parallel_size": ["-dp"],
                "enable_expert_parallel": ["-ep"], "quantization": ["-q"], "api_server_count": ["-asc"],
                "kv_cache_memory": ["--kv-cache-memory-bytes"]}
# Where `add_engine_args` records the dests of the plugins' flags in the namespace.
PLUGIN_DESTS = "_pagedllm_plugin_dests"
SIZE_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
# Every engine argument by its vLLM name (the fields of all the concerns), and the vLLM
# engine arguments pagedllm does not take, which EngineConfig.build judges.
ENGINE_FIELDS = frozenset(f.name for cls in CONCERNS.values() for f in dataclasses.fields(cls))
VLLM_ENGINE_ONLY = frozenset(n for n, a in VLLM_ONLY_ARGS.items() if a.scope == "engine")
VLLM_FLAGS_EPILOG = ("vLLM's other flags are known too: each one pagedllm does not support yet is refused with the "
                     "reason and the next step, and one that would change nothing here is accepted with a warning "
                     "that says why (README: Coming from vLLM).")


def parse_bytes(text: str) -> int:
    """A byte count: `4294967296`, `4G`, `4GiB`, `512M` (binary units)."""
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = SIZE_SUFFIXES.get(value[-1:], 1) if value else 1
    number = value[:-1] if scale != 1 else value
    try:
        return int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use bytes or e.g. 4G, 512MiB)") from None


def parse_json_object(text: str) -> dict[str, Any]:
    """A JSON object given as a flag's value (`--speculative-config '{...}'`, `--hf-overrides`)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ('{{\"key\": value, ...}}'), got "
                                         f"{type(value).__name__} {text!r}")
    return value


def parse_token_count(text: str) -> int:
    """A token count as vLLM reads one: `32768`, `32k` (x 1000), `32K` (x 1024), `1m`, `1M`."""
    scale = {"k": 1000, "m": 1000 ** 2, "K": 1 << 10, "M": 1 << 20}.get(text.strip()[-1:], 1)
    number = text.strip()[:-1] if scale != 1 else text.strip()
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (use e.g. 32768, 32k or 32K)") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number of tokens: {text!r}")
    return int(value)


FIELD_PARSERS: dict[str, Callable[[str], Any]] = {"kv_cache_memory": parse_bytes, "max_model_len": parse_token_count}
TYPE_PARSERS: dict[type, Callable[[str], Any]] = {str: str, int: int, float: float, dict: parse_json_object}


def _base_type(annotation: Any) -> type:
    """`int | None` -> int."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0]
    return typing.get_origin(annotation) or annotation


def _default_text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, skip: Sequence[str] = ()) -> None:
    """One flag per field of `cls`, in an argument group named by the field's metadata.

    Every default is argparse.SUPPRESS, so the namespace holds only what was given and
    the dataclass stays the one place where defaults live (shown in --help).
    """
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        key = f.metadata.get("group", "other")
        if key not in groups:
            groups[key] = parser.add_argument_group(GROUP_TITLES.get(key, key))
        help_text = f.metadata["help"].replace("%", "%%")
        if "default" not in help_text and f.default is not None and f.name != "api_key":
            help_text += f" (default: {_default_text(f.default)})"
        flags = [f"--{f.name.replace('_', '-')}", *FLAG_ALIASES.get(f.name, [])]
        base = _base_type(hints[f.name])
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = FIELD_PARSERS.get(f.name) or TYPE_PARSERS.get(base, str)
            kwargs["metavar"] = f.name.upper() if base is not dict else "JSON"
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
                kwargs["metavar"] = "{" + ",".join(map(str, f.metadata["choices"])) + "}"
        groups[key].add_argument(*flags, **kwargs)


def add_plugin_args(parser: argparse.ArgumentParser) -> None:
    """The installed plugins' flags (`pagedllm_add_cli_args`), in their own group.

    Their dests are recorded in the namespace so `engine_kwargs_from_args` can hand
    exactly those values on as `plugin_options`."""
    from pagedllm.core.plugins import get_registry  # loads the plugins: only when a parser is built

    before = {a.dest for a in parser._actions}
    group = parser.add_argument_group("plugin options (added by installed plugins)")
    try:
        get_registry().pm.hook.pagedllm_add_cli_args(parser=group)
    except argparse.ArgumentError as exc:
        raise SystemExit(f"pagedllm: error: a plugin added a conflicting flag: {exc}") from None
    parser.set_defaults(**{PLUGIN_DESTS: sorted({a.dest for a in parser._actions} - before)})


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """MODEL (positional, optional), every engine flag, and the plugins' flags.

    For any command that builds an engine (serve, chat, bench); read the result back
    with `engine_kwargs_from_args` / `engine_config_from_args`.
    """
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="Model: a Hugging Face directory or a .gguf file (default: the bundled "
                             "SmolLM2-135M-Instruct GGUF). Same as --model.")
    for cls in CONCERNS.values():
        add_dataclass_args(parser, cls)
    add_plugin_args(parser)
    add_vllm_only_args(parser, "engine")


def add_vllm_only_args(parser: argparse.ArgumentParser, scope: str) -> None:
    """vLLM's flags of `scope` ("engine" or "server") that pagedllm does not take, as
    hidden flags whose values `EngineConfig.build` (engine) or `serve` (server) judges:
    a vLLM user's command is refused with the reason, never with "unrecognized
    arguments". A flag the parser already has (a plugin's, or one that landed) wins."""
    taken = set(parser._option_string_actions)
    for name, arg in VLLM_ONLY_ARGS.items():
        flags = [f"--{name.replace('_', '-')}", *arg.aliases]
        if arg.scope != scope or taken & set(flags) or (arg.kind is bool and f"--no-{flags[0][2:]}" in taken):
            continue
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
        if arg.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif arg.kind is list:
            kwargs["nargs"] = "+"
        parser.add_argument(*flags, **kwargs)
    parser.epilog = parser.epilog or VLLM_FLAGS_EPILOG


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The vLLM-style flat keyword arguments (`LLM(**kwargs)`) that `args` carries.

    From a parser built by `add_engine_args`: the engine flags given (and only those),
    MODEL or --model as `model` (both, differing, is a ValueError), and the plugins'
    flag values as `plugin_options`. A namespace built by hand works as well: its
    engine fields (vLLM names) that are not None, and its own `plugin_options` dict.
    """
    kwargs = {name: value for name, value in vars(args).items()
              if (name in ENGINE_FIELDS or name in VLLM_ENGINE_ONLY) and value is not None}
    model_tag = getattr(args, "model_tag", None)
    if model_tag is not None:
        if kwargs.get("model") not in (None, model_tag):
            raise ValueError(f"the model is given twice: {model_tag!r} and --model {kwargs['model']!r}")
        kwargs["model"] = model_tag
    if hasattr(args, PLUGIN_DESTS):
        kwargs["plugin_options"] = {d: getattr(args, d) for d in getattr(args, PLUGIN_DESTS) if hasattr(args, d)}
    else:
        kwargs["plugin_options"] = dict(getattr(args, "plugin_options", None) or {})
    return kwargs


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The validated EngineConfig, or a ConfigError (spelled as flags) listing every
    problem found before loading: the config's, the vLLM flags refused, the values checked
    against the installed plugins (speculative method and keys, quantization, attention
    backend, load format) and the environment's values. A typo fails before a model loads,
    and one attempt shows them all."""
    try:
        kwargs = engine_kwargs_from_args(args)
    except ValueError as exc:
        raise ConfigError(str(exc), "cli") from None
    return preflight(kwargs, "cli")


def preflight(kwargs: dict[str, Any], spelling: str = "python") -> EngineConfig:
    """`EngineConfig.build(kwargs)` plus every check that needs no model: the installed
    plugins' names and the environment's values; raises one ConfigError with all problems."""
    problems: list[str] = []
    error: type[ConfigError] = ConfigError
    config = None
    try:
        config = EngineConfig.build(kwargs, spelling)
    except ConfigError as exc:  # an UnknownArgumentError stays one (a TypeError too)
        problems, error = exc.problems, type(exc)
    problems += plugin_value_problems(kwargs) + envs.check_values()
    if problems or config is None:
        raise error(problems, spelling)
    return config


CORE_LOAD_FORMATS = ("auto", "safetensors", "hf", "pt")


def plugin_value_problems(kwargs: dict[str, Any]) -> list[str]:
    """Values checked against the installed plugins, each problem naming where the value came
    from (a flag, or the environment variable)."""
    from pagedllm.core.plugins import ATTENTION_ALIASES, get_registry
    from pagedllm.core.spec_decode import resolve_spec_config

    registry = get_registry()
    problems = []
    spec = kwargs.get("speculative_config")
    if isinstance(spec, dict) and spec:
        try:
            resolve_spec_config(spec, registry)
        except ValueError as exc:
            problems.append(str(exc))
    if kwargs.get("quantization"):
        problems += _quantization_problems(str(kwargs["quantization"]), kwargs.get("model"), registry)
    load_format = kwargs.get("load_format")
    formats = [*CORE_LOAD_FORMATS, *sorted(registry.checkpoint_formats)]
    if load_format and load_format not in formats:
        problems.append(f"{{load_format={load_format}}}: unknown load format; available here: {', '.join(formats)}")
    backends = sorted(registry.attention_backends)
    known = set(backends) | set(ATTENTION_ALIASES)
    hint = f"one of {', '.join(backends)} (vLLM's {', '.join(sorted(ATTENTION_ALIASES))} are accepted too)"
    flag = kwargs.get("attention_backend")
    if flag and flag.upper() not in known:
        problems.append(f"{{attention_backend={flag}}}: unknown attention backend; give {hint}, or leave it out "
                        "to get the fastest that can run here")
    value, var = envs.get("PAGEDLLM_ATTENTION_BACKEND"), envs.source("PAGEDLLM_ATTENTION_BACKEND")
    if not flag and value and value.upper() not in known:
        problems.append(f"{var}={value}: unknown attention backend; unset {var} (the fastest that can run here is "
                        f"then chosen) or set it to {hint}")
    return problems


def _quantization_problems(name: str, model: str | None, registry: Any) -> list[str]:
    """An unknown quantization name, or one given for a file that carries its own (GGUF)."""
    try:
        registry.quant_class(name)
    except ValueError as exc:
        return [f"{{quantization={name}}}: {exc}"]
    from pagedllm.core.config import default_model

    try:
        path = model or default_model()
    except ValueError:
        return []
    for fmt_name, fmt in registry.checkpoint_formats.items():
        if os.path.isfile(path) and fmt.detect(path) and fmt_name.lower() != name.lower().replace("_", "-"):
            return [(f"{{quantization={name}}}: the model {os.path.basename(path)} is a {fmt_name} file, quantized "
                    f"already: drop {{quantization}} (quantize while loading with {name} from a float checkpoint, "
                    "a Hugging Face directory)")]
    return []


def engine_flags(kwargs: dict[str, Any]) -> list[str]:
    """Engine keyword arguments back into flags (for a `pagedllm serve` subprocess).

    The inverse of `engine_kwargs_from_args`: `--name value`, `--flag` / `--no-flag` for
    booleans, JSON for dicts; None is left out. Plugin options become `--dest value`
    (a plugin flag set to False or None is left out)."""
    out: list[str] = []
    for key, value in kwargs.get("plugin_options", {}).items():
        if value not in (None, False):
            out += ["--" + key.replace("_", "-")] + ([] if value is True else [str(value)])
    for key, value in kwargs.items():
        if value is None or key == "plugin_options":
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out
