"""`pagedllm bench serve`: load against any OpenAI-compatible server.

Streams `/v1/completions` (or a chat endpoint) and times every chunk, with a lean
client of its own (`http_stream`: it shares the cores with the server it measures), so the
numbers mean the same thing for pagedllm, vLLM, llama.cpp or anything else that
speaks the protocol: TTFT, TPOT, ITL and E2E latency (mean, p50, p99), request and
token throughput, and failed requests. Arrivals are a Poisson process at
`--request-rate` (all at once by default), optionally capped at
`--max-concurrency` requests in flight — the same knobs as `vllm bench serve`.

`--plot` sweeps the concurrency and draws latency against throughput, the curve
that tells whether a server trades latency for batch size well.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from typing import Any, Sequence

from pagedllm.bench import http_stream
from pagedllm.bench.stats import RequestTiming, serving_metrics
from pagedllm.bench.workload import BenchRequest, load_dataset, random_requests, special_ids, vocab_size_of

DEFAULT_VOCAB = 1000  # ids below this exist in every real vocabulary


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="Server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine).")
    parser.add_argument("--endpoint", default="/v1/completions", help="Completions path.")
    parser.add_argument("--model", required=True, help="Model name the server expects in requests.")
    parser.add_argument("--tokenizer", default=None,
                        help="Tokenizer (HF dir) to turn random ids into text prompts; without it the "
                             "prompts are sent as token id arrays (the --model dir's tokenizer is tried first).")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help=f"Draw random ids below this (default: the tokenizer's size, else {DEFAULT_VOCAB}).")
    parser.add_argument("--num-prompts", type=int, default=100, help="Number of requests.")
    parser.add_argument("--input-len", type=int, default=128, help="Prompt length in tokens (random prompts).")
    parser.add_argument("--output-len", type=int, default=128, help="Tokens to generate per request.")
    parser.add_argument("--dataset", default=None, help="JSONL dataset instead of random prompts (see throughput).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the prompts and the arrival times.")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Requests per second, Poisson arrivals (default inf: all at once).")
    parser.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight at once.")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="Seconds before a request fails.")
    parser.add_argument("--api-key", default=None, help="Bearer token for the server (default: $OPENAI_API_KEY).")
    parser.add_argument("--extra-body", default=None, type=_json_object, metavar="JSON",
                        help="Fields merged into every request body, e.g. '{\"structured_outputs\": {\"json\": "
                             "{...}}}' to measure a constraint's cost beside a run without it.")
    parser.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    parser.add_argument("--plot", default=None,
                        help="Sweep --sweep-concurrency and draw latency vs throughput to this PNG "
                             "(needs matplotlib).")
    parser.add_argument("--sweep-concurrency", default="1,2,4,8,16",
                        help="Comma-separated concurrencies for --plot.")


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--extra-body must be a JSON object")
    return value


def completions_url(base_url: str, endpoint: str = "/v1/completions") -> str:
    """Join a server root and an endpoint, tolerating a base URL that already ends in /v1."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + endpoint


async def stream_one(url: str, payload: dict[str, Any], prompt_len: int, headers: dict[str, str] | None = None,
                     timeout: float = 600.0) -> RequestTiming:
    """Send one streamed request and time its chunks; any failure (HTTP status, an error
    event, a timeout after `timeout` seconds in all) is recorded in the timing, not raised."""
    timing = RequestTiming(start=time.perf_counter(), prompt_tokens=prompt_len)
    try:
        await asyncio.wait_for(_read_stream(url, payload, headers, timing), timeout)
    except asyncio.TimeoutError:
        timing.error = f"no complete answer within {timeout:g} s (--request-timeout)"
    except Exception as exc:  # a load test counts failures instead of stopping at the first
        timing.error = f"{type(exc).__name__}: {exc}"
    return timing


