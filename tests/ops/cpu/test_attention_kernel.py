"""The paged KV-cache kernels (csrc/attention.c: pd_write_kv, pd_paged_attention)
through native.write_kv / paged_attention, against torch indexing and a straightforward
float64 gather-then-softmax. Every test runs on both builds (conftest.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from pagedllm.ops.cpu import native

from kernel_checks import assert_close_to, require_native

require_native()
pytestmark = pytest.mark.usefixtures("build")


# ------------------------------------------------------------------ write_kv

def test_write_kv_from_strided_token_rows():
    """k and v as the model passes them: column slices of the fused qkv output."""
    gen = torch.Generator().manual_seed(11)
    t, h, kvh, d, num_blocks, bs = 9, 4, 2, 20, 5, 16
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen)
    k = qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
    assert not k.is_contiguous() and k.stride(0) == (h + 2 * kvh) * d
    key_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen)
    value_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:t]
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    expected_k.view(-1, kvh, d)[slots] = k
    expected_v.view(-1, kvh, d)[slots] = v
    native.write_kv(k, v, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k), "write_kv: keys not at their slots (or other slots changed)"
    assert torch.equal(value_cache, expected_v), "write_kv: values not at their slots (or other slots changed)"


def test_write_kv_rejects_what_it_cannot_copy():
    k = torch.randn(3, 2, 8)
    cache = torch.zeros(2, 16, 2, 8)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="^k:"):
        native.write_kv(k.transpose(1, 2).contiguous().transpose(1, 2), k, cache[0], cache[1], slots)
    with pytest.raises(ValueError, match="^slots:"):
        native.write_kv(k, k, cache[0], cache[1], slots.to(torch.int32))
    with pytest.raises(ValueError, match="^v:"):
        native.write_kv(k, k.double(), cache[0], cache[1], slots)


# ------------------------------------------------------------------ paged_attention

class PagedCase:
    """Requests of (cached tokens, new tokens) over a shuffled paged cache; q rows laid
    out request after request (q a column slice of a wider qkv tensor, like the model's)."""

    def __init__(self, requests, num_heads, num_kv_heads, head_size, block_size, seed):
        gen = torch.Generator().manual_seed(seed)
        self.requests, self.h, self.kvh, self.d, self.bs = requests, num_heads, num_kv_heads, head_size, block_size
        seq_lens = [c + n for c, n in requests]
        blocks_needed = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(blocks_needed) + 3
        pool = torch.randperm(num_blocks, generator=gen).tolist()
        poison = pool.pop()  # a NaN block behind every table's spare columns: reading past seq_len shows
        width = max(blocks_needed) + 2
        self.block_tables = torch.full((len(requests), width), poison, dtype=torch.int32)
        for r, nb in enumerate(blocks_needed):
            self.block_tables[r, :nb] = torch.tensor([pool.pop() for _ in range(nb)], dtype=torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.q_lens = [n for _, n in requests]
        self.row_of = [sum(self.q_lens[:r]) for r in range(len(requests))]
        self.num_tokens = sum(self.q_lens)
        qkv = torch.randn(self.num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=gen)
        self.q = qkv[:, :num_heads * head_size].view(self.num_tokens, num_heads, head_size)
        self.key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen)
        self.value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen)
        self.key_cache[poison] = float("nan")
        self.value_cache[poison] = float("nan")

    def run(self, reqs, out, scale, window=0, soft_cap=0.0):
        """native.paged_attention over the requests `reqs` only (in that order)."""
        lens = torch.tensor([self.q_lens[r] for r in reqs], dtype=torch.int32)
        query_start = torch.zeros(len(reqs) + 1, dtype=torch.int32)
        query_start[1:] = torch.cumsum(lens, 0)
        row_start = torch.tensor([self.row_of[r] for r in reqs], dtype=torch.int32)
        seq_lens = self.seq_lens[reqs].contiguous()
        native.paged_attention(self.q, self.key_cache, self.value_cache, self.block_tables[reqs].contiguous(),
                               seq_lens, query_start, row_start, out, scale, window, soft_cap)

    def reference(self, r, scale, window=0, soft_cap=0.0) -> torch.Tensor:
        """float64 attention of request r's query rows: [q_len, H, D]."""
        seq_len, q_len, g = int(self.seq_lens[r]), self.q_lens[r], self.h // self.kvh
        pos = torch.arange(seq_len)
        slots = self.block_tables[r, pos // self.bs].long() * self.bs + pos % self.bs
        k = self.key_cache.reshape(-1, self.kvh, self.d)[slots].double().repeat_interleave(g, dim=1)
        v = self.value_cache.reshape(-1, self.kvh, self.d)[slots].double().repeat_interleave(g, dim=1)
        q = self.q[self.row_of[r]:self.row_of[r] + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = seq_len - q_len + torch.arange(q_len)
        mask = pos[None, :] <= q_pos[:, None]
        if window:
            mask &= pos[None, :] > q_pos[:, None] - window
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v)

    def rows(self, r) -> slice:
        return slice(self.row_of[r], self.row_of[r] + self.q_lens[r])


# decodes, a 20-token chunk from position 0, chunks after a cached prefix (one ending on
# a block edge), a first-token decode and a long decode; max seq_len 131 is odd
MIXED = [(37, 1), (0, 20), (50, 9), (0, 1), (130, 1), (16, 16)]
ATTN_OPTIONS = {
    "plain": dict(),
    "window": dict(window=24),
    "window-1": dict(window=1),
    "soft-cap": dict(soft_cap=5.0, sharp=True),
    "window-and-cap": dict(window=40, soft_cap=3.0, sharp=True),
}
# every (group, head size, block size) plain; each window / soft-cap option on three of them
SHAPES = [(g, d, b) for g in (1, 2, 3, 4, 5) for d in (64, 128, 20) for b in (16, 32)] + [(7, 64, 16), (9, 64, 16)]
ATTN_CASES = [pytest.param(*shape, "plain", id=f"G{shape[0]}-D{shape[1]}-B{shape[2]}-plain") for shape in SHAPES] + [
    pytest.param(*shape, option, id=f"G{shape[0]}-D{shape[1]}-B{shape[2]}-{option}")
    for option in ("window", "window-1", "soft-cap", "window-and-cap")
    for shape in ((1, 20, 32), (3, 128, 16), (4, 64, 32))
]


@pytest.mark.parametrize("group, head_size, block_size, option", ATTN_CASES)
def test_paged_attention_matches_float64(group, head_size, block_size, option):
    options = dict(ATTN_OPTIONS[option])
    sharp = options.pop("sharp", False)
    kvh = 2
    case = PagedCase(MIXED, group * kvh, kvh, head_size, block_size, seed=group * 1000 + head_size + block_size)
    # sharp: scale 1 makes raw scores ~sqrt(D), so the soft cap really bends them
    scale = 1.0 if sharp else head_size**-0.5
    out = torch.full((case.num_tokens, case.h, case.d), float("nan"))
    case.run(list(range(len(MIXED))), out, scale, **options)
    for r, (cached, new) in enumerate(MIXED):
        expected = case.reference(r, scale, **options)
        assert_close_to(out[case.rows(r)], expected, 1e-5 + 1e-5 * expected.abs(),
                        f"request {r} (cached {cached}, new {new}), G={group} D={head_size} "
                        f"block {block_size} {option}")


@pytest.mark.parametrize("head_size", [80, 8])
def test_paged_attention_head_sizes_around_the_vector_width(head_size):
    """80 = one 64-wide vector pass + a scalar tail; 8 = one vector of keys per dot."""
    case = PagedCase(MIXED, 4, 1, head_size, 16, seed=head_size)
    out = torch.full((case.num_tokens, case.h, case.d), float("nan"))
    case.run(list(range(len(MIXED))), out, head_size**-0.5)
    for r in range(len(MIXED)):
        expected = case.reference(r, head_size**-0.5)
        assert_close_to(out[case.rows(r)], expected, 1e-5 + 1e-5 * expected.abs(), f"request {r}, D={head_size}")


@pytest.mark.parametrize("reqs", [[0, 2], [2, 0], [5, 1, 4]], ids=["0-2", "2-0", "5-1-4"])
def test_paged_attention_on_a_subset_of_the_batch(reqs):
    """row_start is not query_start[:-1]: only the chosen requests' rows are written."""
    case = PagedCase(MIXED, 6, 2, 64, 16, seed=5)
    sentinel = 777.0
    out = torch.full((case.num_tokens, case.h, case.d), sentinel)
    case.run(reqs, out, 0.125, window=30)
    for r in range(len(MIXED)):
        if r in reqs:
            expected = case.reference(r, 0.125, window=30)
            assert_close_to(out[case.rows(r)], expected, 1e-5 + 1e-5 * expected.abs(),
                            f"request {r} of subset {reqs}")
        else:
            assert (out[case.rows(r)] == sentinel).all(), \
                f"rows of request {r} (not in subset {reqs}) were overwritten"


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_paged_attention_splits_work_either_way_alike(bf16):
    """Few query rows split the work by (row, kv head), many by row with every kv head in
    one item (whole cache slots read at once): each request alone (1-20 rows) must get
    exactly what it gets inside the whole 48-row batch."""
    if bf16 and not native.bf16_kv_available():
        pytest.skip("no bf16-cache kernels in this build")
    case = PagedCase(MIXED, 9, 3, 64, 16, seed=11)
    if bf16:
        case.key_cache, case.value_cache = case.key_cache.bfloat16(), case.value_cache.bfloat16()
    together = torch.full((case.num_tokens, case.h, case.d), float("nan"))
    case.run(list(range(len(MIXED))), together, 0.125)
    for r in range(len(MIXED)):
        alone = torch.full((case.num_tokens, case.h, case.d), float("nan"))
        case.run([r], alone, 0.125)
        assert torch.equal(alone[case.rows(r)], together[case.rows(r)]), \
            f"request {r} ({MIXED[r][1]} rows) differs alone and in the batch"


# prefill chunks the kernel takes by tiles of 16 query rows (where native.attention_tiles):
# several tiles with a partial last one, a chunk after a long cached prefix (its first tile
# starts mid-block), exactly one tile, four whole tiles, and decode rows beside them
TILED = [(0, 37), (100, 33), (5, 16), (0, 64), (20, 1), (3, 2)]


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
@pytest.mark.parametrize(("group", "head_size", "block_size", "window"),
                         [(1, 64, 16, 0), (3, 64, 16, 0), (5, 128, 32, 0), (2, 48, 16, 0), (3, 64, 16, 24),
                          (4, 64, 32, 1), (1, 16, 16, 40), (2, 80, 16, 0)])
def test_paged_attention_prefill_tiles_match_float64(bf16, group, head_size, block_size, window):
    """The tiles' online softmax (running max and sum over 16-key chunks, causal and window
    masks per lane) against float64, within float32 error."""
    if not native.attention_tiles(head_size, group):
        pytest.skip("this build attends row at a time (no 512-bit path)")
    case = PagedCase(TILED, group * 2, 2, head_size, block_size, seed=group * 100 + head_size + window)
    if bf16:
        case.key_cache, case.value_cache = case.key_cache.bfloat16(), case.value_cache.bfloat16()
    scale = head_size**-0.5
    out = torch.full((case.num_tokens, case.h, case.d), float("nan"))
    case.run(list(range(len(TILED))), out, scale, window=window)
    for r, (cached, new) in enumerate(TILED):
        expected = case.reference(r, scale, window=window)
        assert_close_to(out[case.rows(r)], expected, 1e-5 + 1e-5 * expected.abs(),
                        f"tiles: request {r} (cached {cached}, new {new}), G={group} D={head_size} "
                        f"block {block_size} window {window} {'bf16' if bf16 else 'float32'}")


def test_paged_attention_prefill_tiles_do_not_depend_on_the_batch():
    """A tiled chunk alone equals itself beside decodes and other chunks (each tile is one
    work item whoever else is in the step)."""
    if not native.attention_tiles(64, 3):
        pytest.skip("this build attends row at a time (no 512-bit path)")
    case = PagedCase(TILED, 6, 2, 64, 16, seed=5)
    together = torch.full((case.num_tokens, case.h, case.d), float("nan"))
    case.run(list(range(len(TILED))), together, 0.125)
    for r in range(len(TILED)):
        alone = torch.full((case.num_tokens, case.h, case.d), float("nan"))
        case.run([r], alone, 0.125)
        assert torch.equal(alone[case.rows(r)], together[case.rows(r)]), f"request {r} differs alone and in the batch"


def test_attention_tiles_need_the_512_bit_path_and_16s():
    if not native.bf16_kv_available():
        assert not native.attention_tiles(64, 3), "tiles claimed by a build without the 512-bit path"
        return
    assert native.attention_tiles(64, 3) and native.attention_tiles(128, 16)
    assert not native.attention_tiles(72, 2), "head size 72 is not a multiple of 16"
    assert not native.attention_tiles(64, 17), "more than 16 query heads per kv head"


def test_paged_attention_skips_requests_without_query_rows():
    """A request with q_len 0 in the middle of the list (its running count does not move)."""
    requests = [(20, 3), (40, 0), (0, 5), (9, 1)]
    case = PagedCase(requests, 4, 2, 64, 16, seed=9)
    out = torch.full((case.num_tokens, case.h, case.d), float("nan"))
    case.run([0, 1, 2, 3], out, 0.125)
    for r in (0, 2, 3):
        expected = case.reference(r, 0.125)
        assert_close_to(out[case.rows(r)], expected, 1e-5 + 1e-5 * expected.abs(), f"request {r} of {requests}")


def test_paged_attention_rejects_wrong_dtypes():
    case = PagedCase([(3, 2)], 2, 1, 16, 16, seed=1)
    out = torch.empty(case.num_tokens, 2, 16)
    with pytest.raises(ValueError, match="^q:"):
        native.paged_attention(case.q.double(), case.key_cache, case.value_cache, case.block_tables,
                               case.seq_lens, torch.tensor([0, 2], dtype=torch.int32),
                               torch.tensor([0], dtype=torch.int32), out, 0.25, 0, 0.0)
    with pytest.raises(ValueError, match="^block_tables:"):
        native.paged_attention(case.q, case.key_cache, case.value_cache, case.block_tables.long(),
                               case.seq_lens, torch.tensor([0, 2], dtype=torch.int32),
                               torch.tensor([0], dtype=torch.int32), out, 0.25, 0, 0.0)


def test_paged_attention_rejects_bad_lengths_and_layouts():
    case = PagedCase([(3, 2)], 2, 1, 16, 16, seed=2)  # one request: seq_len 5, 2 query rows
    query_start, row_start = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)

    def call(q=case.q, seq_lens=case.seq_lens, out=None, block_tables=case.block_tables):
        out = torch.empty(case.num_tokens, 2, 16) if out is None else out
        native.paged_attention(q, case.key_cache, case.value_cache, block_tables, seq_lens, query_start,
                               row_start, out, 0.25, 0, 0.0)

    call()  # the arguments below differ from these in one thing each
    capacity = case.block_tables.shape[1] * 16
    with pytest.raises(ValueError, match="longer than its block-table row"):
        call(seq_lens=torch.tensor([capacity + 1], dtype=torch.int32))  # would read past the table row
    with pytest.raises(ValueError, match="^block_tables:"):
        call(block_tables=case.block_tables.flatten())  # no row per request
    with pytest.raises(ValueError, match="shorter than its query"):
        call(seq_lens=torch.tensor([1], dtype=torch.int32))  # 2 query rows in a 1-token sequence
    with pytest.raises(ValueError, match="^q:"):
        call(q=case.q.half())
    with pytest.raises(ValueError, match="^q:"):
        call(q=case.q.contiguous().transpose(1, 2).contiguous().transpose(1, 2))  # head_dim not unit-stride
    with pytest.raises(ValueError, match="^q:"):
        call(q=torch.randn(case.num_tokens, 2, 32)[..., :16])  # heads not adjacent within a row
    with pytest.raises(ValueError, match="^out:"):
        call(out=torch.empty(case.num_tokens, 2, 8))
    with pytest.raises(ValueError, match="^out:"):
        call(out=torch.empty(case.num_tokens, 3, 16))
    with pytest.raises(ValueError, match="^out:"):
        call(out=torch.empty(case.num_tokens, 16, 2).transpose(1, 2))  # not contiguous
    with pytest.raises(ValueError, match="^out:"):
        call(out=torch.empty(case.num_tokens, 2, 16, dtype=torch.float64))


