"""GGUF linear and embedding weights: raw ggml blocks, with or without a dense copy.

`GGUFFormat.weights()` yields each quantized linear or embedding weight as a uint8 tensor
[rows, bytes_per_row] tagged with `gguf_qtype` (see `tag_raw`). A fused layer (qkv,
gate_up) receives one GGUF tensor per shard, possibly of different types (Q4_K_M files
store v in Q6_K and q/k in Q4_K), so the loader keeps shards apart until
`process_after_loading` joins neighbours of equal type into one group.

Two modes (`GGUFConfig.keep_dense`):

* default: the blocks are dequantized once into a dense float weight (large batches run
  one GEMM on it), and the blocks stay too where the native CPU kernels read their type:
  small batches (decode) multiply straight from the blocks, reading 4-8x fewer bytes.
* `--gguf-keep-quantized`: no dense copy (memory stays at the file's size); the native
  kernels serve every batch size, and types they do not read are dequantized per call.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import ops
from pagedllm.core import precision
from pagedllm.core.contracts import EmbeddingMethod, LinearMethod, MoEMethod, QuantConfig
from pagedllm.ops.cpu import crossover, dense as dense_kernels, native
from pagedllm.plugins.quant import gguf_blocks32, gguf_int4, gguf_vnni
from pagedllm.plugins.quant.gguf_dequant import dequantize
from pagedllm.plugins.quant.gguf_file import Q8_0 as GGML_Q8_0, check_supported, type_name

logger = logging.getLogger("pagedllm")


def tag_raw(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """Mark a uint8 [rows, bytes_per_row] tensor (stacked experts: [E, rows,
    bytes_per_row]) as ggml blocks of type `qtype`.

    The tag is a plain attribute: the worker passes non-float tensors through untouched,
    and `GGUFLinearMethod`'s loader is the only reader.
    """
    raw.gguf_qtype = qtype  # type: ignore[attr-defined]
    return raw


def raw_num_cols(raw: torch.Tensor, qtype: int) -> int:
    block_size, type_size = check_supported(qtype, "tensor")
    return raw.shape[-1] // type_size * block_size


def num_cols(loaded: torch.Tensor, qtype: int | None) -> int:
    """Values per row of a loaded tensor: its last dim if float, else what its blocks decode to."""
    return loaded.shape[-1] if qtype is None else raw_num_cols(loaded, qtype)


def group_by_type(shards: Sequence[tuple[int | None, torch.Tensor]]) -> list[tuple[int | None, list[torch.Tensor]]]:
    """Neighbouring (type, tensor) shards of one ggml type joined into one group, so that
    each group is one kernel call (q/k/v or gate/up of one type)."""
    groups: list[tuple[int | None, list[torch.Tensor]]] = []
    for qtype, tensor in shards:
        if groups and groups[-1][0] == qtype:
            groups[-1][1].append(tensor)
        else:
            groups.append((qtype, [tensor]))
    return groups


# With a dense copy, batches below a measured row count multiply straight from the
# blocks (crossover.py, once per layer shape at load): streaming 4-bit blocks beats a
# float32 GEMM for few rows (SmolLM2's shapes on AVX2, 2 threads: 1.3-2.3x at 1-4 rows,
# about half the GEMM's speed at 32), while on AMX the bf16 GEMM wins from 2-4 rows.


def _native_ok(qtypes: Sequence[int | None], input_size: int, device: torch.device) -> bool:
    return (device.type == "cpu" and input_size % 32 == 0 and native.available()
            and all(q in native.SUPPORTED_QTYPES for q in qtypes))


def _may_round_blocks() -> bool:
    """Whether weights may be rewritten with a bounded rounding (gguf_blocks32.py), and the
    few-row kernels round activations (VNNI's block integers): under "medium" float32 matmul
    precision, where bf16 products are allowed too (on CPUs that multiply bf16 in hardware)."""
    return precision.float32_matmul_precision() == "medium"


def _native_groups(groups: Sequence[tuple[int | None, torch.Tensor]], input_size: int, device: torch.device,
                   values: Sequence[torch.Tensor] | None = None) -> list[tuple[int, torch.Tensor]] | None:
    """The (type, blocks) groups the native kernels will read, or None where they read none.

    Types they read are kept; under "medium" float32 matmul precision (`--dtype auto` on
    quantized weights, where bf16 products are allowed too) K-quants and Q5 types are
    rewritten as Q4_1 / Q8_0 blocks (gguf_blocks32.py: a bounded rounding), so decode steps
    of the common Q4_K_M files stream 4-8-bit blocks instead of the dense copy. `values`:
    each group's exact float32 dequantization, where the caller made one (the dense copy)."""
    qtypes = [q for q, _ in groups]
    targets = [None if q is None else gguf_blocks32.target_type(q) for q in qtypes]
    if not _native_ok(targets, input_size, device) or (targets != qtypes and not _may_round_blocks()):
        return None
    if targets != qtypes:
        logger.debug("GGUF %s blocks read by the native kernels as %s", "+".join(map(type_name, qtypes)),
                     "+".join(map(type_name, targets)))
    return [gguf_blocks32.as_native_blocks(raw, q, input_size, None if values is None else values[i])
            for i, (q, raw) in enumerate(groups)]  # types the kernels read come back as they are


def _takes_native(layer: nn.Module, x: torch.Tensor, rows: int) -> bool:
    """Whether this call multiplies from the blocks (the native kernel's repacking, or the
    small-batch kernel that beat it): always without a dense copy (they are all there is:
    activations of another dtype go through float32), else for float32 batches below
    `layer.gguf_native_below` rows."""
    if not layer.gguf_packed and layer.gguf_small is None:
        return False
    return not layer.gguf_has_dense or (x.dtype == torch.float32 and rows < layer.gguf_native_below)


def _takes_tiles(layer: nn.Module, x: torch.Tensor, rows: int) -> bool:
    """Whether this call multiplies from the quantized tiles: float32 batches in their measured range."""
    return layer.gguf_tiles is not None and x.dtype == torch.float32 and \
        layer.gguf_native_below <= rows < layer.gguf_tiles_below


def _vnni_candidate(blocks: Sequence[tuple[int, torch.Tensor]], source: Sequence[tuple[int | None, torch.Tensor]],
                    k: int):
    """The VNNI kernel on `blocks` (the 32-value blocks the native kernel reads, or groups
    VNNI reads as stored)."""
    if not gguf_vnni.available() or not all(native.vnni_reads(q, k) for q, _ in blocks):
        return None
    return gguf_vnni.VnniLinear(blocks, k, int8=gguf_vnni.int8_activations())


def _vnni_stored_candidate(blocks: Sequence[tuple[int, torch.Tensor]],
                           source: Sequence[tuple[int | None, torch.Tensor]], k: int):
    """The VNNI kernel on the file's own Q4_K blocks (4.625 bits per weight) where the native
    kernel reads their Q4_1 rewrite (5 bits); the other groups of a fused layer (Q4_K_M's v
    projection is Q6_K) as the native kernel reads them. None where no group is Q4_K.

    Why a contest of its own: fewer bytes are not always faster (a Q6_K layout as stored,
    6.6 bits against Q8_0's 8.5, was compute-bound and slower on a 2-core Zen 4, see
    csrc/vnni.c); Q4_K as stored streamed a 17920 x 1536 layer at one row in 448 us
    against 531 for Q4_1 there."""
    groups = [own if own[0] is not None and own[0] != rewritten[0] and native.vnni_reads(own[0], k) else rewritten
              for own, rewritten in zip(source, blocks)]
    if all(group is rewritten for group, rewritten in zip(groups, blocks)):
        return None
    return _vnni_candidate(groups, source, k)


def _int4_candidate(blocks: Sequence[tuple[int, torch.Tensor]], source: Sequence[tuple[int | None, torch.Tensor]],
                    k: int):
    if len(blocks) != 1 or blocks[0][0] not in gguf_int4.QTYPES or not gguf_int4.available() or \
            not dense_kernels.bf16_products_allowed():
        return None  # its activations are bf16: only where the CPU multiplies bf16 in hardware
    return gguf_int4.Int4Weight(blocks[0][1], blocks[0][0], k)


# Tried in order against the kernel chosen so far, each under its kernel's name (a str, or a
# function giving it now: VNNI's names say whether it rounds activations to int8); each reads
# the blocks at bf16-level accuracy (its activations are rounded; int8 only where asked for),
# so only under "medium" matmul precision. Each maker takes (blocks the native kernel reads,
# the file's own groups, K).
_SMALL_CANDIDATES = ((gguf_vnni.kind, _vnni_candidate), (lambda: gguf_vnni.kind() + "_k", _vnni_stored_candidate),
                     (gguf_int4.Int4Weight.kind, _int4_candidate))
# the small-batch contests ask only whether a candidate wins from the first row
_FIRST_ROWS = (1, 2)


def _blocks_bytes(groups: Sequence[tuple[int, torch.Tensor]]) -> int:
    """What a call reads of a weight kept as blocks: about the blocks' own bytes, in every
    layout the small-batch kernels keep."""
    return sum(raw.numel() * raw.element_size() for _, raw in groups)


def _native_copy(groups: Sequence[tuple[int, torch.Tensor]], k: int) -> crossover.Kernel:
    """The native kernel on its own repacking of `groups` (crossover timing's copies);
    takes `gemm` as `_native_linear` does."""
    parts, n = _packed_groups(groups, k), sum(raw.shape[0] for _, raw in groups)

    def kernel(x2: torch.Tensor, gemm: bool = False) -> torch.Tensor:
        return native.linear_groups(x2.contiguous(), parts, n,
                                    lambda x, w, out: native.linear(x, w, out, gemm=gemm))
    return kernel


def _types_key(source: Sequence[tuple[int | None, torch.Tensor]], blocks: Sequence[tuple[int, torch.Tensor]]) -> str:
    """The block types of a layer's groups for crossover keys: "q4_1", or "q6_k-as-q8_0" where
    the native kernel reads a rewrite (a candidate may read the file's own type)."""
    def name(own: int | None, rewritten: int) -> str:
        new = type_name(rewritten).lower()
        return new if own == rewritten else f"{type_name(own).lower()}-as-{new}"
    return "+".join(name(own, rewritten) for (own, _), (rewritten, _) in zip(source, blocks))


def _small_rows_kernel(types: str, shape: str, groups: Sequence[tuple[int, torch.Tensor]], k: int,
                       native_side: crossover.Contender, source: Sequence[tuple[int | None, torch.Tensor]]):
    """The kernel for batches below the dense crossover: `native_side` (the float32-exact
    native kernel), unless a candidate beat the kernel chosen so far from one row on
    (measured: on Zen 4 and Zen 5, VNNI; on a Sapphire Rapids, torch's int4 kernel).
    `groups`: the blocks the native kernel reads; `source`: the file's own, for a candidate
    that reads their type as stored. Returns the kernel as a crossover contender and its
    name (for crossover keys and the log)."""
    best, name = native_side, "native"
    if not _may_round_blocks():
        return best, name  # every candidate rounds the activations
    for kind, make in _SMALL_CANDIDATES:
        kind = kind() if callable(kind) else kind
        contest = f"gguf-{types}|{name}|{kind}|{shape}"
        lost_before = crossover.known(contest, _FIRST_ROWS)
        if lost_before is not None and lost_before > 1:
            continue  # measured on this machine before: not worth packing the weight for it
        candidate = make(groups, source, k)
        if candidate is None:
            continue
        # copies clone the packed tensors (torch's int4 packing of every copy took seconds)
        side = crossover.Contender(candidate, functools.partial(copy.deepcopy, candidate),
                                   sum(t.numel() * t.element_size() for t in candidate.tensors()))
        if crossover.rows_from(contest, best, side, k, candidates=_FIRST_ROWS) <= 1:
            best.copies.clear()  # the loser's timing copies; the winner keeps its own for the next contest
            best, name = side, kind
    return best, name


def _keep_small_kernel(layer: nn.Module, kernel, name: str) -> None:
    """`kernel` (not the native one) serves the small batches: the native repacking goes
    and the kernel's tensors become the layer's parameters in its place."""
    for param in [p for p in layer._parameters if p.startswith("qweight")]:
        delattr(layer, param)
    layer.gguf_packed = []
    layer.gguf_small = kernel
    for i, tensor in enumerate(kernel.tensors()):
        layer.register_parameter(f"qweight_{name}_{i}", nn.Parameter(tensor, requires_grad=False))


def _dense_contender(dense_fn, weight: torch.Tensor) -> crossover.Contender:
    """The dense copy `dense_fn` (`ops.pack_linear(weight)`) as a crossover side."""
    def packed(dense) -> crossover.Kernel:
        return lambda x: dense(x, None)

    return crossover.Contender(packed(dense_fn), lambda: packed(ops.pack_linear(weight)), dense_fn.nbytes)


# Row counts the quantized-tiles kernel is timed at against the dense copy: it reads a quarter
# (Q4) or about half (Q8_0) of the bf16 copy's bytes but dequantizes every tile, so it wins at
# decode batch sizes and loses at prefill sizes (on a 2-vCPU Xeon with AMX, SmolLM2's Q4_1 layers
# at 16 / 32 / 64 / 128 / 1,024 rows: 1.57 / 1.39 / 1.27 / 1.28 / 0.88x the bf16 tiles' time; its
# Q8_0 lm_head 1.35 / 1.22 / 1.15 / 1.11x at 16-128 rows); where it still wins at the last
# count, it serves up to twice that. Against the small-batch kernel it is timed from 2 rows
# (one row fills a sixteenth of a tile): there it won from 4-8 rows.
TILES_CANDIDATES = (16, 32, 64, 128)
TILES_FROM_CANDIDATES = (2, 4, 8, 16, 32, 64)


def _quant_tiles_range(layer: nn.Module, types: str, shape: str, blocks: Sequence[tuple[int, torch.Tensor]] | None,
                       k: int, small: crossover.Contender, small_name: str, dense_side: crossover.Contender,
                       dense_kind: str) -> bool:
    """Between the small-batch kernel and the dense copy: the blocks the native kernels read
    (`blocks`, one group of Q4_0, Q4_1 or Q8_0) dequantized into AMX tiles inside the GEMM
    (`native.quant_tiles_linear`; its results equal the dense copy's bf16 tiles where the blocks
    are the file's own), for the rows where it measured faster than both. Sets
    `layer.gguf_tiles` and its range [`gguf_native_below`, `gguf_tiles_below`) and returns
    True, or leaves the layer as it was (False: the small kernel's crossover with the dense
    copy is still to measure)."""
    if blocks is None or len(blocks) != 1 or not dense_kernels.bf16_products_allowed():
        return False
    qtype, raw = blocks[0]
    if not native.quant_tiles_fit(qtype, raw.shape[0], k):
        return False
    tile = "amx-q8" if qtype == GGML_Q8_0 else "amx-q4"
    above, below = f"gguf-{types}|{small_name}|{tile}|{shape}", f"gguf-{types}|{tile}|{dense_kind}|{shape}"
    known_above = crossover.known(above, TILES_FROM_CANDIDATES)
    known_below = crossover.known(below, TILES_CANDIDATES)
    if known_above is not None and known_below is not None and known_above >= known_below:
        return False  # measured on this machine before: it serves no batch size
    tiles = native.pack_quant_tiles(raw, qtype, k)

    def kernel_on(w: native.QuantTiles) -> crossover.Kernel:
        return lambda x: native.quant_tiles_linear(x.reshape(-1, k).contiguous(), w)

    side = crossover.Contender(kernel_on(tiles),
                               lambda: kernel_on(dataclasses.replace(tiles, tiles=tiles.tiles.clone())), tiles.nbytes)
    first = crossover.rows_from(above, small, side, k, candidates=TILES_FROM_CANDIDATES)
    last = crossover.rows_from(below, side, dense_side, k, candidates=TILES_CANDIDATES)
    last = min(last, 2 * TILES_CANDIDATES[-1])
    side.copies.clear()
    if first >= last:
        return False
    layer.gguf_tiles = tiles
    layer.register_parameter("qweight_amx_tiles", nn.Parameter(tiles.tiles, requires_grad=False))
    layer.gguf_native_below, layer.gguf_tiles_below = first, last
    logger.debug("%s: %s tiles serve %d-%d rows", layer.prefix, type_name(qtype), first, last - 1)
    return True


# Row counts the small-batch kernel is timed at against the dense copy: the usual 1-64, then
# 256, since a dense copy that first wins past 64 rows still serves prefills. With
# 1-64 alone, the VNNI kernel's AVX2 form (PAGEDLLM_CPU_MAX_ISA=avx2 on a 2-vCPU Xeon, weights
# streamed) won SmolLM2's qkv and down_proj at 64 rows, so their dense copies were dropped,
# while at 1,024 rows the float32 GEMM took 0.64-0.73x its time. (The head keeps 1-64: it
# multiplies a step's last rows only, one per sequence, unless prompt logprobs are asked for.)
SMALL_DENSE_CANDIDATES = crossover.CANDIDATES + (256,)


def _measure_ranges(layer: nn.Module, types: str, shape: str, blocks: Sequence[tuple[int, torch.Tensor]] | None,
                    k: int, small: crossover.Contender, small_name: str, dense, weight: torch.Tensor,
                    candidates: tuple[int, ...] = SMALL_DENSE_CANDIDATES) -> None:
    """Which batches the blocks serve and which the dense copy `dense` (`ops.pack_linear(weight)`)
    serves: the quantized tiles' range where they win one, else the small-batch kernel's crossover
    with the dense copy (`layer.gguf_native_below`, timed at `candidates` rows). For linear layers
    and the head alike."""
    dense_side = _dense_contender(dense, weight)
    if not _quant_tiles_range(layer, types, shape, blocks, k, small, small_name, dense_side, dense.kind):
        layer.gguf_native_below = crossover.rows_from(
            f"gguf-{types}|{'' if small_name == 'native' else small_name + '|'}{dense.kind}|{shape}", small,
            dense_side, k, candidates=candidates)


class GGUFLinearMethod(LinearMethod):
    """A linear layer whose weight arrives as raw ggml blocks (one tensor per shard).

    After loading, in output-row order: `layer.gguf_packed` holds the groups repacked for
    the native kernel (parameters `qweight*`, `qweight_scale*`, `qweight_offset*`), or
    `layer.gguf_groups` names raw blocks to dequantize per call (keep-quantized, types
    the kernel does not read); `layer.weight` is the dense copy (keep_dense).
    """

    def __init__(self, keep_dense: bool) -> None:
        self.keep_dense = keep_dense

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: Sequence[int],
                       params_dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        weight.weight_loader = functools.partial(self._load_shard, layer)  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)
        layer.gguf_output_sizes = list(output_sizes)
        layer.gguf_input_size = input_size
        layer.gguf_params_dtype = params_dtype
        layer.gguf_shards = [None] * len(output_sizes)  # (ggml type | None, tensor) per shard
        layer.gguf_groups = []  # (parameter name, ggml type | None): blocks dequantized per call
        layer.gguf_packed = []  # (PackedWeight, first row, end row): the native kernel's operands
        layer.gguf_has_dense = False
        layer.gguf_dense = None  # ops.pack_linear of the dense copy
        layer.gguf_native_below = 0  # batches of fewer rows read the blocks (with a dense copy)
        layer.gguf_gemm_from = crossover.NEVER  # keep-quantized: rows from which the blocks run as a GEMM
        layer.gguf_small = None  # the VNNI or int4 kernel, where one beat the native one for single rows
        layer.gguf_tiles = None  # the blocks as AMX quantized tiles, for batches from gguf_native_below ...
        layer.gguf_tiles_below = 0  # ... to this many rows (where they measured faster than both)

    @staticmethod
    def _load_shard(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard: int | None) -> None:
        qtype = getattr(loaded, "gguf_qtype", None)
        rows = sum(layer.gguf_output_sizes) if shard is None else layer.gguf_output_sizes[shard]
        cols = num_cols(loaded, qtype)
        if loaded.dim() != 2 or loaded.shape[0] != rows or cols != layer.gguf_input_size:
            kind = "float" if qtype is None else type_name(qtype)
            raise ValueError(f"{layer.prefix}: {kind} weight{'' if shard is None else f' shard {shard}'} has "
                             f"{loaded.shape[0]}x{cols} values, expected {rows}x{layer.gguf_input_size}")
        if qtype is None:
            loaded = loaded.to(layer.gguf_params_dtype)
        entry = (qtype, loaded.to(param.device))
        if shard is None:
            layer.gguf_shards = [entry]
        else:
            layer.gguf_shards[shard] = entry

    def process_after_loading(self, layer: nn.Module) -> None:
        shards = layer.gguf_shards
        if any(s is None for s in shards):
            missing = [i for i, s in enumerate(shards) if s is None]
            raise ValueError(f"{layer.prefix}: GGUF weight shards {missing} were never loaded")
        groups = group_by_type(shards)
        device = shards[0][1].device
        del layer.weight
        layer.gguf_shards = []
        joined = [(qtype, parts[0] if len(parts) == 1 else torch.cat(parts)) for qtype, parts in groups]
        # the dense copy, from the file's own blocks (exact)
        dense = [data if qtype is None else _dequantize(data, qtype, layer.gguf_input_size)
                 for qtype, data in joined] if self.keep_dense else []
        # what the native kernels read: the blocks themselves, or their 32-value rewrite
        blocks = _native_groups(joined, layer.gguf_input_size, device, dense or None)
        row = 0
        for i, (qtype, data) in enumerate(joined):
            if blocks is None and not self.keep_dense:  # keep the blocks; they are dequantized per call
                suffix = "" if i == 0 else f"_{i}"
                layer.register_parameter(f"qweight{suffix}", nn.Parameter(data, requires_grad=False))
                layer.gguf_groups.append((f"qweight{suffix}", qtype))
            row += data.shape[0]
        layer.gguf_has_dense = bool(dense)
        if blocks is not None and not (dense and layer.gguf_params_dtype == torch.float32):
            _pack_native(layer, blocks)  # else only once the native kernel runs or is chosen (below)
        if not dense:
            if layer.gguf_packed:  # keep-quantized: many rows decode the blocks into the GEMM
                types = _types_key(joined, blocks)
                k, nbytes = layer.gguf_input_size, _blocks_bytes(blocks)

                def side(gemm: bool) -> crossover.Contender:
                    return crossover.Contender(functools.partial(_native_linear, layer, gemm=gemm),
                                               lambda: functools.partial(_native_copy(blocks, k), gemm=gemm), nbytes)

                layer.gguf_gemm_from = crossover.rows_from(f"gguf-{types}|rows|gemm|{row}x{k}", side(False),
                                                           side(True), k)
            return
        weight = (dense[0] if len(dense) == 1 else torch.cat(dense)).to(layer.gguf_params_dtype)
        layer.gguf_dense = ops.pack_linear(weight)
        if not layer.gguf_dense.owns_copy:  # else the packed layout replaces the plain copy
            layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        if blocks is not None and layer.gguf_params_dtype == torch.float32:
            types = _types_key(joined, blocks)
            shape = f"{row}x{layer.gguf_input_size}"
            k = layer.gguf_input_size
            native_side = crossover.Contender(functools.partial(_native_linear, layer, pack=blocks),
                                              functools.partial(_native_copy, blocks, k), _blocks_bytes(blocks))
            small, name = _small_rows_kernel(types, shape, blocks, k, native_side, joined)
            if name != "native":
                _keep_small_kernel(layer, small.kernel, name)
            else:
                _pack_native(layer, blocks)
            _measure_ranges(layer, types, shape, blocks, k, small, name, layer.gguf_dense, weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // layer.gguf_input_size
        takes_tiles = _takes_tiles(layer, x, rows)
        if takes_tiles or _takes_native(layer, x, rows):
            x2 = x.reshape(rows, layer.gguf_input_size).float()  # the kernels take float32 activations
            # with a dense copy, the blocks serve only batches below the measured crossovers
            if takes_tiles:
                out = native.quant_tiles_linear(x2.contiguous(), layer.gguf_tiles)
            else:
                out = layer.gguf_small(x2) if layer.gguf_small is not None else _native_linear(layer, x2)
            if bias is not None:
                out += bias
            return out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)
        if layer.gguf_dense is not None:
            return layer.gguf_dense(x, bias)
        # keep-quantized and not natively readable: dequantize this call
        parts = [getattr(layer, name) if qtype is None else _dequantize(getattr(layer, name), qtype,
                                                                       layer.gguf_input_size)
                 for name, qtype in layer.gguf_groups]
        dense = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(x.dtype)
        return F.linear(x, dense, bias)

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        rows = x.numel() // layer.gguf_input_size
        if _takes_tiles(layer, x, rows):  # fused where the halves are whole strips (the tiles add no bias)
            if layer.gguf_tiles.n % 32 or bias is not None:
                return None
            out = native.quant_tiles_linear(x.reshape(rows, layer.gguf_input_size).contiguous(), layer.gguf_tiles,
                                         silu_and_mul=True)
            return out.view(*x.shape[:-1], out.shape[-1])
        if layer.gguf_dense is None or _takes_native(layer, x, rows):
            return None
        return layer.gguf_dense.silu_and_mul(x, bias)  # batches the dense copy serves: its kernel may fuse