async def _read_stream(url: str, payload: dict[str, Any], headers: dict[str, str] | None,
                       timing: RequestTiming) -> None:
    usage_tokens: int | None = None
    resp = await http_stream.post(url, payload, headers)
    try:
        if resp.status != 200:
            body = (await resp.read()).decode("utf-8", "replace")
            timing.error = f"HTTP {resp.status}: {body[:300]}"
            return
        async for line in resp.lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                timing.error = f"server error mid-stream: {chunk['error']}"
                return
            now = time.perf_counter()
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
                timing.chunk_times.append(now)
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens", usage_tokens)
                if chunk["usage"].get("prompt_tokens"):
                    timing.prompt_tokens = chunk["usage"]["prompt_tokens"]
    finally:
        resp.close()
    timing.end = time.perf_counter()
    timing.output_tokens = usage_tokens if usage_tokens is not None else len(timing.chunk_times)
    timing.success = bool(timing.chunk_times)
    if not timing.success:
        timing.error = "the stream carried no text"


def request_payload(model: str, request: BenchRequest, text: str | None,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": text if text is not None else request.prompt_token_ids,
        "max_tokens": request.output_len,
        "min_tokens": request.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }


async def benchmark(base_url: str, model: str, requests: Sequence[BenchRequest],
                    texts: Sequence[str | None] | None = None, request_rate: float = math.inf,
                    max_concurrency: int | None = None, seed: int = 0, request_timeout: float = 600.0,
                    endpoint: str = "/v1/completions", api_key: str | None = None,
                    test_request: bool = True, extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """Send `requests` (as `texts` where given, else as token ids) and measure them.

    A short test request goes first so a wrong URL or model name fails fast with the
    server's own message instead of as N identical failures.
    """
    url = completions_url(base_url, endpoint)
    texts = list(texts) if texts is not None else [None] * len(requests)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(requests)
    if test_request:
        probe = BenchRequest(requests[0].prompt_token_ids, min(2, requests[0].output_len))
        result = await stream_one(url, request_payload(model, probe, texts[0], extra_body), probe.prompt_len,
                                  headers, request_timeout)
        if not result.success:
            raise RuntimeError(f"the test request to {url} failed: {result.error}")
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(limit)

    async def limited(req: BenchRequest, text: str | None) -> RequestTiming:
        async with semaphore:
            return await stream_one(url, request_payload(model, req, text, extra_body), req.prompt_len, headers,
                                    request_timeout)

    tasks = []
    start = time.perf_counter()
    for req, text in zip(requests, texts):
        tasks.append(asyncio.create_task(limited(req, text)))
        if request_rate != math.inf:
            await asyncio.sleep(rng.expovariate(request_rate))
    timings = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    metrics = serving_metrics(timings, duration)
    errors = [t.error for t in timings if not t.success]
    expected = sum(r.output_len for r, t in zip(requests, timings) if t.success)
    return {
        "base_url": base_url,
        "model": model,
        "num_prompts": len(requests),
        "request_rate": request_rate if request_rate != math.inf else "inf",
        "max_concurrency": max_concurrency,
        **metrics,
        "expected_output_tokens": expected,
        "errors": errors[:10],
        "ttfts": [t.ttft for t in timings],
        "itls": [t.itls for t in timings],
        "output_lens": [t.output_tokens for t in timings],
    }


def print_report(result: dict[str, Any]) -> None:
    """The summary block, in `vllm bench serve`'s layout."""
    rows = [
        ("Successful requests", result["completed"], "d"),
        ("Failed requests", result["failed"], "d"),
        ("Maximum request concurrency", result["max_concurrency"] or "-", ""),
        ("Benchmark duration (s)", result["duration_s"], ".2f"),
        ("Total input tokens", result["total_input_tokens"], "d"),
        ("Total generated tokens", result["total_output_tokens"], "d"),
        ("Request throughput (req/s)", result["request_throughput"], ".2f"),
        ("Output token throughput (tok/s)", result["output_throughput"], ".2f"),
        ("Total token throughput (tok/s)", result["total_token_throughput"], ".2f"),
    ]
    print("{:=^60}".format(" Serving Benchmark Result "))
    for name, value, fmt in rows:
        print(f"{name + ':':<45}{value:>15{fmt}}")
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print("{:-^60}".format(f" {title} "))
        for stat in ("mean", "p50", "p99"):
            label = {"mean": "Mean", "p50": "Median", "p99": "P99"}[stat]
            print(f"{label + ' ' + key.upper() + ' (ms):':<45}{result[f'{stat}_{key}_ms']:>15.2f}")
    print("=" * 60)
    if result.get("expected_output_tokens") not in (None, result["total_output_tokens"]):
        print(f"warning: the server generated {result['total_output_tokens']} tokens, not the "
              f"{result['expected_output_tokens']} asked for (it may not honor ignore_eos/min_tokens); "
              "the throughput counts what it generated")
    for err in result.get("errors", [])[:3]:
        print(f"error: {err}")


def _tokenizer_for(args: argparse.Namespace) -> Any:
    """The tokenizer to make text prompts with: --tokenizer, else --model if it is a local
    HF directory, else None (prompts go out as token ids)."""
    import os

    path = args.tokenizer or (args.model if os.path.isdir(args.model) else None)
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def make_requests(args: argparse.Namespace, tokenizer: Any) -> tuple[list[BenchRequest], list[str | None]]:
    """The requests and, when a tokenizer is known, their text form."""
    if args.dataset:
        requests = load_dataset(args.dataset, args.num_prompts, args.output_len, tokenizer)
    else:
        vocab = args.vocab_size or (vocab_size_of(tokenizer) if tokenizer is not None else DEFAULT_VOCAB)
        requests = random_requests(args.num_prompts, args.input_len, args.output_len, vocab, args.seed,
                                   special_ids(tokenizer) if tokenizer is not None else ())
    if tokenizer is None:
        return requests, [r.prompt for r in requests]
    return requests, [r.prompt if r.prompt is not None else tokenizer.decode(r.prompt_token_ids)
                      for r in requests]


def _require_matplotlib() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    return plt


def plot_sweep(points: list[dict[str, Any]], path: str) -> None:
    """Latency (median TTFT, TPOT, E2E) against output throughput, one point per concurrency."""
    plt = _require_matplotlib()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    xs = [p["output_throughput"] for p in points]
    for ax, (key, title) in zip(axes, (("p50_ttft_ms", "median TTFT (ms)"), ("p50_tpot_ms", "median TPOT (ms)"),
                                      ("p50_e2el_ms", "median E2E latency (ms)"))):
        ys = [p[key] for p in points]
        ax.plot(xs, ys, marker="o")
        for p, x, y in zip(points, xs, ys):
            ax.annotate(f"c={p['max_concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4))
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(title)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{points[0]['model']} @ {points[0]['base_url']}: latency vs throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    """The CLI entry: one run, or a concurrency sweep when --plot is given."""
    import os

    if args.plot:
        _require_matplotlib()  # fail before the load, not after it
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    requests, texts = make_requests(args, _tokenizer_for(args))
    common = dict(seed=args.seed, request_timeout=args.request_timeout, endpoint=args.endpoint, api_key=api_key,
                  extra_body=getattr(args, "extra_body", None))
    if not args.plot:
        result = asyncio.run(benchmark(args.base_url, args.model, requests, texts, args.request_rate,
                                       args.max_concurrency, **common))
        print_report(result)
    else:
        levels = [int(c) for c in args.sweep_concurrency.split(",") if c.strip()]
        points = []
        for level in levels:
            print(f"--- max concurrency {level}")
            point = asyncio.run(benchmark(args.base_url, args.model, requests, texts, args.request_rate,
                                          level, **common))
            print_report(point)
            points.append(point)
        plot_sweep(points, args.plot)
        print(f"Plot written to {args.plot}")
        result = {"sweep": points}
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, default=str)
        print(f"Results written to {args.output_json}")
    return result