# ------------------------------------------------------------------ bf16 cache

def needs_bf16_kv(test):
    """Run `test` only on a build with the bf16-cache kernels (asked at run time: the
    portable build has none)."""
    def run(*args, **kwargs):
        if not native.bf16_kv_available():
            pytest.skip("no bf16-cache kernels in this build")
        return test(*args, **kwargs)
    return functools.wraps(test)(run)


@needs_bf16_kv
def test_write_kv_rounds_into_a_bf16_cache():
    gen = torch.Generator().manual_seed(12)
    t, kvh, d, num_blocks, bs = 7, 2, 32, 4, 16
    k, v = torch.randn(t, kvh, d, generator=gen), torch.randn(t, kvh, d, generator=gen)
    key_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen).bfloat16()
    value_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen).bfloat16()
    slots = torch.randperm(num_blocks * bs, generator=gen)[:t]
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    expected_k.view(-1, kvh, d)[slots] = k.bfloat16()
    expected_v.view(-1, kvh, d)[slots] = v.bfloat16()
    native.write_kv(k, v, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k), "write_kv: bf16 keys not torch's rounding at their slots"
    assert torch.equal(value_cache, expected_v), "write_kv: bf16 values not torch's rounding at their slots"


@needs_bf16_kv
@pytest.mark.parametrize("group, head_size, option", [(3, 64, "plain"), (1, 128, "window"), (4, 16, "soft-cap"),
                                                      (2, 80, "window-and-cap")])
