"""`pagedllm serve | chat | bench`: the command line, with vLLM's flag names.

Engine flags are generated from the fields of the config dataclasses (`--max-model-len`
for `ModelConfig.max_model_len`, help text and choices from the field metadata), and
server flags from `ServerSettings` the same way, so a new config field is a new flag
with no edit here. Plugins add flags through the `pagedllm_add_cli_args` hook; their
values reach them in `EngineConfig.plugin_options`. Flag defaults are left to the
dataclasses: only flags given on the command line are passed on. A configuration
error exits with status 2 and one line saying what to change, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import types
import typing
from typing import Any, Callable, NoReturn, Sequence

from pagedllm.core.config import CONCERNS, EngineConfig
from pagedllm.core.logs import setup_logging

logger = logging.getLogger("pagedllm")

GROUP_TITLES = {
    "model": "model",
    "cache": "KV cache",
    "scheduler": "scheduler",
    "parallel": "parallelism (not supported yet: sizes other than 1 are refused)",
    "device": "device and kernels",
    "spec": "speculative decoding (not supported yet)",
    "server": "server",
}
FLAG_ALIASES = {"tensor_parallel_size": ["-tp"], "pipeline_parallel_size": ["-pp"], "quantization": ["-q"]}
PLUGIN_DESTS = "_pagedllm_plugin_dests"
SIZE_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


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
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"method\": \"ngram\"}'")
    return value


FIELD_PARSERS: dict[str, Callable[[str], Any]] = {"kv_cache_memory": parse_bytes}
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


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """MODEL (positional, optional), every engine flag, and the plugins' flags.

    For any subcommand that builds an engine (serve, chat, bench); read the result back
    with `engine_kwargs_from_args` / `engine_config_from_args`.
    """
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="Model: a Hugging Face directory or a .gguf file (default: the bundled "
                             "SmolLM2-135M-Instruct GGUF). Same as --model.")
    for cls in CONCERNS.values():
        add_dataclass_args(parser, cls)
    from pagedllm.core.plugins import get_registry

    before = {a.dest for a in parser._actions}
    group = parser.add_argument_group("plugin options (added by installed plugins)")
    try:
        get_registry().pm.hook.pagedllm_add_cli_args(parser=group)
    except argparse.ArgumentError as exc:
        raise SystemExit(f"pagedllm: error: a plugin added a conflicting flag: {exc}") from None
    parser.set_defaults(**{PLUGIN_DESTS: sorted({a.dest for a in parser._actions} - before)})


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The vLLM-style flat keyword arguments (`LLM(**kwargs)`) the command line gave."""
    engine_fields = {f.name for cls in CONCERNS.values() for f in dataclasses.fields(cls)}
    kwargs = {name: value for name, value in vars(args).items() if name in engine_fields}
    if args.model_tag is not None:
        if kwargs.get("model") not in (None, args.model_tag):
            raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {kwargs['model']!r}")
        kwargs["model"] = args.model_tag
    kwargs["plugin_options"] = {d: getattr(args, d) for d in getattr(args, PLUGIN_DESTS, [])
                                if hasattr(args, d)}
    return kwargs


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The validated EngineConfig; raises ValueError / NotImplementedError naming the field."""
    return EngineConfig.from_kwargs(**engine_kwargs_from_args(args))


def _fail(parser: argparse.ArgumentParser, exc: BaseException | str) -> NoReturn:
    """A configuration problem: one line, exit status 2 (argparse's usage-error status), no
    traceback and no usage dump — the message already names the flag to change."""
    parser.exit(2, f"{parser.prog}: error: {exc}\n")


def log_config(config: EngineConfig, extra: dict[str, Any] | None = None) -> None:
    """Log the resolved configuration, defaults included: what this run really uses."""
    for key in ("model", "cache", "scheduler", "parallel", "device", "spec"):
        values = dataclasses.asdict(getattr(config, key))
        logger.info("config %-10s %s", key + ":", ", ".join(f"{k}={v}" for k, v in values.items()))
    if config.plugin_options:
        logger.info("config %-10s %s", "plugins:", config.plugin_options)
    if extra:
        logger.info("config %-10s %s", "server:", ", ".join(f"{k}={v}" for k, v in extra.items()))


# ---------------------------------------------------------------------- serve


def add_serve_parser(subparsers: Any) -> None:
    from pagedllm.server.app import ServerSettings

    parser = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API",
        description="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, ...).")
    add_engine_args(parser)
    add_dataclass_args(parser, ServerSettings)
    parser.set_defaults(handler=serve, subparser=parser)


# The server's default step budget, as vLLM's OpenAI server has it: when many requests
# arrive together, a smaller budget finishes the first prompts' prefills sooner, at the
# same throughput (measured: 64 concurrent SmolLM2 requests on 2 CPUs, TTFT p50 17.1 s
# with 8192 tokens per step, 11.5 s with 2048; output tok/s 153 and 156).
SERVE_MAX_NUM_BATCHED_TOKENS = 2048


def apply_serve_defaults(args: argparse.Namespace) -> None:
    """Server-only defaults for flags the user left unset."""
    if getattr(args, "max_num_batched_tokens", None) is None:
        args.max_num_batched_tokens = SERVE_MAX_NUM_BATCHED_TOKENS


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from pagedllm.core.engine import AsyncLLMEngine
    from pagedllm.server.app import ServerSettings, build_app, load_chat_template, run_server
    from pagedllm.server.auth import resolve_api_key

    setup_logging()
    server_fields = {f.name for f in dataclasses.fields(ServerSettings)}
    settings = ServerSettings(**{k: v for k, v in vars(args).items() if k in server_fields})
    if settings.enable_reasoning:
        logger.warning("--enable-reasoning is deprecated (vLLM's old spelling): --reasoning-parser NAME "
                       "alone enables reasoning; drop --enable-reasoning")
        if not settings.reasoning_parser:
            _fail(parser, ValueError("--enable-reasoning needs --reasoning-parser (e.g. deepseek_r1)"))
    apply_serve_defaults(args)
    try:
        config = engine_config_from_args(args)
        load_chat_template(settings.chat_template)
    except (ValueError, NotImplementedError) as exc:
        _fail(parser, exc)
    shown = {k: v for k, v in dataclasses.asdict(settings).items() if k != "api_key"}
    log_config(config, shown)
    api_key = resolve_api_key(settings.api_key)
    try:
        engine = AsyncLLMEngine.from_config(config)
    except (ValueError, NotImplementedError) as exc:
        print(f"pagedllm serve: error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    try:
        run_server(build_app(engine, settings, api_key=api_key), settings)
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------- chat / bench


def add_chat_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("chat", help="chat with a model in the terminal",
                                   description="An interactive chat in the terminal (no server).")
    add_engine_args(parser)
    group = parser.add_argument_group("chat")
    group.add_argument("--system", default=None, help="System prompt (default: none).")
    group.add_argument("--max-tokens", type=int, default=512, help="Most tokens per reply (default: 512).")
    group.add_argument("--temperature", type=float, default=0.7, help="Sampling temperature (default: 0.7).")
    group.add_argument("--top-p", type=float, default=None, help="Nucleus sampling mass (default: 1.0).")
    parser.set_defaults(handler=chat, subparser=parser)


def chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Hand over to `pagedllm.chat_cli.run_chat(args)` once the engine flags are validated.

    `args` then carries `model` (positional or --model), `plugin_options`, every given
    engine flag by its vLLM name, and also `engine_kwargs` (for `LLM(**kwargs)`) and
    `engine_config`; returns run_chat's exit status."""
    try:
        args.engine_kwargs = engine_kwargs_from_args(args)
        args.engine_config = EngineConfig.from_kwargs(**args.engine_kwargs)
    except (ValueError, NotImplementedError) as exc:
        _fail(parser, exc)
    args.model = args.engine_kwargs.get("model")
    args.plugin_options = args.engine_kwargs["plugin_options"]
    run_chat = _optional_import("pagedllm.chat_cli", "run_chat", parser, "chat")
    setup_logging()
    return run_chat(args)


def _optional_import(module: str, name: str, parser: argparse.ArgumentParser, command: str) -> Any:
    """A function from a module that may not be installed yet; a clear error if it is not."""
    import importlib

    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        _fail(parser, f"'pagedllm {command}' is not available in this installation ({module} is missing)")
    if not hasattr(loaded, name):
        _fail(parser, f"'pagedllm {command}' is not available in this installation ({module}.{name} is missing)")
    return getattr(loaded, name)


def _add_bench_parser(parser: argparse.ArgumentParser, subparsers: Any, wanted: bool) -> None:
    """Let `pagedllm.bench` add its parser, importing it only when `bench` is the command."""
    if wanted:
        _optional_import("pagedllm.bench", "add_parser", parser, "bench")(subparsers)
        return
    subparsers.add_parser("bench", help="benchmark throughput and latency (see 'pagedllm bench --help')",
                          add_help=False)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The `pagedllm` parser; `argv` decides whether the bench module must be imported."""
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: a small vLLM-compatible engine.")
    subparsers = parser.add_subparsers(dest="command", metavar="{serve,chat,bench}", required=True)
    add_serve_parser(subparsers)
    add_chat_parser(subparsers)
    _add_bench_parser(parser, subparsers, wanted=bool(argv) and argv[0] == "bench")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `pagedllm` command (`argv` defaults to sys.argv[1:])."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command == "bench":
        main_fn = _optional_import("pagedllm.bench", "main", parser, "bench")
        main_fn(args)
        return
    status = args.handler(args, args.subparser)
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    main()
