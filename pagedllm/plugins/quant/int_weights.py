"""Integer-coded weights in groups along the input: what AWQ, GPTQ and compressed-tensors'
pack-quantized checkpoints share once their tensors are unpacked.

Each format's method does only its own unpacking, into `IntGroups`: codes q [N, K], and
per group of input columns a scale s and a zero z, so that w = s * (q - z); act-order
GPTQ adds the input permutation that makes its groups contiguous. `IntLinear` turns that
into what runs:

* on the CPU, the native 4-bit kernel's operands (`native.PackedWeight`): 32-value blocks
  of nibbles with a float32 scale d = s and offset m = -s * z per block (a group of 128 is
  four blocks sharing one pair), exactly the format's values, since s * q - s * z is
  exact in float32 for fp16 scales and 4-bit codes. 8-bit symmetric codes (z = 128) take
  the native 8-bit kernel. No call dequantizes the matrix: few rows stream the codes per
  row; from a row count measured per layer shape at load (crossover.py) the codes are
  decoded panel by panel into the float32 GEMM (pd_linear_packed_gemm), once per block
  of rows, at about the dense GEMM's speed and with no dense copy kept.
* on CUDA, a Triton dequant-GEMM (triton_int.py) on the codes packed in int32 words.
* elsewhere (no kernel reads them: group sizes that are not a multiple of 32 on the CPU,
  8-bit codes with zeros) a dense copy made once at load, in the compute dtype, which the
  log says.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm import ops
from pagedllm.core.contracts import LinearMethod
from pagedllm.ops.cpu import crossover, native

logger = logging.getLogger("pagedllm")

Q4_1, Q8_0 = 3, 8  # the native kernels' type ids (ggml's)
BLOCK = 32  # values per native block


@dataclass
class IntGroups:
    """w[n, perm[j]] = scales[n, j // group] * (codes[n, j] - zeros[n, j // group])."""

    codes: torch.Tensor  # uint8 [N, K], 0 .. 2^bits - 1
    scales: torch.Tensor  # float32 [N, K / group]
    zeros: torch.Tensor  # float32 [N, K / group]
    group: int
    bits: int
    perm: torch.Tensor | None = None  # int64 [K]: column j holds input perm[j]; None = identity

    def dequantize(self) -> torch.Tensor:
        """Dense float32 [N, K] in the layer's input order."""
        n, k = self.codes.shape
        grouped = self.codes.view(n, k // self.group, self.group).float()
        w = ((grouped - self.zeros[..., None]) * self.scales[..., None]).view(n, k)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """Split each int32 of `packed` into 32 / bits codes laid out along `dim` (code i of a
    word in bits [i * bits, (i + 1) * bits)), optionally in a format's own order:
    `order[j]` is the position inside the word of the j-th code along `dim`."""
    per_word = 32 // bits
    positions = torch.tensor(order if order is not None else range(per_word), dtype=torch.int32)
    shifts = (positions * bits).to(packed.device)
    words = packed.to(torch.int32).unsqueeze(dim + 1)
    view = [1] * words.dim()
    view[dim + 1] = per_word
    codes = (words >> shifts.view(view)) & ((1 << bits) - 1)
    shape = list(packed.shape)
    shape[dim] *= per_word
    return codes.reshape(shape).to(torch.uint8)


def split_by_order(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
                   output_sizes: list[int], group: int, bits: int, what: str) -> list[IntGroups]:
    """`IntGroups` for runs of fused shards sharing one input order: each shard's `g_idx`
    row (the group of every input column) is row order, or a permutation that makes its
    groups contiguous (act-order), applied to the codes here and to the activations per
    call."""
    k = codes.shape[1]
    in_order = torch.arange(k, dtype=torch.int64, device=g_idx.device) // group
    runs: list[tuple[torch.Tensor | None, int, int]] = []  # (perm, first row, end row)
    row = 0
    for shard, size in enumerate(output_sizes):
        order = g_idx[shard].to(torch.int64)
        perm = None
        if not torch.equal(order, in_order):
            counts = torch.bincount(order.clamp(min=0), minlength=k // group)
            if order.min() < 0 or len(counts) != k // group or bool((counts != group).any()):
                raise ValueError(f"{what}: g_idx of shard {shard} does not give each of the {k // group} groups "
                                 f"{group} input columns")
            perm = torch.sort(order, stable=True).indices
        if runs and _same(runs[-1][0], perm):
            runs[-1] = (runs[-1][0], runs[-1][1], row + size)
        else:
            runs.append((perm, row, row + size))
        row += size
    parts = []
    for perm, start, end in runs:
        c = codes[start:end] if perm is None else codes[start:end][:, perm]
        parts.append(IntGroups(c.contiguous(), scales[start:end].contiguous(), zeros[start:end].contiguous(),
                               group, bits, perm))
    return parts


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


def _native_weight(g: IntGroups) -> native.PackedWeight | None:
    """The native kernel's operands for `g`, or None where they cannot hold it exactly."""
    n, k = g.codes.shape
    if g.group % BLOCK or k % BLOCK:
        return None
    repeat = g.group // BLOCK
    d = g.scales.repeat_interleave(repeat, dim=1).contiguous()
    if g.bits == 4:
        blocks = g.codes.view(n, k // BLOCK, 2, BLOCK // 2)
        codes = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
        m = (-(g.scales * g.zeros)).repeat_interleave(repeat, dim=1).contiguous()
        return native.PackedWeight(Q4_1, n, k, codes, d, m)
    if g.bits == 8 and bool((g.zeros == 128).all()):
        codes = (g.codes.to(torch.int16) - 128).to(torch.int8).view(torch.uint8).contiguous()
        return native.PackedWeight(Q8_0, n, k, codes, d, torch.empty(0, dtype=torch.float32))
    return None


_LOGGED: set[str] = set()


def log_kernel_once(what: str, kind: str) -> None:
    """One log line per format and kernel kind a process picks (not one per layer)."""
    key = f"{what}|{kind}"
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("%s linear layers: %s kernel", what, kind)


def triton_installed() -> bool:
    """Whether triton imports here (the CUDA dequant-GEMMs of triton_int.py / triton_fp8.py
    need it; those modules import it at the top)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_reads(parts: list[IntGroups]) -> bool:
    """Whether the Triton kernel takes these parts (and triton is installed)."""
    if not triton_installed():
        return False
    return all(p.group % 16 == 0 and p.codes.shape[1] % (32 // p.bits) == 0 for p in parts)


def _native_parts(x2: torch.Tensor, parts: list[tuple[native.PackedWeight, torch.Tensor | None, int, int]], n: int,
                  gemm: bool = False) -> torch.Tensor:
    """float32 [rows, n] from native parts (weight, input permutation or None, first row,
    end row); `gemm`: decoded into the float32 GEMM."""
    def part(x: torch.Tensor, weight: tuple[native.PackedWeight, torch.Tensor | None],
             out: torch.Tensor | None) -> torch.Tensor:
        w, perm = weight
        return native.linear(x if perm is None else x.index_select(1, perm), w, out, gemm=gemm)

    return native.linear_groups(x2, [((w, perm), start, end) for w, perm, start, end in parts], n, part)


class IntLinear:
    """x @ W^T for a layer whose rows come in parts (`IntGroups` each, stacked along N):
    from the native kernel's operands where they hold every part, else from one dense
    copy. `what` names the format and layer in the log."""

    def __init__(self, parts: list[IntGroups], dtype: torch.dtype, device: torch.device, what: str,
                 kernel: str | None = None) -> None:
        self.n = sum(p.codes.shape[0] for p in parts)
        self.k = parts[0].codes.shape[1]
        self.dtype = dtype
        self.parts: list[tuple[native.PackedWeight, torch.Tensor | None, int, int]] = []
        self.triton_parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, IntGroups, int, int]] = []
        self.dense = None
        self.gemm_from = crossover.NEVER  # rows from which the native parts run as a GEMM
        kernel = kernel or ("triton" if device.type == "cuda" and _triton_reads(parts) else "native")
        packed = [_native_weight(p) for p in parts] if kernel == "native" and device.type == "cpu" \
            and native.available() else []
        if kernel == "triton":
            from pagedllm.plugins.quant import triton_int

            row = 0
            for p in parts:
                rows = p.codes.shape[0]
                self.triton_parts.append((triton_int.pack(p.codes, p.bits).to(device),
                                          p.scales.t().contiguous().to(device), p.zeros.t().contiguous().to(device),
                                          p, row, row + rows))
                row += rows
            self.kind = f"triton-{'+'.join(f'int{p.bits}' for p in parts)}"
        elif packed and all(w is not None for w in packed):
            row = 0
            for p, w in zip(parts, packed):
                perm = None if p.perm is None else p.perm.to(device)
                self.parts.append((w, perm, row, row + w.n))
                row += w.n
            self.kind = f"native-{'+'.join(f'int{p.bits}' for p in parts)}"
            nbytes = sum(w.nbytes for w in packed)

            def side(gemm: bool) -> crossover.Contender:
                def copy() -> crossover.Kernel:  # the same kernel on its own packing of the parts
                    twin = [(_native_weight(p), *rest) for p, (_, *rest) in zip(parts, self.parts)]
                    return functools.partial(_native_parts, parts=twin, n=self.n, gemm=gemm)
                return crossover.Contender(functools.partial(self._native, gemm=gemm), copy, nbytes)

            self.gemm_from = crossover.rows_from(f"{self.kind}|rows|gemm|{self.n}x{self.k}", side(False), side(True),
                                                 self.k)
        else:
            weight = torch.cat([p.dequantize() for p in parts]).to(dtype)
            self.dense = ops.pack_linear(weight)
            self.kind = f"dense-{dtype}".replace("torch.", "")
            logger.info("%s: no native kernel reads it on %s (group %d, %d bits): dequantized once at load to %s",
                        what, device.type, parts[0].group, parts[0].bits, str(dtype).replace("torch.", ""))

    def _native(self, x2: torch.Tensor, gemm: bool = False) -> torch.Tensor:
        """float32 [rows, N] from the native parts (`gemm`: decoded into the float32 GEMM)."""
        return _native_parts(x2, self.parts, self.n, gemm)

    def register(self, layer: nn.Module) -> None:
        """Make the kernel's tensors parameters of `layer` (memory accounting and state
        dicts see them)."""
        for i, (words, scales, zeros, _, _, _) in enumerate(self.triton_parts):
            layer.register_parameter(f"qweight_{i}", nn.Parameter(words, requires_grad=False))
            layer.register_parameter(f"qweight_scale_{i}", nn.Parameter(scales, requires_grad=False))
            layer.register_parameter(f"qweight_zero_{i}", nn.Parameter(zeros, requires_grad=False))
        for i, (w, perm, _, _) in enumerate(self.parts):
            layer.register_parameter(f"qweight_{i}", nn.Parameter(w.codes, requires_grad=False))
            layer.register_parameter(f"qweight_scale_{i}", nn.Parameter(w.d, requires_grad=False))
            if w.m.numel():
                layer.register_parameter(f"qweight_offset_{i}", nn.Parameter(w.m, requires_grad=False))
            if perm is not None:
                layer.register_buffer(f"qweight_perm_{i}", perm, persistent=False)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.dense is not None:
            return self.dense(x, bias)
        rows = x.numel() // self.k
        if self.triton_parts:
            from pagedllm.plugins.quant import triton_int

            xt = triton_int.operand(x.reshape(rows, self.k))
            out = torch.empty(rows, self.n, dtype=torch.float32, device=x.device)
            for words, scales, zeros, p, start, end in self.triton_parts:
                xp = xt if p.perm is None else xt.index_select(1, p.perm.to(x.device)).contiguous()
                out[:, start:end] = triton_int.linear(xp, words, scales, zeros, p.group, p.bits)
            if bias is not None:
                out += bias
            return out.to(x.dtype).view(*x.shape[:-1], self.n)
        x2 = x.reshape(rows, self.k).float().contiguous()
        out = self._native(x2, gemm=rows >= self.gemm_from)
        if bias is not None:
            out += bias
        return out.to(x.dtype).view(*x.shape[:-1], self.n)


def output_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, output_sizes: list[int],
                 output_dim: int, pack_factor: int = 1) -> nn.Parameter:
    """Register a checkpoint tensor of a (possibly fused) layer: shards are placed along
    `output_dim`, `pack_factor` output rows per stored element (see layers.load_shard)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    offsets = [0]
    for size in output_sizes:
        offsets.append(offsets[-1] + size)
    param.output_offsets = offsets  # type: ignore[attr-defined]
    param.output_dim = output_dim  # type: ignore[attr-defined]
    param.pack_factor = pack_factor  # type: ignore[attr-defined]
    layer.register_parameter(name, param)
    return param


def group_index_param(layer: nn.Module, name: str, input_size: int, group: int, shards: int) -> None:
    """Register an act-order group index (GPTQ's g_idx, compressed-tensors' weight_g_idx):
    one row per fused shard giving each input column's group. It defaults to row order
    (column k in group k // group), what exports that omit it mean, so it is optional."""
    g_idx = nn.Parameter(torch.arange(input_size, dtype=torch.int32).div(group, rounding_mode="floor")
                         .repeat(shards, 1), requires_grad=False)
    g_idx.per_shard = True  # type: ignore[attr-defined]
    g_idx.optional = True  # type: ignore[attr-defined]
    layer.register_parameter(name, g_idx)


class GroupedIntMethod(LinearMethod):
    """The part of a grouped-integer linear method every format shares: after loading,
    the format's `unpack` gives `IntGroups` (one per run of shards that share an input
    order), its checkpoint tensors are dropped and `IntLinear` serves every call."""

    format_name = "int"
    checkpoint_tensors: tuple[str, ...] = ()  # parameter names unpack reads (dropped after)

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        layer.int_input_size = input_size
        layer.int_output_sizes = list(output_sizes)
        layer.int_dtype = params_dtype
        self.create_checkpoint_tensors(layer, input_size, list(output_sizes))

    def create_checkpoint_tensors(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        raise NotImplementedError

    def unpack(self, layer: nn.Module) -> list[IntGroups]:
        raise NotImplementedError

    def process_after_loading(self, layer):
        parts = self.unpack(layer)
        device = parts[0].codes.device
        for name in self.checkpoint_tensors:
            if hasattr(layer, name):
                delattr(layer, name)
        layer.int_kernel = IntLinear(parts, layer.int_dtype, device, f"{self.format_name} {layer.prefix}")
        layer.int_kernel.register(layer)
        log_kernel_once(self.format_name, layer.int_kernel.kind)

    def apply(self, layer, x, bias):
        return layer.int_kernel(x, bias)
