"""`pagedllm serve | chat | bench | plan`: the command line, with vLLM's flag names.

Each subcommand's parser and its hand-over: `serve` runs the OpenAI server here,
`chat` goes to `pagedllm.chat_cli`, `bench` to `pagedllm.bench`, `plan` (will the
model fit, from its config alone) to `pagedllm.plan`. The engine flags
every one of them takes (generated from the config dataclasses, plus the plugins'
flags through the `pagedllm_add_cli_args` hook) and reading them back are
`pagedllm.engine_args`; server flags come from `ServerSettings` the same way. Flag
defaults are left to the dataclasses: only flags given on the command line are
passed on. vLLM's flags pagedllm does not take are known flags, refused or warned
about with the reason; `--config FILE.yaml` reads flags from a file, as vLLM does.
Configuration errors exit with status 2 and one message listing every problem found
before loading (what to change, never a traceback); a model that fails to load exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import sys
from typing import Any, NoReturn, Sequence

from pagedllm import bench, chat_cli
from pagedllm.core import envs
from pagedllm.core.config import ConfigError, EngineConfig, spell
from pagedllm.core.logs import setup_logging
from pagedllm.core.vllm_args import VLLM_ONLY_ARGS, judge_vllm_args
from pagedllm.engine_args import (add_dataclass_args, add_engine_args, add_vllm_only_args, engine_config_from_args,
                                  engine_kwargs_from_args, parse_bytes)

logger = logging.getLogger("pagedllm")


def _fail(parser: argparse.ArgumentParser, exc: BaseException | str) -> NoReturn:
    """Configuration problems: exit status 2 (argparse's usage-error status), no traceback
    and no usage dump — the message already names each flag to change."""
    text = exc.message("cli") if isinstance(exc, ConfigError) else str(exc)
    parser.exit(2, f"{parser.prog}: error: {text}\n")


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
    add_vllm_only_args(parser, "server")
    add_config_arg(parser)
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


def serve_setup(args: argparse.Namespace) -> tuple[EngineConfig, Any]:
    """(engine config, ServerSettings) for `pagedllm serve`: everything checked that can be
    before a model loads — server settings, vLLM server flags, chat template, the engine
    config with its plugin and environment values — with warnings logged once; raises one
    ConfigError (spelled as flags) listing every problem."""
    from pagedllm.server.app import ServerSettings, load_chat_template

    envs.warn_deprecated()  # the environment's warnings first: once, before the config's
    problems: list[str] = []
    server_fields = {f.name for f in dataclasses.fields(ServerSettings)}
    settings = None
    try:
        settings = ServerSettings(**{k: v for k, v in vars(args).items() if k in server_fields})
    except ValueError as exc:
        problems.append(str(exc))
    refused, warnings, notes = judge_vllm_args({k: v for k, v in vars(args).items()
                                               if k in VLLM_ONLY_ARGS and VLLM_ONLY_ARGS[k].scope == "server"})
    problems += refused
    for message in warnings:
        logger.warning("%s", spell(message, "cli"))
    for message in notes:
        logger.info("%s", spell(message, "cli"))
    if settings is not None:
        problems += _reasoning_problems(settings)
        try:
            load_chat_template(settings.chat_template)
        except ValueError as exc:
            problems.append(str(exc))
        if settings.api_server_count > 1:
            logger.warning("--api-server-count %d: pagedllm runs one API server process (asyncio; the engines work "
                           "in their own threads and processes), which serves every replica",
                           settings.api_server_count)
    apply_serve_defaults(args)
    config = None
    try:
        config = engine_config_from_args(args)
    except ConfigError as exc:
        problems += exc.problems
    if problems or config is None or settings is None:
        raise ConfigError(problems, "cli")
    if settings.reasoning_parser:  # structured outputs constrain what follows the reasoning
        from pagedllm.server.reasoning import reasoning_parser_class

        end_tag = reasoning_parser_class(settings.reasoning_parser).end_tag
        if end_tag is not None:
            config.structured.structured_outputs_config = {**config.structured.options, "reasoning_end": end_tag}
    return config, settings


def _reasoning_problems(settings: Any) -> list[str]:
    if not settings.enable_reasoning:
        return []
    logger.warning("--enable-reasoning is deprecated (vLLM's old spelling): --reasoning-parser NAME alone enables "
                   "reasoning; drop --enable-reasoning")
    return [] if settings.reasoning_parser else ["--enable-reasoning needs --reasoning-parser (e.g. deepseek_r1)"]


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from pagedllm.core.data_parallel import async_engine
    from pagedllm.server.app import build_app, run_server
    from pagedllm.server.auth import resolve_api_key

    setup_logging()
    try:
        config, settings = serve_setup(args)
    except ConfigError as exc:
        _fail(parser, exc)
    if config.parallel.headless:  # this machine only runs its ranks; node 0 serves
        from pagedllm.core.executor import run_headless

        log_config(config)
        raise SystemExit(run_headless(config))
    shown = {k: v for k, v in dataclasses.asdict(settings).items() if k != "api_key"}
    log_config(config, shown)
    api_key = resolve_api_key(settings.api_key)
    try:
        engine = async_engine(config)
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
    add_config_arg(parser)
    parser.set_defaults(handler=chat, subparser=parser)


def chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Hand over to `pagedllm.chat_cli.run_chat(args)` once the engine flags are validated.

    `args` then carries `model` (positional or --model), `plugin_options`, every given
    engine flag by its vLLM name, and also `engine_kwargs` (for `LLM(**kwargs)`) and
    `engine_config`; returns run_chat's exit status."""
    setup_logging()
    try:
        args.engine_kwargs = engine_kwargs_from_args(args)
        args.engine_config = engine_config_from_args(args)
    except (ValueError, NotImplementedError) as exc:
        _fail(parser, exc)
    args.model = args.engine_kwargs.get("model")
    args.plugin_options = args.engine_kwargs["plugin_options"]
    return chat_cli.run_chat(args)


# ---------------------------------------------------------------------- plan


def add_plan_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan", help="will a model fit? weights, KV cache and sequences per GPU, before loading anything",
        description="Read only a model's config.json (a model directory or the file) or a GGUF file's metadata, "
                    "and say, per rank, what the weights and the KV cache take and how many max-model-len "
                    "sequences fit under the engine flags given (the same flags as `pagedllm serve`); when not one "
                    "fits, what to change, in order, with the number each change gives. Exit status 0: it fits, "
                    "1: it does not, 2: a configuration error.")
    add_engine_args(parser)
    group = parser.add_argument_group("plan")
    group.add_argument("--gpu-memory", type=parse_bytes, default=None, metavar="SIZE",
                       help="Memory of one GPU, e.g. 141GB or 80GiB (binary units, as --kv-cache-memory: "
                            "G = GB = GiB). Default: the visible CUDA device's; required where there is none.")
    group.add_argument("--device-count", type=int, default=None, metavar="N",
                       help="GPUs available (default: the visible CUDA devices; without any, no limit): the "
                            "tensor-parallel remedy stays within N / pipeline_parallel_size.")
    group.add_argument("--json", action="store_true", help="Print one JSON object instead of the report.")
    add_config_arg(parser)
    parser.set_defaults(handler=plan, subparser=parser)


def plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print the plan (or its JSON); exit status 1 when not one sequence fits."""
    from pagedllm import plan as planner

    if args.device_count is not None and args.device_count < 1:
        _fail(parser, "--device-count must be >= 1")
    try:
        config = engine_config_from_args(args)
        result = planner.plan_from_config(config, gpu_memory=args.gpu_memory, device_count=args.device_count)
    except (ValueError, NotImplementedError) as exc:
        _fail(parser, exc)
    print(json.dumps(planner.to_json(result), indent=1) if args.json else planner.report(result))
    return 0 if result.fits else 1


def _add_bench_parser(subparsers: Any, wanted: bool) -> None:
    """The `bench` subcommands in full only when `bench` is the command (they load the
    bench modules and repeat the engine flags four times); otherwise a short entry."""
    if wanted:
        bench.add_parser(subparsers)
        return
    subparsers.add_parser("bench", help="benchmark throughput and latency (see 'pagedllm bench --help')",
                          add_help=False)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The `pagedllm` parser; `argv` decides whether the bench subcommands are built in full."""
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: a small vLLM-compatible engine.")
    subparsers = parser.add_subparsers(dest="command", metavar="{serve,chat,bench,plan}", required=True)
    add_serve_parser(subparsers)
    add_chat_parser(subparsers)
    add_plan_parser(subparsers)
    _add_bench_parser(subparsers, wanted=bool(argv) and argv[0] == "bench")
    return parser


# ---------------------------------------------------------------------- --config FILE.yaml


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.yaml", default=None,
                        help="Read flags from a YAML file, as vLLM does: keys are flag names (with - or _), "
                             "e.g. 'max-model-len: 2048' or 'enable_prefix_caching: true'; flags on the command "
                             "line override it.")


def config_file_flags(path: str, subparser: argparse.ArgumentParser, skip_model: bool) -> list[str]:
    """The flags a vLLM-style YAML config file stands for (`key: value` -> `--key value`;
    true / false -> `--key` / `--no-key`; a list -> `--key a b`; a mapping -> JSON). Raises
    ConfigError naming the file for what cannot be read or is not a flag of this command."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config {path}: cannot be read as YAML: {exc}", "cli") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values, got "
                          f"{type(data).__name__}", "cli")
    actions = subparser._option_string_actions
    flags: list[str] = []
    unknown = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--model" and skip_model:  # the command line's model wins
            continue
        action = actions.get(flag)
        if action is None or flag == "--config":
            unknown.append(str(key))
        elif value is None:
            continue
        elif isinstance(action, argparse.BooleanOptionalAction):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, bool) and action.nargs == 0:
            flags += [flag] if value else []
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif isinstance(value, list):
            flags += [flag, *map(str, value)] if action.nargs == "+" else [flag, ",".join(map(str, value))]
        else:
            flags += [flag, str(value)]
    if unknown:
        raise ConfigError(f"--config {path}: unknown key(s) {', '.join(unknown)}: not flags of `pagedllm "
                          f"{subparser.prog.split()[-1]}` (see --help)", "cli")
    return flags


def with_config_file(argv: list[str], args: argparse.Namespace) -> list[str]:
    """`argv` with the flags of its --config file put right after the subcommand (and its
    MODEL), so that the command line's own flags, parsed later, override the file's."""
    flags = config_file_flags(args.config, args.subparser,
                              skip_model=getattr(args, "model_tag", None) is not None or "model" in args)
    at = 2 if len(argv) > 1 and not argv[1].startswith("-") else 1
    return argv[:at] + flags + argv[at:]


def parse_command(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)`, but a flag no command knows (a typo: every vLLM flag is
    known) is named under the subcommand, with the closest flags it has."""
    args, extra = parser.parse_known_args(argv)
    sub = getattr(args, "subparser", None)
    if not extra:
        return args
    if sub is None:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    flags = [o for o in sub._option_string_actions if o.startswith("--") and not o.startswith("--no-")]
    hints = [f"{e} (did you mean {', '.join(close)}?)" if (close := difflib.get_close_matches(e.split("=")[0], flags,
                                                                                              n=2)) else e
             for e in extra if e.startswith("-")]
    _fail(sub, f"unrecognized arguments: {', '.join(hints) or ' '.join(extra)} (see {sub.prog} --help)")


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `pagedllm` command (`argv` defaults to sys.argv[1:])."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parse_command(parser, argv)
    if getattr(args, "config", None):
        try:
            argv = with_config_file(argv, args)
        except ConfigError as exc:
            _fail(args.subparser, exc)
        args = parse_command(parser, argv)
    if args.command == "bench":
        bench.main(args)
        return
    status = args.handler(args, args.subparser)
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    main()
