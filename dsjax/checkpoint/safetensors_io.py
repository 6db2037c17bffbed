"""Memory-mapped reading and plain writing of .safetensors files.

Read with numpy views over np.memmap, so tensors are paged in one at a time and never copied whole;
bf16 and fp8 come through ml_dtypes. A header that does not parse, offsets past the end of the file
(a truncated download) or an unknown dtype raise ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint we cannot load; the message lists every problem found."""


DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class SafetensorsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > size - 8:
                    raise CheckpointError(f"{self.path}: header length {header_len} exceeds file size {size}")
                header = json.loads(f.read(header_len))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: not a readable safetensors file ({e})") from e
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self.tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            if dtype not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name!r} has dtype {dtype}; "
                                      f"accepted: {', '.join(DTYPES)}")
            if self._data_start + end > size:
                raise CheckpointError(f"{self.path}: truncated: tensor {name!r} ends at byte "
                                      f"{self._data_start + end} but the file has {size} bytes")
            if end - begin != np.dtype(DTYPES[dtype]).itemsize * int(np.prod(shape, dtype=np.int64)):
                raise CheckpointError(f"{self.path}: tensor {name!r} byte range does not match {dtype}{list(shape)}")
            self.tensors[name] = (dtype, shape, begin, end)
        self._mmap = None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][1]

    def dtype(self, name: str) -> str:
        return self.tensors[name][0]

    def get(self, name: str) -> np.ndarray:
        """A read-only view of the tensor, backed by the memory map."""
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        dtype, shape, begin, end = self.tensors[name]
        raw = self._mmap[self._data_start + begin:self._data_start + end]
        return raw.view(DTYPES[dtype]).reshape(shape)


def save_file(tensors: dict[str, np.ndarray], path: str | Path, metadata: dict[str, str] | None = None):
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = {}
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        arrays[name] = a
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(arrays):
            f.write(arrays[name].tobytes())