def _pack_native(layer: nn.Module, blocks: Sequence[tuple[int, torch.Tensor]]) -> None:
    """The native kernel's repacking of `blocks` (the layer's groups, in output-row order),
    made once. A layer with a float32 dense copy makes it only when the native kernel first
    runs (a contest) or is chosen: where this machine measured before that a small-batch
    kernel beats it (VNNI on every layer of Qwen2.5-1.5B on the Xeons and Zens measured),
    it was thrown away, ~1 s of that model's load."""
    if layer.gguf_packed:
        return
    layer.gguf_packed = _packed_groups(blocks, layer.gguf_input_size)
    for i, (packed, _, _) in enumerate(layer.gguf_packed):
        _register_packed(layer, "" if i == 0 else f"_{i}", packed)


def _packed_groups(groups: Sequence[tuple[int, torch.Tensor]], k: int) -> list[tuple[native.PackedWeight, int, int]]:
    """Each (type, blocks) group repacked for the native kernel, with the output rows it
    fills (`native.linear_groups`'s operands)."""
    parts, row = [], 0
    for qtype, raw in groups:
        parts.append((native.pack(raw, qtype, k), row, row + raw.shape[0]))
        row += raw.shape[0]
    return parts


def _native_linear(layer: nn.Module, x2: torch.Tensor, gemm: bool | None = None,
                   pack: Sequence[tuple[int, torch.Tensor]] | None = None) -> torch.Tensor:
    """x2 [rows, K] float32 @ W^T from the repacked block groups; `gemm` (default: from
    the layer's measured row count) decodes them panel by panel into the float32 GEMM.
    `pack`: the groups to repack first if the layer has not yet (`_pack_native`)."""
    if pack is not None:
        _pack_native(layer, pack)
    if gemm is None:
        gemm = x2.shape[0] >= layer.gguf_gemm_from
    return native.linear_groups(x2.contiguous(), layer.gguf_packed, sum(layer.gguf_output_sizes),
                                lambda x, w, out: native.linear(x, w, out, gemm=gemm))


