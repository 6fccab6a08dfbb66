"""Attention micro-benchmark on one CUDA GPU, for every backend that can run there.

Decode: batch 1 / 32 / 128 requests, each with a 2048-token context, one new token each;
prints the time of one layer's forward (KV write + attention) and the achieved memory
bandwidth (the K/V bytes every decode step must read) as a fraction of the GPU's peak.
Prefill: one 8192-token prompt from an empty cache; prints time and TFLOP/s.
Shape: 32 query heads, 8 KV heads, head size 128, bfloat16 (Llama-3-8B's attention).

Usage: python scripts/gpu_attention_bench.py [--dtype float16] [--backends TRITON,TORCH]
Peak bandwidth is looked up from the GPU's name (override: --peak-tbps 4.8).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.core.contracts import AttentionSpec, BatchLayout  # noqa: E402
from pagedllm.plugins.attention import pagedllm_attention_backends  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 8, 128
DECODE_CONTEXT, DECODE_BATCHES, PREFILL_TOKENS = 2048, (1, 32, 128), 8192
PEAK_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0, "L40S": 0.864, "A10": 0.6, "L4": 0.3}


def make_layout(requests: list[tuple[int, int]], block_size: int, device: torch.device) -> BatchLayout:
    """Requests of (cached tokens, new tokens) on shuffled blocks, like a real step."""
    blocks_needed = [-(-(c + n) // block_size) for c, n in requests]
    pool = torch.randperm(sum(blocks_needed)).tolist()
    tables = torch.zeros(len(requests), max(blocks_needed), dtype=torch.int32)
    positions, slots, starts = [], [], [0]
    for i, ((cached, new), count) in enumerate(zip(requests, blocks_needed)):
        table = [pool.pop() for _ in range(count)]
        tables[i, :count] = torch.tensor(table, dtype=torch.int32)
        pos = torch.arange(cached, cached + new)
        positions.append(pos)
        slots.append(torch.tensor(table)[pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + new)
    qsl = torch.tensor(starts, dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in requests], dtype=torch.int32)
    positions_t = torch.cat(positions)
    return BatchLayout(
        input_ids=torch.zeros(len(positions_t), dtype=torch.int64, device=device),
        positions=positions_t.to(device), slot_mapping=torch.cat(slots).to(device),
        block_tables=tables.to(device), query_start_loc=qsl.to(device), seq_lens=seq_lens.to(device),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, max_query_len=max(n for _, n in requests),
        max_seq_len=int(seq_lens.max()), block_size=block_size,
    )


def time_ms(fn, warmup: int = 3, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def run_case(backend, spec: AttentionSpec, requests, iters: int) -> tuple[float, float]:
    """(ms per layer forward, ms per metadata build) for one step shape."""
    device = spec.device
    layout = make_layout(requests, spec.block_size, device)
    num_blocks = int(layout.block_tables.max()) + 1
    shape = backend.kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    cache = torch.randn(shape, device=device, dtype=spec.dtype)
    tokens = layout.num_tokens
    q = torch.randn(tokens, spec.num_heads, spec.head_size, device=device, dtype=spec.dtype)
    k = torch.randn(tokens, spec.num_kv_heads, spec.head_size, device=device, dtype=spec.dtype)
    v = torch.randn_like(k)
    builder = backend.builder_cls()(spec)
    impl = backend.impl_cls()(spec, spec.head_size**-0.5)
    t0 = time.perf_counter()
    metadata = builder.build(layout)
    torch.cuda.synchronize()
    build_ms = (time.perf_counter() - t0) * 1e3
    ms = time_ms(lambda: impl.forward(q, k, v, cache, metadata), iters=iters)
    del cache
    torch.cuda.empty_cache()
    return ms, build_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--backends", default="", help="comma-separated names (default: all that can run)")
    parser.add_argument("--peak-tbps", type=float, default=None, help="the GPU's peak memory bandwidth in TB/s")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to benchmark", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    gpu = torch.cuda.get_device_name(device)
    peak = args.peak_tbps or next((tbps for key, tbps in PEAK_TBPS.items() if key in gpu), None)
    print(f"GPU: {gpu}; peak bandwidth {f'{peak} TB/s' if peak else 'unknown (pass --peak-tbps)'}; "
          f"torch {torch.__version__}; heads {NUM_HEADS}/{NUM_KV_HEADS} x {HEAD_SIZE}, {args.dtype}")

    backends = pagedllm_attention_backends()
    wanted = [n.strip().upper() for n in args.backends.split(",") if n.strip()] or sorted(backends)
    failures = 0
    for name in wanted:
        backend = backends[name]
        spec = None
        reasons: list[str] = []
        for block_size in (16, 256):
            candidate = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, dtype, "auto", block_size, device)
            reasons = backend.check(candidate)
            if not reasons:
                spec = candidate
                break
        if spec is None:
            print(f"\n{name}: skipped ({'; '.join(reasons)})")
            continue
        print(f"\n{name} (block size {spec.block_size})")
        try:
            for batch in DECODE_BATCHES:
                ms, build_ms = run_case(backend, spec, [(DECODE_CONTEXT - 1, 1)] * batch, iters=20)
                kv_bytes = batch * DECODE_CONTEXT * NUM_KV_HEADS * HEAD_SIZE * 2 * dtype.itemsize
                tbps = kv_bytes / (ms * 1e-3) / 1e12
                frac = f" = {tbps / peak:5.1%} of peak" if peak else ""
                print(f"  decode  batch {batch:4d} x {DECODE_CONTEXT} ctx: {ms * 1e3:8.1f} us/layer, "
                      f"{tbps:5.2f} TB/s{frac}  (metadata build {build_ms:.2f} ms/step)")
            ms, build_ms = run_case(backend, spec, [(0, PREFILL_TOKENS)], iters=5)
            flops = 2 * 2 * NUM_HEADS * HEAD_SIZE * PREFILL_TOKENS * PREFILL_TOKENS / 2  # causal: half of QK^T and PV
            print(f"  prefill {PREFILL_TOKENS} tokens:         {ms:8.2f} ms/layer, {flops / (ms * 1e-3) / 1e12:6.1f} TFLOP/s "
                  f"(metadata build {build_ms:.2f} ms/step)")
        except Exception as exc:  # report and go on: one backend's failure must not hide the others
            failures += 1
            print(f"  FAILED: {type(exc).__name__}: {exc}")
            torch.cuda.empty_cache()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
