"""A small, strict reader for GGUF files: metadata, tensor directory, memory-mapped data.

We parse the header ourselves instead of using `gguf.GGUFReader` because that reader
builds a numpy view per array element (seconds for a 49k-token vocabulary) and reports a
truncated file as an opaque numpy error. Every problem here is a `GGUFError` (a
ValueError) that names the file and what is wrong with it. Tensor data is never copied
at open time: `tensor_bytes` returns a read-only view of the memory-mapped file.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count,
u64 metadata count, the metadata key/values, the tensor infos (name, dims innermost
first, type, offset), padding to `general.alignment`, then the tensor data.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types -> (struct format, size); STRING=8 and ARRAY=9 are handled apart.
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4",
                  7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9

QK_K = 256
# ggml type ids (the `type` field of a GGUF tensor info).
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30
FLOAT_TYPES = frozenset({F32, F16, BF16})
TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
    34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
# The types we can dequantize: type id -> (values per block, bytes per block).
BLOCK_LAYOUTS: dict[int, tuple[int, int]] = {
    F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q8_0: (32, 34), Q4_0: (32, 18), Q4_1: (32, 20),
    Q5_0: (32, 22), Q5_1: (32, 24), Q2_K: (QK_K, 84), Q3_K: (QK_K, 110), Q4_K: (QK_K, 144),
    Q5_K: (QK_K, 176), Q6_K: (QK_K, 210),
}


class GGUFError(ValueError):
    """A GGUF file that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory. `shape` is numpy order (outermost first)."""

    name: str
    shape: tuple[int, ...]
    qtype: int  # ggml type id (see TYPE_NAMES)
    offset: int  # absolute byte offset of the data in the file
    num_bytes: int


class _Cursor:
    """Sequential little-endian reads over a buffer; running off the end is a GGUFError."""

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, num_bytes: int) -> memoryview:
        end = self.pos + num_bytes
        if num_bytes < 0 or end > len(self.buf):
            raise GGUFError(
                f"{self.path}: GGUF file is truncated or corrupt: needed {num_bytes} bytes at offset "
                f"{self.pos}, but the file has {len(self.buf)} bytes")
        view = self.buf[self.pos:end]
        self.pos = end
        return view

    def scalar(self, fmt: str, size: int) -> Any:
        return struct.unpack(fmt, self.take(size))[0]

    def u32(self) -> int:
        return self.scalar("<I", 4)

    def u64(self) -> int:
        return self.scalar("<Q", 8)

    def string(self) -> str:
        raw = self.take(self.u64())
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFError(f"{self.path}: corrupt GGUF string at offset {self.pos - len(raw)}: {exc}") from None

    def strings(self, n: int) -> list[str]:
        """`n` consecutive strings: the hot path (vocabularies and merges hold ~10^5)."""
        buf, pos, end, unpack = self.buf, self.pos, len(self.buf), struct.Struct("<Q").unpack_from
        out = []
        try:
            for _ in range(n):
                (size,) = unpack(buf, pos)
                pos += 8
                if pos + size > end:
                    raise struct.error("string runs past the end")
                out.append(str(buf[pos:pos + size], "utf-8"))
                pos += size
        except (struct.error, UnicodeDecodeError) as exc:
            raise GGUFError(f"{self.path}: GGUF file is truncated or corrupt: bad string array at "
                            f"offset {pos}: {exc}") from None
        self.pos = pos
        return out

    def count(self, what: str) -> int:
        # A count larger than the bytes left cannot be real: catch garbage before looping on it.
        n = self.u64()
        if n > len(self.buf) - self.pos:
            raise GGUFError(f"{self.path}: GGUF file is truncated or corrupt: {what} count {n} "
                            f"exceeds the {len(self.buf) - self.pos} bytes left")
        return n

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(*_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.u32(), self.count("array")
            if etype in _NUMPY_SCALARS:
                size = _SCALARS[etype][1]
                return np.frombuffer(self.take(n * size), dtype=_NUMPY_SCALARS[etype]).copy()
            if etype == _STRING:
                return self.strings(n)
            return [self.value(etype) for _ in range(n)]
        raise GGUFError(f"{self.path}: corrupt GGUF metadata: unknown value type {vtype} at offset {self.pos}")


class GGUFFile:
    """An open GGUF file: `metadata` (key -> value), `tensors` (name -> TensorInfo).

    Arrays of numbers come back as numpy arrays, arrays of strings as lists of str.
    """

    def __init__(self, path: str) -> None:
        self.path = str(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 24:
                    raise GGUFError(f"{self.path}: not a GGUF file or truncated ({size} bytes)")
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise GGUFError(f"{self.path}: cannot open GGUF file: {exc}") from None
        self.file_size = size
        cur = _Cursor(memoryview(self._mmap), self.path)
        if bytes(cur.take(4)) != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (missing the 'GGUF' magic bytes)")
        self.version = cur.u32()
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (supported: 2, 3; "
                            "version 1 files and big-endian files must be re-converted)")
        num_tensors, num_kv = cur.count("tensor"), cur.count("metadata")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.u32())
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            num_dims = cur.u32()
            if num_dims > 8:
                raise GGUFError(f"{self.path}: corrupt tensor info for {name!r}: {num_dims} dimensions")
            dims = [cur.u64() for _ in range(num_dims)]
            infos.append((name, tuple(reversed(dims)), cur.u32(), cur.u64()))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: corrupt general.alignment {alignment} (must be a power of two)")
        self.data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, rel in infos:
            self.tensors[name] = self._tensor_info(name, shape, qtype, rel)

    def _tensor_info(self, name: str, shape: tuple[int, ...], qtype: int, rel: int) -> TensorInfo:
        num_bytes = tensor_nbytes(qtype, shape, where=f"{self.path}: tensor {name!r}")
        start = self.data_start + rel
        if start + num_bytes > self.file_size:
            raise GGUFError(
                f"{self.path}: GGUF file is truncated: tensor {name!r} needs bytes {start}..{start + num_bytes} "
                f"but the file has {self.file_size} bytes")
        return TensorInfo(name, shape, qtype, start, num_bytes)

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The tensor's raw bytes as a read-only uint8 view of the mapped file."""
        info = self.tensors[name]
        return np.frombuffer(self._mmap, dtype=np.uint8, count=info.num_bytes, offset=info.offset)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """A metadata value the model cannot do without; missing is a GGUFError naming the key."""
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: GGUF metadata is missing {key!r}")
        return self.metadata[key]


