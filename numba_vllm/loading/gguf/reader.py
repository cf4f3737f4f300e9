"""Reading a GGUF file: the header's typed metadata and tensor table; tensor data dequantized on demand.

A GGUF file is a header of typed key/value metadata (hyperparameters, vocabulary, merges, chat
template), a table of tensors (name, dimensions, ggml type, offset), then the aligned tensor data,
usually block-quantized (Q4_1 stores each run of 32 weights as 4-bit integers plus an f16 scale and
minimum). The header is parsed here with `struct`: `gguf.GGUFReader` builds a NumPy view per string
and takes seconds on a 49k-token vocabulary. Dequantization is the `gguf` package's.

What the metadata and tensors mean for a Llama model is `gguf.py`'s business; the vocabulary's is
`gguf_tokenizer.py`'s.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
DEFAULT_ALIGNMENT = 32

# Metadata value types of the GGUF format (8 = string and 9 = array are read separately).
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class GGUFError(ValueError):
    """A GGUF file is missing, malformed, truncated, or holds a model or tensor type we do not support."""


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table."""

    name: str
    shape: tuple[int, ...]  # NumPy order: (out, in) for a weight matrix
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


@dataclass
class GGUFFile:
    """A parsed GGUF header; tensor data stays in the memory-mapped file until asked for."""

    path: Path
    metadata: dict[str, Any]  # numeric arrays as NumPy arrays, string arrays as lists
    tensors: dict[str, GGUFTensor]
    buffer: mmap.mmap

    def meta(self, key: str, kind: type, default: Any = None, required: bool = False) -> Any:
        """Metadata value `key` checked to be of `kind` (int, float, str or bool); None if absent."""
        value = self.metadata.get(key, default)
        if value is None:
            if required:
                raise GGUFError(f"{self.path}: metadata {key} is missing")
            return None
        accepted = (int, float) if kind is float else kind
        if not isinstance(value, accepted) or (isinstance(value, bool) and kind is not bool):
            raise GGUFError(f"{self.path}: metadata {key} is {value!r}, expected {kind.__name__}")
        return float(value) if kind is float else value

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor `name` as a float32 array of its NumPy shape, owning its memory."""
        t = self.tensors[name]
        if t.qtype not in SUPPORTED_TYPES:
            supported = ", ".join(q.name for q in SUPPORTED_TYPES)
            raise GGUFError(
                f"{self.path}: tensor {name!r} has type {t.qtype.name}, which is not supported (supported: {supported})"
            )
        block, type_size = GGML_QUANT_SIZES[t.qtype]
        raw = np.frombuffer(self.buffer, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        rows = raw.reshape(*t.shape[:-1], t.shape[-1] // block * type_size)  # (..., bytes per row) uint8
        out = dequantize(rows, t.qtype)  # (..., t.shape[-1]) float32
        return out.copy() if t.qtype == Q.F32 else out.astype(np.float32, copy=False)  # F32 is a view of the file


class _Cursor:
    """Little-endian reads from the mapped file; running off its end means the file is truncated."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.path, self.pos = buf, path, 0

    def truncated(self) -> GGUFError:
        return GGUFError(f"{self.path}: truncated or corrupt GGUF header (ends inside byte {self.pos})")

    def scalar(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise self.truncated() from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise self.truncated()
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: a metadata string at byte {self.pos - n} is not valid UTF-8") from None

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.scalar("<I"), self.scalar("<Q")
            if n > len(self.buf) - self.pos:  # every element takes at least one byte
                raise self.truncated()
            if etype in _SCALAR_FORMATS:  # numbers: one NumPy read, not n struct calls
                dtype = np.dtype(_SCALAR_FORMATS[etype])
                if self.pos + n * dtype.itemsize > len(self.buf):
                    raise self.truncated()
                arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).copy()
                self.pos += n * dtype.itemsize
                return arr
            return [self.value(etype) for _ in range(n)]
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype} at byte {self.pos - 4}")
        value = self.scalar(fmt)
        # An f32 read as a Python float shows its binary error (1e-5 -> 9.99999974e-06); keep the
        # shortest decimal that rounds to the same f32, which is what the converter was given.
        return float(str(np.float32(value))) if vtype == _FLOAT32 else value


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor table (v2 or v3, little-endian); data stays mapped."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic != b"GGUF":
                raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise GGUFError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise GGUFError(f"{path}: is a directory, not a GGUF file") from None
    except OSError as e:
        raise GGUFError(f"{path}: cannot read ({e.strerror or e})") from None
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise GGUFError(f"{path}: GGUF version {version} is not supported (supported: 2, 3){hint}")
    num_tensors, num_kv = cur.scalar("<Q"), cur.scalar("<Q")
    if num_tensors > len(buf) or num_kv > len(buf):
        raise cur.truncated()
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        num_dims = cur.scalar("<I")
        dims = [cur.scalar("<Q") for _ in range(num_dims)]  # fastest-varying first
        infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: general.alignment {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, type_id, offset in infos:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has unknown ggml type {type_id}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims and dims[0] % block:
            raise GGUFError(f"{path}: tensor {name!r} has rows of {dims[0]}, not a multiple of the {qtype.name} block ({block})")
        nbytes = math.prod(dims) // block * type_size
        start = data_start + offset
        if start + nbytes > len(buf):
            raise GGUFError(f"{path}: truncated (tensor {name!r} ends at byte {start + nbytes}, the file has {len(buf)})")
        tensors[name] = GGUFTensor(name, tuple(reversed(dims)), qtype, start, nbytes)
    return GGUFFile(path, metadata, tensors, buf)