def _register_packed(layer: nn.Module, suffix: str, packed: native.PackedWeight) -> None:
    """Packed tensors become parameters, so memory accounting and state dicts see them."""
    layer.register_parameter(f"qweight{suffix}", nn.Parameter(packed.codes, requires_grad=False))
    layer.register_parameter(f"qweight_scale{suffix}", nn.Parameter(packed.d, requires_grad=False))
    if packed.m.numel():
        layer.register_parameter(f"qweight_offset{suffix}", nn.Parameter(packed.m, requires_grad=False))


def _dequantize(raw: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    return dequantize(raw, qtype, (raw.shape[0], cols))


class GGUFEmbeddingMethod(EmbeddingMethod):
    """The token embedding (and tied or untied output head) from ggml blocks.

    Lookups read the dense copy when there is one (keep_dense), else dequantize just the
    looked-up rows. Logits for a few rows come from the native kernel when it reads the
    type, else from the dense copy (or, keep-quantized, a per-call dequantization).
    """

    def __init__(self, keep_dense: bool) -> None:
        self.keep_dense = keep_dense

    def create_weights(self, layer, vocab_size, hidden_size, params_dtype):
        layer.weight = nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
        layer.weight.weight_loader = functools.partial(self._load, layer)  # type: ignore[attr-defined]
        layer.gguf_shape = (vocab_size, hidden_size)
        layer.gguf_params_dtype = params_dtype
        layer.gguf_qtype = None
        layer.gguf_packed = None
        layer.gguf_has_dense = True
        layer.gguf_head = None  # ops.pack_linear of the dense copy, for logits
        layer.gguf_native_below = 0  # logits of fewer rows come from the blocks (with a dense copy)
        layer.gguf_small = None  # the VNNI kernel, where it beat the native one for single rows
        layer.gguf_tiles = None  # the blocks as AMX quantized tiles, for logits of gguf_native_below ...
        layer.gguf_tiles_below = 0  # ... to this many rows (where they measured faster than both)

    @staticmethod
    def _load(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard: int | None) -> None:
        vocab, hidden = layer.gguf_shape
        qtype = getattr(loaded, "gguf_qtype", None)
        cols = num_cols(loaded, qtype)
        if loaded.dim() != 2 or (loaded.shape[0], cols) != (vocab, hidden):
            raise ValueError(f"{layer.prefix}: weight has {loaded.shape[0]}x{cols} values, expected {vocab}x{hidden}")
        layer.gguf_qtype = qtype
        if qtype is None:
            param.data = loaded.to(param.device, layer.gguf_params_dtype)
        else:
            layer.qweight_raw = nn.Parameter(loaded.to(param.device), requires_grad=False)

    def process_after_loading(self, layer):
        qtype = layer.gguf_qtype
        if qtype is None:  # a float matrix: the dense weight is all there is
            if layer.serves_logits:
                layer.gguf_head = ops.pack_linear(layer.weight)
            return
        raw = layer.qweight_raw
        del layer.qweight_raw
        hidden = layer.gguf_shape[1]
        exact = _dequantize(raw, qtype, hidden) if self.keep_dense else None
        if exact is not None and not layer.serves_logits:  # lookups read the dense copy alone
            layer.weight = nn.Parameter(exact.to(layer.gguf_params_dtype), requires_grad=False)
            return
        blocks = _native_groups([(qtype, raw)], hidden, raw.device,  # what the native kernels read
                                None if exact is None else [exact])
        if blocks is not None:
            layer.gguf_packed = native.pack(blocks[0][1], blocks[0][0], hidden)
            _register_packed(layer, "", layer.gguf_packed)
        elif not self.keep_dense:
            layer.qweight_raw = nn.Parameter(raw, requires_grad=False)
        if self.keep_dense:
            layer.weight = nn.Parameter(exact.to(layer.gguf_params_dtype), requires_grad=False)
            layer.gguf_head = ops.pack_linear(layer.weight)  # for logits; lookups read the plain copy
            if layer.gguf_packed is not None and layer.gguf_params_dtype == torch.float32:
                types, shape = _types_key([(qtype, raw)], blocks), f"{layer.gguf_shape[0]}x{hidden}"
                native_side = crossover.Contender(functools.partial(native.linear, w=layer.gguf_packed),
                                                  functools.partial(_native_copy, blocks, hidden),
                                                  _blocks_bytes(blocks))
                small, name = _small_rows_kernel(types, shape, blocks, hidden, native_side, [(qtype, raw)])
                if name != "native":
                    _keep_small_kernel(layer, small.kernel, name)
                _measure_ranges(layer, types, shape, blocks, hidden, small, name, layer.gguf_head, layer.weight,
                                crossover.CANDIDATES)
        else:
            del layer.weight
            layer.gguf_has_dense = False

    def embed(self, layer, input_ids):
        if layer.gguf_has_dense:
            if input_ids.dim() == 1:
                return ops.gather_rows(layer.weight, input_ids)
            return F.embedding(input_ids, layer.weight)
        ids = input_ids.reshape(-1)
        if layer.gguf_packed is not None:
            rows = native.dequantize_rows(layer.gguf_packed, ids)
        else:
            rows = _dequantize(layer.qweight_raw[ids], layer.gguf_qtype, layer.gguf_shape[1])
        return rows.to(layer.gguf_params_dtype).view(*input_ids.shape, -1)

    def logits(self, layer, x):
        rows = x.numel() // layer.gguf_shape[1]
        packed = layer.gguf_packed
        if _takes_tiles(layer, x, rows):
            return native.quant_tiles_linear(x.reshape(rows, -1).contiguous(), layer.gguf_tiles)
        if _takes_native(layer, x, rows):  # float32 activations for the kernels
            x2 = x.reshape(rows, -1).float().contiguous()
            out = layer.gguf_small(x2) if layer.gguf_small is not None else native.linear(x2, packed)
            return out.to(x.dtype)
        if layer.gguf_head is not None:
            return layer.gguf_head(x, None)
        # keep-quantized blocks the native kernels cannot read: dequantize for this call
        dense = _dequantize(layer.qweight_raw, layer.gguf_qtype, layer.gguf_shape[1])
        return F.linear(x, dense.to(x.dtype))


class GGUFConfig(QuantConfig):
    """`--quantization gguf`: chosen by `GGUFFormat.quantization()` for every GGUF file.

    Linear and embedding weights arrive as ggml blocks; `keep_dense` (the default; off
    with the `gguf_keep_quantized` option) also keeps a dense float copy.
    """

    name = "gguf"

    def __init__(self, keep_dense: bool = True) -> None:
        self.keep_dense = keep_dense

    @classmethod
    def from_config(cls, config: dict[str, Any], options: dict[str, Any]) -> "GGUFConfig":
        return cls(keep_dense=not options.get("gguf_keep_quantized", False))

    def linear_method(self, prefix: str) -> LinearMethod | None:
        return GGUFLinearMethod(self.keep_dense)

    def embedding_method(self, prefix: str) -> EmbeddingMethod | None:
        return GGUFEmbeddingMethod(self.keep_dense)

    def moe_method(self, prefix: str) -> MoEMethod | None:
        """Routed experts from llama.cpp's stacked tensors (gguf_moe.py): dequantized to the
        compute dtype at load, or (keep-quantized) kept as blocks."""
        from pagedllm.plugins.quant.gguf_moe import GGUFMoEMethod

        if not getattr(self, "_moe_logged", False):
            self._moe_logged = True
            logger.info("GGUF experts: %s", "dequantized to the compute dtype at load (the GGUF linear kernels "
                        "take 2-D weights)" if self.keep_dense else "kept as ggml blocks, multiplied per expert")
        return GGUFMoEMethod(self.keep_dense)