def type_name(qtype: int) -> str:
    return TYPE_NAMES.get(qtype, f"unknown type {qtype}")


def check_supported(qtype: int, where: str) -> tuple[int, int]:
    """(block size, type size) of a type we can dequantize; otherwise a GGUFError naming `where`."""
    if qtype not in BLOCK_LAYOUTS:
        supported = ", ".join(type_name(t) for t in BLOCK_LAYOUTS)
        raise GGUFError(f"{where} has tensor type {type_name(qtype)}, which pagedllm cannot dequantize "
                        f"(supported: {supported})")
    return BLOCK_LAYOUTS[qtype]


def tensor_nbytes(qtype: int, shape: tuple[int, ...], where: str) -> int:
    """Bytes of a tensor of numpy `shape`; its last dim must be a whole number of blocks."""
    block_size, type_size = check_supported(qtype, where)
    if shape and shape[-1] % block_size:
        raise GGUFError(f"{where}: row length {shape[-1]} is not a multiple of the "
                        f"{type_name(qtype)} block size {block_size} (corrupt file?)")
    return int(np.prod(shape, dtype=np.int64)) // block_size * type_size


def is_gguf(path: str) -> bool:
    """True when `path` is a file named *.gguf that starts with the GGUF magic."""
    if not str(path).lower().endswith(".gguf") or not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC
