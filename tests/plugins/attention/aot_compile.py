"""Compile the TRITON kernels ahead of time for a CUDA target, on a machine without a GPU.

The interpreter runs kernels as Python and accepts code the compiler rejects (a
non-constexpr global, a type mismatch in a loop); compiling to a cubin with Triton's
bundled ptxas catches that without a GPU. Must run in a process where TRITON_INTERPRET
is unset (test_triton_compiles.py starts one). Prints one line per kernel variant and
exits non-zero if any fails, or if a variant needs more shared memory than a Hopper SM
offers (SHARED_LIMIT: what a launch would refuse).

Usage: python aot_compile.py [sm, e.g. 90] [--all]
"""

from __future__ import annotations

import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run with TRITON_INTERPRET unset: the interpreter has no compiler to check")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import pagedllm.plugins.attention.triton_kernels as kernels  # noqa: E402

ATTENTION_POINTERS = ("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr", "req_ids_ptr")
FLOATS = ("sm_scale", "k_scale", "v_scale", "soft_cap")
SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90


def compile_variant(target: GPUTarget, kernel, types: dict[str, str], constexprs: dict, label: str,
                    options: dict | None = None) -> bool:
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}
    start = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=target,
                                  options={"num_warps": 4, **(options or {})})
    except Exception as exc:  # report every variant, then fail once at the end
        print(f"FAIL {label}: {type(exc).__name__}: {exc}\n  caused by: {exc.__cause__!r}")
        return False
    shared = compiled.metadata.shared
    if shared > SHARED_LIMIT:
        print(f"FAIL {label}: needs {shared} bytes of shared memory (at most {SHARED_LIMIT})")
        return False
    print(f"ok   {label} ({time.perf_counter() - start:.1f}s, {shared} bytes shared)")
    return True


def attention_types(act: str, cache: str) -> dict[str, str]:
    types = dict(out_ptr=f"*{act}", q_ptr=f"*{act}", key_cache_ptr=f"*{cache}", value_cache_ptr=f"*{cache}",
                 part_acc_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", window="i32", chunk="i32")
    types.update({name: "*i32" for name in ATTENTION_POINTERS})
    types.update({name: "fp32" for name in FLOATS})
    return types


def variants(everything: bool):
    # (activation dtype, cache dtype, fp8, soft-cap, ieee dot, group, value head size, key tail, value is key);
    # the tail > 0 cases are MLA latents (DeepSeek-V3: 128 heads on one latent of 512 + 64)
    cases = [("fp16", "fp16", False, False, False, 4, 128, 0, False),
             ("bf16", "fp8e4nv", True, True, False, 8, 64, 0, False),
             ("bf16", "bf16", False, False, False, 128, 512, 64, True)]
    if everything:
        cases += [("fp32", "fp32", False, False, True, 1, 128, 0, False),
                  ("fp16", "fp16", False, False, False, 6, 80, 0, False),
                  ("bf16", "fp8e4nv", True, False, False, 16, 512, 64, True)]
    for act, cache, fp8, cap, ieee, group, head, tail, value_is_key in cases:
        label = f"{act}/{cache} group={group} head={head}+{tail} cap={cap}"
        kv_heads, write_size = (1, head + tail) if value_is_key else (8, head)
        yield kernels._write_kv_kernel, dict(
            key_ptr=f"*{act}", value_ptr=f"*{act}", key_cache_ptr=f"*{cache}", value_cache_ptr=f"*{cache}",
            slot_mapping_ptr="*i64", k_scale="fp32", v_scale="fp32",
        ), dict(NUM_KV_HEADS=kv_heads, HEAD_SIZE=write_size, BLOCK_SIZE=16,
                BLOCK_ELEMS=triton.next_power_of_2(kv_heads * write_size),
                IS_FP8=fp8, EMULATE_FP8_ROUNDING=False, FP8_MANTISSA_BITS=3, FP8_MIN_NORMAL=2.0**-6,
                FP8_MAX=448.0, FP8_MAGIC=2.0**14, WRITE_VALUE=not value_is_key), f"write_kv {label}"
        v_pad, tail_pad = triton.next_power_of_2(head), max(16, triton.next_power_of_2(tail))
        key_pad = v_pad + (tail_pad if tail else 0)
        shared = dict(GROUP=group, BLOCK_SIZE=16, V_SIZE=head, V_PAD=v_pad, TAIL=tail, TAIL_PAD=tail_pad,
                      USE_SOFT_CAP=cap, IS_FP8=fp8, IEEE_DOT=ieee, VALUE_IS_KEY=value_is_key)
        block_m, block_n, num_warps = kernels.prefill_tiles(key_pad)
        yield kernels._prefill_kernel, attention_types(act, cache), dict(
            shared, BLOCK_M=block_m, BLOCK_N=block_n), f"prefill {label}", dict(num_warps=num_warps, num_stages=2)
        rows, head_blocks, block_n = kernels.decode_tiles(group, key_pad)
        for single in (False, True) if everything else (False,):
            yield kernels._decode_kernel, attention_types(act, cache), dict(
                shared, GROUP_ROWS=rows, HEAD_BLOCKS=head_blocks, BLOCK_N=block_n, PARTITION_SIZE=256,
                SINGLE_PARTITION=single,
            ), f"decode {label} single={single}"
        yield kernels._decode_reduce_kernel, attention_types(act, cache), dict(
            V_SIZE=head, V_PAD=v_pad, PART_PAD=32), f"reduce {label}"


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    target = GPUTarget("cuda", int(args[0]) if args else 90, 32)
    results = [compile_variant(target, *variant) for variant in variants("--all" in sys.argv)]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
