"""`pagedllm serve | chat | bench | plan`: the command line, with vLLM's flag names.

Each subcommand's parser and its hand-over: `serve` runs the OpenAI server here,
`chat` goes to `pagedllm.chat_cli`, `bench` to `pagedllm.bench`, `plan` (will the
model fit, from its config alone) to `pagedllm.plan`. The engine flags
every one of them takes (generated from the config dataclasses, plus the plugins'
flags through the `pagedllm_add_cli_args` hook) and reading them back are
`pagedllm.engine_args`; server flags come from `ServerSettings` the same way. Flag
defaults are left to the dataclasses: only flags given on the command line are
passed on. A configuration error exits with status 2 and one line saying what to
change, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any, NoReturn, Sequence

from pagedllm import bench, chat_cli
from pagedllm.core.config import EngineConfig
from pagedllm.core.logs import setup_logging
from pagedllm.engine_args import (add_dataclass_args, add_engine_args, check_plugin_values,
                                  engine_config_from_args, engine_kwargs_from_args, parse_bytes)

logger = logging.getLogger("pagedllm")


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
    from pagedllm.core.data_parallel import async_engine
    from pagedllm.server.app import ServerSettings, build_app, load_chat_template, run_server
    from pagedllm.server.auth import resolve_api_key

    setup_logging()
    server_fields = {f.name for f in dataclasses.fields(ServerSettings)}
    try:
        settings = ServerSettings(**{k: v for k, v in vars(args).items() if k in server_fields})
    except ValueError as exc:
        _fail(parser, exc)
    if settings.enable_reasoning:
        logger.warning("--enable-reasoning is deprecated (vLLM's old spelling): --reasoning-parser NAME "
                       "alone enables reasoning; drop --enable-reasoning")
        if not settings.reasoning_parser:
            _fail(parser, ValueError("--enable-reasoning needs --reasoning-parser (e.g. deepseek_r1)"))
    apply_serve_defaults(args)
    if settings.api_server_count > 1:
        logger.warning("--api-server-count %d: pagedllm runs one API server process (asyncio; the engines work in "
                       "their own threads and processes), which serves every replica", settings.api_server_count)
    try:
        config = engine_config_from_args(args)
        load_chat_template(settings.chat_template)
    except (ValueError, NotImplementedError) as exc:
        _fail(parser, exc)
    if config.parallel.headless:  # this machine only runs its ranks; node 0 serves
        from pagedllm.core.executor import run_headless

        log_config(config)
        raise SystemExit(run_headless(config))
    if settings.reasoning_parser:  # structured outputs constrain what follows the reasoning
        from pagedllm.server.reasoning import reasoning_parser_class

        end_tag = reasoning_parser_class(settings.reasoning_parser).end_tag
        if end_tag is not None:
            config.structured.structured_outputs_config = {**config.structured.options, "reasoning_end": end_tag}
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
    parser.set_defaults(handler=chat, subparser=parser)


def chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Hand over to `pagedllm.chat_cli.run_chat(args)` once the engine flags are validated.

    `args` then carries `model` (positional or --model), `plugin_options`, every given
    engine flag by its vLLM name, and also `engine_kwargs` (for `LLM(**kwargs)`) and
    `engine_config`; returns run_chat's exit status."""
    try:
        args.engine_kwargs = engine_kwargs_from_args(args)
        args.engine_config = EngineConfig.from_kwargs(**args.engine_kwargs)
        check_plugin_values(args.engine_config)
    except (ValueError, NotImplementedError) as exc:
        _fail(parser, exc)
    args.model = args.engine_kwargs.get("model")
    args.plugin_options = args.engine_kwargs["plugin_options"]
    setup_logging()
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


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `pagedllm` command (`argv` defaults to sys.argv[1:])."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command == "bench":
        bench.main(args)
        return
    status = args.handler(args, args.subparser)
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    main()
