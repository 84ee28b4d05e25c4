"""Read safetensors files without any tensor framework.

The format is an 8-byte little-endian header length, a JSON header (tensor name ->
dtype, shape, data_offsets; optional ``__metadata__`` of strings) and the raw data. Parsing it
here lets validation run where torch is not installed (eagle3-data) and report a corrupt file
precisely instead of failing inside a framework.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# numpy views of the raw bytes; BF16 and FP8 are viewed as unsigned integers of their width.
NUMPY_VIEWS: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "F8_E4M3": np.dtype(np.uint8),
    "F8_E5M2": np.dtype(np.uint8),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "F32": np.dtype("<f4"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
    "F64": np.dtype("<f8"),
}
# Bytes per element of every safetensors dtype.
DTYPE_SIZES: dict[str, int] = {name: view.itemsize for name, view in NUMPY_VIEWS.items()}

MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsFormatError(ValueError):
    """The file is not a well-formed safetensors file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


@dataclass(frozen=True)
class SafetensorsFile:
    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]

    def raw(self, name: str) -> memoryview:
        """The tensor's raw little-endian bytes (memory-mapped, read-only)."""
        info = self.tensors[name]
        with open(self.path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return memoryview(mapped)[info.start : info.end]

    def array(self, name: str) -> np.ndarray:
        """The tensor as a numpy array (BF16/FP8 as same-width unsigned integers)."""
        info = self.tensors[name]
        return np.frombuffer(self.raw(name), dtype=NUMPY_VIEWS[info.dtype]).reshape(info.shape)


def read_safetensors(path: str | Path) -> SafetensorsFile:
    """Parse and check the header: sizes, offsets contiguous and inside the file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SafetensorsFormatError(
                f"{path}: truncated, {size} bytes is shorter than the 8-byte header length"
            )
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise SafetensorsFormatError(
                f"{path}: header length {header_len} does not fit in a file of {size} bytes (truncated or not safetensors)"
            )
        try:
            header = json.loads(f.read(header_len).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsFormatError(f"{path}: header is not valid UTF-8 JSON ({e})") from e
    if not isinstance(header, dict):
        raise SafetensorsFormatError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError) as e:
            raise SafetensorsFormatError(
                f"{path}: tensor {name!r}: malformed header entry {entry!r}"
            ) from e
        if dtype not in DTYPE_SIZES:
            raise SafetensorsFormatError(f"{path}: tensor {name!r}: unknown dtype {dtype!r}")
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if end - begin != numel * DTYPE_SIZES[dtype]:
            raise SafetensorsFormatError(
                f"{path}: tensor {name!r}: {end - begin} bytes stored, {dtype} {shape} needs {numel * DTYPE_SIZES[dtype]}"
            )
        tensors[name] = TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)
    covered = sorted((t.start, t.end) for t in tensors.values())
    cursor = data_start
    for begin, end in covered:
        if begin != cursor:
            raise SafetensorsFormatError(
                f"{path}: tensor data is not contiguous at byte {cursor} (next tensor starts at {begin})"
            )
        cursor = end
    if cursor != size:
        raise SafetensorsFormatError(
            f"{path}: file has {size} bytes but its header describes {cursor} (truncated or trailing garbage)"
        )
    return SafetensorsFile(path, tensors, metadata)


def nonfinite_count(array: np.ndarray, dtype: str) -> int:
    """Number of NaN/Inf elements of a tensor given as its raw numpy view."""
    if dtype in ("F16", "F32", "F64"):
        return int(np.count_nonzero(~np.isfinite(array)))
    if dtype == "BF16":  # exponent bits all ones
        return int(np.count_nonzero((array & 0x7F80) == 0x7F80))
    if dtype == "F8_E4M3":  # e4m3fn has no Inf; NaN is S.1111.111
        return int(np.count_nonzero((array & 0x7F) == 0x7F))
    if dtype == "F8_E5M2":
        return int(np.count_nonzero((array & 0x7C) == 0x7C))
    return 0
