"""`pagedllm bench`: throughput, latency, serving load, and comparison with peers.

The subcommands mirror `vllm bench`:

- `throughput`: offline `LLM.generate` over N prompts; requests/s and tokens/s.
- `latency`: one batch generated repeatedly after warm-up; latency percentiles.
- `serve`: streaming load against any OpenAI-compatible server; TTFT/TPOT/ITL.
- `compare`: pagedllm next to vLLM CPU, llama.cpp and transformers on the same
  prompt ids, each in its own subprocess; one table with pagedllm/peer ratios.

The CLI owner wires `pagedllm bench ...` to `add_parser` and `main`;
`python -m pagedllm.bench ...` works on its own. Heavy modules load only for
the subcommand that runs, so `pagedllm --help` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

__all__ = ["add_parser", "main", "build_parser"]

_COMMANDS: dict[str, tuple[str, str]] = {
    "throughput": ("offline throughput of LLM.generate (requests/s, tokens/s)",
                   "Offline throughput: all prompts through LLM.generate, EOS ignored."),
    "latency": ("end-to-end latency of one batch (percentiles after warm-up)",
                "Latency of generating one batch, repeated after warm-up iterations."),
    "serve": ("load test an OpenAI-compatible server (TTFT, TPOT, ITL)",
              "Streaming /v1/completions load against any OpenAI-compatible server."),
    "compare": ("pagedllm vs vLLM CPU, llama.cpp, transformers on one workload",
                "Run the same workload on pagedllm and each installed peer, one after the "
                "other in subprocesses, and print one table with pagedllm/peer ratios."),
}


def _adders() -> dict[str, Callable[[argparse.ArgumentParser], None]]:
    from pagedllm.bench.compare import add_compare_args
    from pagedllm.bench.offline import add_latency_args, add_throughput_args
    from pagedllm.bench.serve import add_serve_args

    return {"throughput": add_throughput_args, "latency": add_latency_args, "serve": add_serve_args,
            "compare": add_compare_args}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `bench` and its four subcommands to a parent CLI's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmark throughput, latency, serving; compare with peers",
                                  description=__doc__.splitlines()[0])
    sub = bench.add_subparsers(dest="bench_command", metavar="{" + ",".join(_COMMANDS) + "}", required=True)
    adders = _adders()
    for name, (short, long) in _COMMANDS.items():
        parser = sub.add_parser(name, help=short, description=long)
        adders[name](parser)
    return bench


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m pagedllm.bench` (the same subcommands, without `pagedllm`)."""
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm benchmarks.")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def main(args: argparse.Namespace) -> None:
    """Run the parsed `bench` subcommand. A configuration error ends with one line, no traceback."""
    from pagedllm.bench.compare import run_compare
    from pagedllm.bench.offline import run_latency, run_throughput
    from pagedllm.bench.serve import run_serve

    handler = {"throughput": run_throughput, "latency": run_latency, "serve": run_serve,
               "compare": run_compare}[args.bench_command]
    try:
        handler(args)
    except (ValueError, NotImplementedError, RuntimeError, FileNotFoundError) as exc:
        raise SystemExit(f"pagedllm bench {args.bench_command}: error: {exc}") from None


def cli(argv: Sequence[str] | None = None) -> None:
    """`python -m pagedllm.bench throughput ...` (also accepts a leading `bench`)."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        argv = argv[1:]
    main(build_parser().parse_args(["bench", *argv]))