def test_paged_attention_on_a_bf16_cache(group, head_size, option):
    """A bf16 cache attends exactly as float32 would over the same (bf16) values: the
    kernel widens each value as it loads and computes the rest in float32."""
    options = dict(ATTN_OPTIONS[option])
    sharp = options.pop("sharp", False)
    case = PagedCase(MIXED, group * 2, 2, head_size, 16, seed=head_size + group)
    case.key_cache, case.value_cache = case.key_cache.bfloat16(), case.value_cache.bfloat16()
    scale = 1.0 if sharp else head_size**-0.5
    out = torch.full((case.num_tokens, case.h, case.d), float("nan"))
    case.run(list(range(len(MIXED))), out, scale, **options)
    for r, (cached, new) in enumerate(MIXED):
        expected = case.reference(r, scale, **options)  # float64 over the bf16 values
        assert_close_to(out[case.rows(r)], expected, 1e-5 + 1e-5 * expected.abs(),
                        f"bf16 cache: request {r} (cached {cached}, new {new}), G={group} D={head_size} {option}")


@needs_bf16_kv
def test_bf16_cache_needs_a_head_size_of_16s():
    case = PagedCase([(3, 2)], 2, 1, 24, 16, seed=2)
    out = torch.empty(case.num_tokens, 2, 24)
    with pytest.raises(ValueError, match="no bf16-cache kernel for head size 24"):
        native.paged_attention(case.q, case.key_cache.bfloat16(), case.value_cache.bfloat16(), case.block_tables,
                               case.seq_lens, torch.tensor([0, 2], dtype=torch.int32),
                               torch.tensor([0], dtype=torch.int32), out, 0.25, 0, 0.0)
    with pytest.raises(ValueError, match="both float32 or both bf16"):
        native.paged_attention(case.q, case.key_cache.bfloat16(), case.value_cache, case.block_tables,
                               case.seq_lens, torch.tensor([0, 2], dtype=torch.int32),
                               torch.tensor([0], dtype=torch.int32), out, 0.25, 0, 0.0)
