"""`pagedllm bench throughput` and `pagedllm bench latency`: the offline `LLM` API, timed.

Both follow `vllm bench throughput|latency`: prompts are random token ids with a
fixed seed (or a dataset), generation ignores EOS so every request produces exactly
`--output-len` tokens, and the model load is timed apart from generation.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pagedllm.bench.stats import DEFAULT_PERCENTILES, mean, percentile
from pagedllm.bench.workload import BenchRequest, build_requests, random_requests, special_ids, vocab_size_of
from pagedllm.engine_args import add_engine_args, engine_kwargs_from_args


def prompt_seed(args: argparse.Namespace) -> int:
    """The engine's --seed also seeds the random prompts (as in `vllm bench`); 0 if not given."""
    return getattr(args, "seed", 0)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=128, help="Prompt length in tokens (random prompts).")
    parser.add_argument("--output-len", type=int, default=128, help="Tokens to generate per request.")
    parser.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    add_engine_args(parser)


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument("--num-prompts", type=int, default=1000, help="Number of requests.")
    parser.add_argument("--dataset", default=None,
                        help='JSONL file, one {"prompt": ...} or {"prompt_token_ids": [...]} per line '
                             '(optional "output_len"); default: random prompts.')
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="Sampling temperature (vLLM's benchmark samples at 1.0; 0 is greedy).")


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument("--batch-size", type=int, default=8, help="Requests generated together per iteration.")
    parser.add_argument("--num-iters-warmup", type=int, default=10, help="Untimed iterations first.")
    parser.add_argument("--num-iters", type=int, default=30, help="Timed iterations.")


def _load(args: argparse.Namespace) -> tuple[Any, float]:
    from pagedllm import LLM

    start = time.perf_counter()
    llm = LLM(**engine_kwargs_from_args(args))
    return llm, time.perf_counter() - start


def _write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, default=str)
        print(f"Results written to {path}")


def report_spec_decode(llm: Any, result: dict[str, Any]) -> None:
    """Add and print the acceptance figures when the engine speculates."""
    if llm.engine.spec_config is None:
        return
    stats = llm.engine.scheduler.spec_stats
    result["spec_decode"] = {
        "method": llm.engine.spec_config.method, "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens, "num_accepted_tokens": stats.num_accepted_tokens,
        "acceptance_rate": stats.acceptance_rate, "mean_acceptance_length": stats.mean_acceptance_length,
        "accepted_per_position": list(stats.accepted_per_position),
    }
    print(f"Speculative decoding ({llm.engine.spec_config.method}): mean acceptance length "
          f"{stats.mean_acceptance_length:.2f}, acceptance rate {100 * stats.acceptance_rate:.1f}% "
          f"({stats.num_accepted_tokens} of {stats.num_draft_tokens} draft tokens in {stats.num_drafts} drafts)")


def report_decode_rate(outputs: list, result: dict[str, Any]) -> None:
    """Add and print the decode rate: each request's tokens after its first over the time
    from its first token to its last (1 / vLLM's TPOT), the mean over requests. Unlike the
    output tokens/s above it leaves prefill out, so with `--max-num-seqs 1` it is the
    single-stream decode speed a long prompt's prefill would otherwise dilute."""
    rates = []
    for o in outputs:
        m, tokens = o.metrics, sum(len(c.token_ids) for c in o.outputs)
        if m is not None and m.first_token_time is not None and m.finished_time is not None and tokens > 1 \
                and m.finished_time > m.first_token_time:
            rates.append((tokens - 1) / (m.finished_time - m.first_token_time))
    if rates:
        result["mean_decode_tokens_per_second"] = sum(rates) / len(rates)
        print(f"Decode: {result['mean_decode_tokens_per_second']:.2f} tokens/s per request after its first token "
              f"(mean of {len(rates)} requests; prefill left out)")


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Generate for all requests in one `LLM.generate` call and report the rates."""
    from pagedllm import SamplingParams

    llm, load_s = _load(args)
    requests = build_requests(args, llm.get_tokenizer(), llm.engine.vocab_size)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=args.temperature, max_tokens=r.output_len, ignore_eos=True,
                             seed=None if args.temperature == 0 else prompt_seed(args) + i)
              for i, r in enumerate(requests)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = {
        "model": llm.engine.model_path,
        "num_requests": len(requests),
        "elapsed_time": elapsed,
        "load_time_s": load_s,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "total_num_tokens": prompt_tokens + output_tokens,
        "requests_per_second": len(requests) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "engine_args": engine_kwargs_from_args(args),
    }
    print(f"Model load: {load_s:.2f} s")
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    report_decode_rate(outputs, result)
    report_spec_decode(llm, result)
    _write_json(args.output_json, result)
    return result


def run_latency(args: argparse.Namespace) -> dict[str, Any]:
    """Time `--num-iters` generations of one batch after `--num-iters-warmup` untimed ones."""
    from pagedllm import SamplingParams

    llm, load_s = _load(args)
    tok = llm.get_tokenizer()
    batch: list[BenchRequest] = random_requests(args.batch_size, args.input_len, args.output_len,
                                                vocab_size_of(tok, llm.engine.vocab_size), prompt_seed(args),
                                                special_ids(tok))
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in batch]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.output_len, ignore_eos=True)

    def once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for i in range(args.num_iters_warmup):
        once()
        if not args.disable_tqdm:
            print(f"warm-up {i + 1}/{args.num_iters_warmup}", flush=True)
    latencies = []
    for i in range(args.num_iters):
        latencies.append(once())
        if not args.disable_tqdm:
            print(f"iteration {i + 1}/{args.num_iters}: {latencies[-1]:.3f} s", flush=True)
    result = {
        "model": llm.engine.model_path,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "load_time_s": load_s,
        "avg_latency": mean(latencies),
        "latencies": latencies,
        "percentiles": {str(q): percentile(latencies, q) for q in DEFAULT_PERCENTILES},
        "engine_args": engine_kwargs_from_args(args),
    }
    print(f"Avg latency: {result['avg_latency']:.4f} seconds")
    for q, value in result["percentiles"].items():
        print(f"{q}% percentile latency: {value:.4f} seconds")
    report_spec_decode(llm, result)
    _write_json(args.output_json, result)
    return result
