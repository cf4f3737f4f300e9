"""Safetensors checkpoints into NumPy (no torch): read through a memory map of our own, written with
the `safetensors` package.

A `.safetensors` file is: 8 bytes (little-endian u64) giving the header length N, N bytes of JSON
mapping each tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to
the end of the header), then the raw little-endian tensor bytes. Large checkpoints are split into
shards listed by `model.safetensors.index.json` (`weight_map`: tensor name -> shard file).

Reading is a memory map: a tensor is a read-only view into the file, copied only when the caller
converts it, so opening a checkpoint costs nothing and its bytes are paged in as each tensor is
uploaded or converted. The package's NumPy API (`safetensors.numpy`, `safe_open(framework="np")`,
as of safetensors 0.8.0) cannot do that: it does hand out BF16 as ml_dtypes' bfloat16, but every tensor it
returns is a fresh, writable copy of the bytes. On a 256 MiB bf16 file, `load_file` grew the process
by 256 MiB (0.15 to 1.6 s); this reader took under 1 ms and grew it by nothing. So the reader
stays, with its own checks: every tensor the config asks for must be present with the exact shape; a
truncated or corrupt file, a missing tensor or a wrong shape raises `WeightsError` with one line
naming the file or tensor. Writing (`save_safetensors`, used by `convert` and the tests) has no such
trade-off and uses the package (imported there: loading a checkpoint does not need it).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np

from numba_vllm.loading.bf16 import BF16
from numba_vllm.model.config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit

# safetensors dtype tag -> NumPy dtype (little-endian): what the reader reads, and so what the writer accepts.
_DTYPES: dict[str, np.dtype] = {
    "BF16": BF16,
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "BOOL": np.dtype("?"),
}


class WeightsError(ValueError):
    """A checkpoint file is missing, corrupt, or does not match the model config."""


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Memory-map every tensor of one `.safetensors` file: name -> read-only array view."""
    path = Path(path)
    header, data_start, size = _read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    tensors: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _entry(path, name, info)
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise WeightsError(f"{path}: tensor {name!r} claims {end - begin} bytes, its shape {shape} needs {nbytes}")
        if data_start + end > size:
            raise WeightsError(f"{path}: truncated (tensor {name!r} ends at byte {data_start + end}, file has {size})")
        tensors[name] = mm[data_start + begin : data_start + end].view(dtype).reshape(shape)
    return tensors


def read_metadata(path: str | Path) -> dict[str, str]:
    """The free-form `__metadata__` string map of a `.safetensors` file."""
    header, _, _ = _read_header(Path(path))
    return dict(header.get("__metadata__", {}))


def save_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write tensors (float32 / float16 / bf16 / ints / bool) to one `.safetensors` file.

    Only dtypes `read_safetensors` reads are accepted. The file appears under its name only once
    complete: it is written beside it and renamed.
    """
    from safetensors.numpy import save_file

    arrays = {}
    for name, t in tensors.items():
        a = np.ascontiguousarray(t)  # the package writes the array's memory as it lies
        if a.dtype.newbyteorder("<") not in _DTYPES.values():
            raise WeightsError(f"tensor {name!r}: dtype {a.dtype} is not one read_safetensors reads")
        arrays[name] = a
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    try:
        save_file(arrays, tmp, metadata={str(k): str(v) for k, v in metadata.items()} if metadata else None)
    except BaseException:  # a failure or Ctrl-C: leave nothing half-written behind
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)  # never leave a half-written checkpoint under the real name


def load_weights(model_dir: str | Path, config: ModelConfig) -> dict[str, np.ndarray]:
    """All weights the config needs, by Hugging Face name, memory-mapped in their stored dtype.

    Reads `model.safetensors`, or the shards named by `model.safetensors.index.json`. Checks every
    expected tensor's presence, float dtype and shape. A tied model gets no `lm_head.weight` (the
    embedding is the head); an untied one must have it.
    """
    model_dir = Path(model_dir)
    tensors = _read_checkpoint(model_dir)
    expected = config.tensor_shapes()
    weights: dict[str, np.ndarray] = {}
    for name, shape in expected.items():
        t = tensors.get(name)
        if t is None:
            raise WeightsError(f"{model_dir}: tensor {name!r} is missing from the checkpoint")
        if tuple(t.shape) != shape:
            raise WeightsError(f"{model_dir}: tensor {name!r} has shape {tuple(t.shape)}, the config expects {shape}")
        if t.dtype not in (BF16, np.dtype("<f2"), np.dtype("<f4")):
            raise WeightsError(f"{model_dir}: tensor {name!r} has dtype {t.dtype}; expected bf16, f16 or f32")
        weights[name] = t
    return weights


def _read_checkpoint(model_dir: Path) -> dict[str, np.ndarray]:
    index = model_dir / INDEX_FILE
    single = model_dir / SINGLE_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightsError(f"{index}: not a valid safetensors index ({e})") from None
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = model_dir / shard
            if not shard_path.is_file():
                raise WeightsError(f"{index}: shard {shard!r} is missing")
            tensors.update(read_safetensors(shard_path))
        missing = [n for n in weight_map if n not in tensors]
        if missing:
            raise WeightsError(f"{index}: tensor {missing[0]!r} is not in its shard {weight_map[missing[0]]!r}")
        return tensors
    if single.is_file():
        return read_safetensors(single)
    raise WeightsError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")


def _read_header(path: Path) -> tuple[dict, int, int]:
    """(header dict, byte offset where tensor data starts, file size)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{path}: not a safetensors file (only {len(head)} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise WeightsError(f"{path}: corrupt or truncated safetensors header (claims {n} bytes, file has {size})")
            raw = f.read(n)
    except OSError as e:
        raise WeightsError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WeightsError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header, 8 + n, size


def _entry(path: Path, name: str, info: object) -> tuple[np.dtype, tuple[int, ...], int, int]:
    try:
        tag = info["dtype"]  # type: ignore[index]
        shape = tuple(int(s) for s in info["shape"])  # type: ignore[index]
        begin, end = (int(o) for o in info["data_offsets"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        raise WeightsError(f"{path}: corrupt header entry for tensor {name!r}") from None
    if tag not in _DTYPES:
        raise WeightsError(f"{path}: tensor {name!r} has unsupported dtype {tag!r}")
    if begin < 0 or end < begin or any(s < 0 for s in shape):
        raise WeightsError(f"{path}: corrupt offsets or shape for tensor {name!r}")
    return _DTYPES[tag], shape, begin, end
