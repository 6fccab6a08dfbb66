"""Triton kernels over the paged KV cache: KV write, varlen prefill, split-context decode.

Addressing: token t of request r lives in block `block_tables[r, t // BLOCK_SIZE]`, row
`t % BLOCK_SIZE`. Kernels receive the key and value caches as two tensors of shape
[num_blocks, block_size, num_kv_heads, head_size] (any strides, last dim contiguous), so
the TRITON backend's [2, ...] cache passes `kv_cache[0]` / `kv_cache[1]` without copies.

Softmax runs in fp32 in the log2 domain (exp2), online (running max `m`, running sum `l`)
as in FlashAttention. GQA packs the query heads that share a KV head into the rows of one
tile (row = token * GROUP + head-in-group), so K/V are loaded once per group and never
repeated in memory. The caller wrote the step's K/V before attending, so every kernel
reads all keys (cached prefix and new tokens alike) from the cache; with an FP8 cache this
gives exactly the values the torch reference reads.

Keys may be longer than values: the output head size (`out.shape[-1]`, V) is the value
size and q's head size is the key size; the key elements beyond V (the "tail") get their
own padded tile and dot, so neither part pads far (MLA's 512 + 64 pads to 512 + 64, not
1024). With `value_is_key` (MLA: one latent per token, a single shared "kv head") the value
tile is the transpose of the key tile already loaded, the latent's first V elements.

This module is imported only when the TRITON backend runs (it needs triton). On the CPU
the kernels run under Triton's interpreter, which must be switched on (TRITON_INTERPRET=1)
before the process first imports triton; a few `tl` operations are avoided or worked
around here because the interpreter handles them differently from the compiler.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # a constexpr: jitted code may read only those globals
NO_WINDOW = 1 << 30  # a window no context reaches: one code path with or without sliding window
NO_CHUNK = 1 << 30  # likewise for chunked local attention: every position falls in chunk 0

# fp8 format facts for the interpreter's rounding workaround: mantissa bits, smallest normal, largest finite.
_FP8_FORMATS = {
    torch.float8_e4m3fn: (3, 2.0**-6, 448.0),
    torch.float8_e5m2: (2, 2.0**-14, 57344.0),
}
FP8_DTYPES = tuple(_FP8_FORMATS)

PREFILL_BLOCK_M = 64  # query rows (token x head-in-group) per program
PREFILL_BLOCK_N = 64  # keys per inner iteration
DECODE_BLOCK_N = 64
MIN_DECODE_ROWS = 16  # tl.dot needs at least 16 rows: a decode tile pads the head group to this
# Keys padded past this many elements (MLA's 512 + 64) get smaller tiles, so that a program's
# q, k and v tiles still fit a GPU's shared memory: half the rows and keys per prefill tile,
# half the keys per decode tile, and decode head groups split to at most DECODE_TILE_ELEMS
# q elements per program.
LARGE_KEY_PAD = 256
DECODE_TILE_ELEMS = 8192


# --------------------------------------------------------------------------- device helpers


@triton.jit
def _tanh(x):
    # tl has no tanh that also runs in the interpreter; clamping keeps exp finite (tanh(15) == 1 in fp32).
    x = tl.minimum(tl.maximum(x, -15.0), 15.0)
    e = tl.exp(2.0 * x)
    return (e - 1.0) / (e + 1.0)


@triton.jit
def _round_to_fp8_grid(
    x, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, MAX_FINITE: tl.constexpr, SUBNORMAL_MAGIC: tl.constexpr,
):
    """Round fp32 `x` to the nearest fp8 value (ties to even), saturating like the GPU cast.

    Only used under TRITON_INTERPRET: its fp32->fp8 cast drops the carry when the mantissa
    rounds up (7.9 becomes 4.0), while casting a value already on the fp8 grid is exact.
    """
    x = tl.minimum(tl.maximum(x, -MAX_FINITE), MAX_FINITE)
    bits = x.to(tl.int32, bitcast=True)
    drop: tl.constexpr = 23 - MANTISSA_BITS
    half_minus_one: tl.constexpr = (1 << (drop - 1)) - 1
    keep_mask: tl.constexpr = -(1 << drop)
    rounded = ((bits + half_minus_one + ((bits >> drop) & 1)) & keep_mask).to(tl.float32, bitcast=True)
    # Below the smallest normal the grid is uniform (spacing MIN_NORMAL / 2**MANTISSA_BITS): adding
    # and subtracting SUBNORMAL_MAGIC, a power of two whose fp32 ulp is that spacing, rounds to it.
    ax = tl.abs(x)
    sub = (ax + SUBNORMAL_MAGIC) - SUBNORMAL_MAGIC
    sub = tl.where(x < 0, -sub, sub)
    return tl.where(ax < MIN_NORMAL, sub, rounded)


@triton.jit
def _load_kv_tile(cache_ptr, offsets, mask, scale, out_dtype: tl.constexpr, IS_FP8: tl.constexpr):
    x = tl.load(cache_ptr + offsets, mask=mask, other=0.0)
    if IS_FP8:
        x = (x.to(tl.float32) * scale).to(out_dtype)
    return x


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # IEEE: exact fp32 products. fp32 inputs would default to TF32 on GPUs (the CPU tests
    # compare fp32 exactly), and the interpreter's dot garbles bfloat16, so there bf16
    # operands are widened first (the same products a GPU computes).
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _first_visible(pos, window, chunk):
    """The first key position a query at `pos` sees: the later of its sliding window's start
    (pos - window + 1) and its attention chunk's start (floor(pos / chunk) * chunk, Llama 4's
    local layers). Both grow with `pos`, so a tile's first query bounds the whole tile."""
    return tl.maximum(tl.maximum(pos - window + 1, (pos // chunk) * chunk), 0)


@triton.jit
def _attend_range(
    acc, m_i, l_i, q, q_tail, q_pos, key_cache_ptr, value_cache_ptr, block_table_ptr, kv_head,
    kv_begin, kv_end, sm_scale, k_scale, v_scale, soft_cap, q_lo,
    stride_cache_block, stride_cache_row, stride_cache_head,
    BLOCK_SIZE: tl.constexpr, V_SIZE: tl.constexpr, V_PAD: tl.constexpr, TAIL: tl.constexpr,
    TAIL_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    IS_FP8: tl.constexpr, IEEE_DOT: tl.constexpr, VALUE_IS_KEY: tl.constexpr,
):
    """Fold keys [kv_begin, kv_end) of one request into the online-softmax state (acc, m_i, l_i).

    `q` holds the rows' first V_SIZE key elements, `q_tail` the TAIL after them (unused
    when TAIL is 0). `q_pos` holds each row's absolute position and `q_lo` its first
    visible key (see `_first_visible`); with CAUSAL, row i sees keys in [q_lo, q_pos].
    Without it the caller has already clipped the range (q_pos and q_lo are unused).
    """
    dims = tl.arange(0, V_PAD)
    dim_mask = dims < V_SIZE
    for start in range(kv_begin, kv_end, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < kv_end
        block = tl.load(block_table_ptr + kpos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
        offs = block * stride_cache_block + (kpos % BLOCK_SIZE) * stride_cache_row + kv_head * stride_cache_head
        k = _load_kv_tile(key_cache_ptr, offs[None, :] + dims[:, None], kmask[None, :] & dim_mask[:, None],
                          k_scale, q.dtype, IS_FP8)  # [V_PAD, BLOCK_N]
        s = _dot(q, k, IEEE_DOT)
        if TAIL > 0:
            tail = V_SIZE + tl.arange(0, TAIL_PAD)
            k_tail = _load_kv_tile(key_cache_ptr, offs[None, :] + tail[:, None],
                                   kmask[None, :] & (tail < V_SIZE + TAIL)[:, None], k_scale, q.dtype, IS_FP8)
            s += _dot(q_tail, k_tail, IEEE_DOT)
        s = s * sm_scale
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        s = s * LOG2E
        visible = kmask[None, :]
        if CAUSAL:
            visible = visible & (kpos[None, :] <= q_pos[:, None]) & (kpos[None, :] >= q_lo[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        if VALUE_IS_KEY:
            v = tl.trans(k)  # [BLOCK_N, V_PAD]
        else:
            v = _load_kv_tile(value_cache_ptr, offs[:, None] + dims[None, :], kmask[:, None] & dim_mask[None, :],
                              v_scale, q.dtype, IS_FP8)  # [BLOCK_N, V_PAD]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_DOT)
        m_i = m_new
    return acc, m_i, l_i


# --------------------------------------------------------------------------- kernels


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, k_scale, v_scale,
    stride_key_tok, stride_value_tok, stride_cache_block, stride_cache_row, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_ELEMS: tl.constexpr,
    IS_FP8: tl.constexpr, EMULATE_FP8_ROUNDING: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MAGIC: tl.constexpr,
    WRITE_VALUE: tl.constexpr,
):
    """One program per token: copy its K and V (all kv heads) to its slot; slot < 0 = padding.
    Without WRITE_VALUE only the key is written (an MLA latent; the value pointers are unused)."""
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    offs = tl.arange(0, BLOCK_ELEMS)
    # (a scalar & a vector trips the interpreter's mask check, so padding shrinks the bound instead)
    mask = offs < tl.where(slot >= 0, NUM_KV_HEADS * HEAD_SIZE, 0)
    head = offs // HEAD_SIZE
    dst = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_row \
        + head * stride_cache_head + offs % HEAD_SIZE
    k = tl.load(key_ptr + tok.to(tl.int64) * stride_key_tok + offs, mask=mask, other=0.0)
    if IS_FP8:
        k = k.to(tl.float32) / k_scale
        if EMULATE_FP8_ROUNDING:
            k = _round_to_fp8_grid(k, FP8_MANTISSA_BITS, FP8_MIN_NORMAL, FP8_MAX, FP8_MAGIC)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    if WRITE_VALUE:
        v = tl.load(value_ptr + tok.to(tl.int64) * stride_value_tok + offs, mask=mask, other=0.0)
        if IS_FP8:
            v = v.to(tl.float32) / v_scale
            if EMULATE_FP8_ROUNDING:
                v = _round_to_fp8_grid(v, FP8_MANTISSA_BITS, FP8_MIN_NORMAL, FP8_MAX, FP8_MAGIC)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    req_ids_ptr, sm_scale, k_scale, v_scale, soft_cap, window, chunk,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_cache_block, stride_cache_row, stride_cache_head, stride_bt_req,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, V_SIZE: tl.constexpr, V_PAD: tl.constexpr,
    TAIL: tl.constexpr, TAIL_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, IS_FP8: tl.constexpr, IEEE_DOT: tl.constexpr, VALUE_IS_KEY: tl.constexpr,
):
    """Grid (request, kv head, row tile): a chunk of query tokens that starts after `seq_len -
    query_len` cached tokens, attending causally to the cached prefix and to itself."""
    req = tl.load(req_ids_ptr + tl.program_id(0))
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    ctx_len = tl.load(seq_lens_ptr + req) - q_len

    first_row = tl.program_id(2) * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_mask = tok < q_len
    dims = tl.arange(0, V_PAD)
    io_mask = row_mask[:, None] & (dims < V_SIZE)[None, :]
    q_rows = (q_start + tok).to(tl.int64)
    q_row_ptr = q_ptr + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head
    q = tl.load(q_row_ptr + dims[None, :], mask=io_mask, other=0.0)
    q_tail = q
    if TAIL > 0:
        tail = V_SIZE + tl.arange(0, TAIL_PAD)
        q_tail = tl.load(q_row_ptr + tail[None, :], mask=row_mask[:, None] & (tail < V_SIZE + TAIL)[None, :],
                         other=0.0)
    q_pos = ctx_len + tok
    q_lo = _first_visible(q_pos, window, chunk)

    # Keys this tile can see: up to its last query's position, from its first query's first visible key.
    first_tok = first_row // GROUP
    last_tok = tl.minimum((first_row + BLOCK_M - 1) // GROUP, q_len - 1)
    kv_end = tl.where(first_tok < q_len, ctx_len + last_tok + 1, 0)
    kv_begin = _first_visible(ctx_len + first_tok, window, chunk)

    acc = tl.zeros([BLOCK_M, V_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, q_tail, q_pos, key_cache_ptr, value_cache_ptr,
        block_tables_ptr + req.to(tl.int64) * stride_bt_req, kv_head, kv_begin, kv_end,
        sm_scale, k_scale, v_scale, soft_cap, q_lo,
        stride_cache_block, stride_cache_row, stride_cache_head,
        BLOCK_SIZE, V_SIZE, V_PAD, TAIL, TAIL_PAD, BLOCK_N, True, USE_SOFT_CAP, IS_FP8, IEEE_DOT, VALUE_IS_KEY,
    )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _decode_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, req_ids_ptr,
    sm_scale, k_scale, v_scale, soft_cap, window, chunk,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_cache_block, stride_cache_row, stride_cache_head, stride_bt_req, stride_part_req, stride_part_head,
    GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    V_SIZE: tl.constexpr, V_PAD: tl.constexpr, TAIL: tl.constexpr, TAIL_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, PARTITION_SIZE: tl.constexpr, SINGLE_PARTITION: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, IS_FP8: tl.constexpr, IEEE_DOT: tl.constexpr, VALUE_IS_KEY: tl.constexpr,
):
    """Grid (decode request, kv head x head block, context partition): flash-decoding's first pass.

    The query heads sharing a kv head are the rows of one tile, GROUP_ROWS at a time: a
    group too large for one tile at this head size (MLA: every head shares the latent) is
    split over HEAD_BLOCKS programs.

    Each program folds one PARTITION_SIZE slice of the visible context into a partial
    (unnormalised acc, max, sum) that `_decode_reduce_kernel` merges; with a single
    partition it writes the output directly. Partitions start at the query's first
    visible key (window and chunk start), so none lies wholly before it; those past the
    request's context stay empty (max = -inf, sum = 0) and weigh nothing in the merge.
    """
    i = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    part = tl.program_id(2)
    req = tl.load(req_ids_ptr + i)
    tok = tl.load(query_start_loc_ptr + req).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)
    p_begin = _first_visible(seq_len - 1, window, chunk) + part * PARTITION_SIZE
    p_end = tl.minimum(p_begin + PARTITION_SIZE, seq_len)

    g = head_block * GROUP_ROWS + tl.arange(0, GROUP_ROWS)
    head = kv_head * GROUP + g
    dims = tl.arange(0, V_PAD)
    io_mask = (g < GROUP)[:, None] & (dims < V_SIZE)[None, :]
    q_row_ptr = q_ptr + tok * stride_q_tok + head[:, None] * stride_q_head
    q = tl.load(q_row_ptr + dims[None, :], mask=io_mask, other=0.0)
    q_tail = q
    if TAIL > 0:
        tail = V_SIZE + tl.arange(0, TAIL_PAD)
        q_tail = tl.load(q_row_ptr + tail[None, :], mask=(g < GROUP)[:, None] & (tail < V_SIZE + TAIL)[None, :],
                         other=0.0)

    acc = tl.zeros([GROUP_ROWS, V_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_ROWS], dtype=tl.float32)
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, q_tail, g, key_cache_ptr, value_cache_ptr,
        block_tables_ptr + req.to(tl.int64) * stride_bt_req, kv_head, p_begin, p_end,
        sm_scale, k_scale, v_scale, soft_cap, g,
        stride_cache_block, stride_cache_row, stride_cache_head,
        BLOCK_SIZE, V_SIZE, V_PAD, TAIL, TAIL_PAD, BLOCK_N, False, USE_SOFT_CAP, IS_FP8, IEEE_DOT, VALUE_IS_KEY,
    )
    if SINGLE_PARTITION:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + tok * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        part_idx = i.to(tl.int64) * stride_part_req + head * stride_part_head + part
        tl.store(part_max_ptr + part_idx, m_i, mask=g < GROUP)
        tl.store(part_sum_ptr + part_idx, l_i, mask=g < GROUP)
        tl.store(part_acc_ptr + part_idx[:, None] * V_PAD + dims[None, :], acc, mask=io_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, query_start_loc_ptr, req_ids_ptr, num_partitions,
    stride_o_tok, stride_o_head, stride_part_req, stride_part_head,
    V_SIZE: tl.constexpr, V_PAD: tl.constexpr, PART_PAD: tl.constexpr,
):
    """Grid (decode request, query head): merge the partitions' partial softmax states."""
    i = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.load(query_start_loc_ptr + tl.load(req_ids_ptr + i)).to(tl.int64)
    parts = tl.arange(0, PART_PAD)
    pmask = parts < num_partitions
    idx = i.to(tl.int64) * stride_part_req + head * stride_part_head + parts
    m = tl.load(part_max_ptr + idx, mask=pmask, other=float("-inf"))
    l = tl.load(part_sum_ptr + idx, mask=pmask, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # partition 0 is never empty, so the max is finite
    dims = tl.arange(0, V_PAD)
    acc = tl.load(part_acc_ptr + idx[:, None] * V_PAD + dims[None, :], mask=pmask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < V_SIZE)


# --------------------------------------------------------------------------- launchers


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


def _pow2_floor(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def _cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    if cache.stride(-1) != 1:
        raise ValueError("the KV cache's head dimension must be contiguous")
    return cache.stride(0), cache.stride(1), cache.stride(2)


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, dim] with dim contiguous and heads packed (token stride free), as kernels index."""
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x = x.contiguous()
    return x


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor | None, key: torch.Tensor,
             value: torch.Tensor | None, slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """Store `key`/`value` [tokens, kv_heads, dim] at their slots (divided by the scale for FP8).
    With `value_cache` and `value` None only the key is written (an MLA latent cache)."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    write_value = value is not None
    key = _heads_contiguous(key)
    value = _heads_contiguous(value) if write_value else key
    value_cache = value_cache if write_value else key_cache
    is_fp8 = key_cache.dtype in FP8_DTYPES
    mantissa, min_normal, max_finite = _FP8_FORMATS.get(key_cache.dtype, (3, 1.0, 1.0))
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, float(k_scale), float(v_scale),
        key.stride(0), value.stride(0), *_cache_strides(key_cache),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, BLOCK_SIZE=key_cache.shape[1],
        BLOCK_ELEMS=_pow2(num_kv_heads * head_size),
        IS_FP8=is_fp8, EMULATE_FP8_ROUNDING=is_fp8 and key_cache.device.type == "cpu",
        FP8_MANTISSA_BITS=mantissa, FP8_MIN_NORMAL=min_normal, FP8_MAX=max_finite,
        FP8_MAGIC=min_normal * 2.0 ** (23 - mantissa), WRITE_VALUE=write_value, num_warps=4,
    )


def _common(q: torch.Tensor, out: torch.Tensor, key_cache: torch.Tensor, window: int | None,
            soft_cap: float | None, value_is_key: bool, chunk: int | None) -> tuple[dict, tuple[float, int, int]]:
    """Constexprs shared by prefill and decode, and the runtime (soft_cap, window, chunk) with
    "off" values. The value size is out's head size; the key's tail is what q has beyond it."""
    value_size, tail = out.shape[-1], q.shape[-1] - out.shape[-1]
    if tail < 0:
        raise ValueError(f"the value size {value_size} exceeds the key size {q.shape[-1]}")
    return dict(
        V_SIZE=value_size, V_PAD=_pow2(value_size, 16), TAIL=tail, TAIL_PAD=_pow2(tail, 16),
        BLOCK_SIZE=key_cache.shape[1], USE_SOFT_CAP=bool(soft_cap), IS_FP8=key_cache.dtype in FP8_DTYPES,
        IEEE_DOT=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and q.device.type == "cpu"),
        VALUE_IS_KEY=value_is_key,
    ), (float(soft_cap or 1.0), int(window or NO_WINDOW), int(chunk or NO_CHUNK))


def _key_pad(consts: dict) -> int:
    """Elements of one padded key row (its value part and its tail)."""
    return consts["V_PAD"] + (consts["TAIL_PAD"] if consts["TAIL"] else 0)


def prefill_tiles(key_pad: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the prefill kernel for keys of `key_pad` padded elements."""
    if key_pad > LARGE_KEY_PAD:
        return PREFILL_BLOCK_M // 2, PREFILL_BLOCK_N // 2, 8
    return PREFILL_BLOCK_M, PREFILL_BLOCK_N, 4


def decode_tiles(group: int, key_pad: int) -> tuple[int, int, int]:
    """(GROUP_ROWS, HEAD_BLOCKS, BLOCK_N) of the decode kernel: query heads per program (at
    most DECODE_TILE_ELEMS q elements, at least the 16 rows tl.dot needs), programs per kv
    head, and keys per tile."""
    rows = min(_pow2(group, MIN_DECODE_ROWS), max(MIN_DECODE_ROWS, _pow2_floor(DECODE_TILE_ELEMS // key_pad)))
    block_n = DECODE_BLOCK_N // 2 if key_pad > LARGE_KEY_PAD else DECODE_BLOCK_N
    return rows, triton.cdiv(group, rows), block_n


def prefill_attention(
    out: torch.Tensor, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, req_ids: torch.Tensor,
    max_query_len: int, scale: float, k_scale: float, v_scale: float,
    window: int | None = None, soft_cap: float | None = None, value_is_key: bool = False,
    attention_chunk_size: int | None = None,
) -> None:
    """Causal attention for the requests `req_ids` (int32, on device) over their paged context.
    out: [tokens, heads, value size]; q: [tokens, heads, key size]; `value_is_key`: values are
    the keys' first value-size elements (MLA; `value_cache` is then not read). A query at
    position p sees keys from max(p - window + 1, floor(p / C) * C) to p, C the chunk size."""
    num_reqs = req_ids.shape[0]
    if num_reqs == 0:
        return
    q = _heads_contiguous(q)
    num_kv_heads = key_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    consts, (cap, win, chunk) = _common(q, out, key_cache, window, soft_cap, value_is_key, attention_chunk_size)
    block_m, block_n, num_warps = prefill_tiles(_key_pad(consts))
    grid = (num_reqs, num_kv_heads, triton.cdiv(max_query_len * group, block_m))
    _prefill_kernel[grid](
        out, q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, req_ids,
        float(scale), float(k_scale), float(v_scale), cap, win, chunk,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *_cache_strides(key_cache), block_tables.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=2, **consts,
    )


def decode_partition_size(num_decodes: int, num_kv_heads: int, max_context: int, target_programs: int) -> int:
    """Tokens per decode partition: halve from 1024 until the grid has `target_programs`
    programs (or a partition is one key tile), so small batches with long contexts still
    fill the GPU while large batches skip the merge pass."""
    size = 1024
    while size > DECODE_BLOCK_N and num_decodes * num_kv_heads * math.ceil(max_context / size) < target_programs:
        size //= 2
    return size


def decode_attention(
    out: torch.Tensor, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, req_ids: torch.Tensor,
    max_context: int, partition_size: int, scale: float, k_scale: float, v_scale: float,
    window: int | None = None, soft_cap: float | None = None, value_is_key: bool = False,
    attention_chunk_size: int | None = None,
) -> None:
    """One query token per request in `req_ids`; `max_context` bounds the visible keys
    (min(seq_len, window, attention_chunk_size)) over those requests, which sets the number
    of partitions. Shapes, `value_is_key` and the visible keys as in `prefill_attention`."""
    num_reqs = req_ids.shape[0]
    if num_reqs == 0:
        return
    q = _heads_contiguous(q)
    num_heads, num_kv_heads = q.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    consts, (cap, win, chunk) = _common(q, out, key_cache, window, soft_cap, value_is_key, attention_chunk_size)
    rows, head_blocks, block_n = decode_tiles(group, _key_pad(consts))
    num_parts = triton.cdiv(max_context, partition_size)
    single = num_parts == 1
    if single:  # the partial buffers are compiled out; `out` stands in for them
        part_acc = part_max = part_sum = out
    else:
        part_max = torch.empty((num_reqs, num_heads, num_parts), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty((num_reqs, num_heads, num_parts, consts["V_PAD"]), dtype=torch.float32,
                               device=q.device)
    stride_req, stride_head = num_heads * num_parts, num_parts
    _decode_kernel[(num_reqs, num_kv_heads * head_blocks, num_parts)](
        out, part_acc, part_max, part_sum, q, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
        req_ids, float(scale), float(k_scale), float(v_scale), cap, win, chunk,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *_cache_strides(key_cache), block_tables.stride(0),
        stride_req, stride_head,
        GROUP=group, GROUP_ROWS=rows, HEAD_BLOCKS=head_blocks, BLOCK_N=block_n, PARTITION_SIZE=partition_size,
        SINGLE_PARTITION=single, num_warps=4, **consts,
    )
    if not single:
        _decode_reduce_kernel[(num_reqs, num_heads)](
            out, part_acc, part_max, part_sum, query_start_loc, req_ids, num_parts,
            out.stride(0), out.stride(1), stride_req, stride_head,
            V_SIZE=consts["V_SIZE"], V_PAD=consts["V_PAD"], PART_PAD=_pow2(num_parts),
            num_warps=4,
        )
