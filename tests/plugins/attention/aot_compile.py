"""Compile the TRITON kernels ahead of time for a CUDA target, on a machine without a GPU.

The interpreter runs kernels as Python and accepts code the compiler rejects (a
non-constexpr global, a type mismatch in a loop); compiling to a cubin with Triton's
bundled ptxas catches that without a GPU. Must run in a process where TRITON_INTERPRET
is unset (test_triton_compiles.py starts one). Prints one line per kernel variant and
exits non-zero if any fails.

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


def compile_variant(target: GPUTarget, kernel, types: dict[str, str], constexprs: dict, label: str) -> bool:
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}
    start = time.perf_counter()
    try:
        triton.compile(ASTSource(kernel, signature, constexprs), target=target, options=dict(num_warps=4))
    except Exception as exc:  # report every variant, then fail once at the end
        print(f"FAIL {label}: {type(exc).__name__}: {exc}\n  caused by: {exc.__cause__!r}")
        return False
    print(f"ok   {label} ({time.perf_counter() - start:.1f}s)")
    return True


def attention_types(act: str, cache: str) -> dict[str, str]:
    types = dict(out_ptr=f"*{act}", q_ptr=f"*{act}", key_cache_ptr=f"*{cache}", value_cache_ptr=f"*{cache}",
                 part_acc_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", window="i32")
    types.update({name: "*i32" for name in ATTENTION_POINTERS})
    types.update({name: "fp32" for name in FLOATS})
    return types


def variants(everything: bool):
    # (activation dtype, cache dtype, fp8, soft-cap, ieee dot, group, head size)
    cases = [("fp16", "fp16", False, False, False, 4, 128), ("bf16", "fp8e4nv", True, True, False, 8, 64)]
    if everything:
        cases += [("fp32", "fp32", False, False, True, 1, 128), ("fp16", "fp16", False, False, False, 6, 80)]
    for act, cache, fp8, cap, ieee, group, head in cases:
        label = f"{act}/{cache} group={group} head={head} cap={cap}"
        yield kernels._write_kv_kernel, dict(
            key_ptr=f"*{act}", value_ptr=f"*{act}", key_cache_ptr=f"*{cache}", value_cache_ptr=f"*{cache}",
            slot_mapping_ptr="*i64", k_scale="fp32", v_scale="fp32",
        ), dict(NUM_KV_HEADS=8, HEAD_SIZE=head, BLOCK_SIZE=16, BLOCK_ELEMS=triton.next_power_of_2(8 * head),
                IS_FP8=fp8, EMULATE_FP8_ROUNDING=False, FP8_MANTISSA_BITS=3, FP8_MIN_NORMAL=2.0**-6,
                FP8_MAX=448.0, FP8_MAGIC=2.0**14), f"write_kv {label}"
        shared = dict(GROUP=group, BLOCK_SIZE=16, HEAD_SIZE=head, HEAD_PAD=triton.next_power_of_2(head),
                      USE_SOFT_CAP=cap, IS_FP8=fp8, IEEE_DOT=ieee)
        yield kernels._prefill_kernel, attention_types(act, cache), dict(
            shared, BLOCK_M=kernels.PREFILL_BLOCK_M, BLOCK_N=kernels.PREFILL_BLOCK_N), f"prefill {label}"
        for single in (False, True) if everything else (False,):
            yield kernels._decode_kernel, attention_types(act, cache), dict(
                shared, GROUP_PAD=max(kernels.MIN_DECODE_ROWS, triton.next_power_of_2(group)),
                BLOCK_N=kernels.DECODE_BLOCK_N, PARTITION_SIZE=256, SINGLE_PARTITION=single,
            ), f"decode {label} single={single}"
        yield kernels._decode_reduce_kernel, attention_types(act, cache), dict(
            HEAD_SIZE=head, HEAD_PAD=triton.next_power_of_2(head), PART_PAD=32), f"reduce {label}"


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    target = GPUTarget("cuda", int(args[0]) if args else 90, 32)
    results = [compile_variant(target, *variant) for variant in variants("--all" in sys.argv)]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
