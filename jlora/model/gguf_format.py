"""A GGUF container reader: metadata values and memory-mapped tensor data.

Layout (little-endian, GGUF v2/v3): magic "GGUF", u32 version, u64 tensor count,
u64 metadata count; then each metadata entry (string key, u32 value type, value);
then each tensor's info (string name, u32 rank, u64 dims (innermost first), u32
ggml type, u64 offset); then, aligned to `general.alignment` (default 32), the
tensor data. A string is a u64 byte length and UTF-8 bytes; an array is a u32
element type, a u64 length and the elements.

The `gguf` package's own reader builds a numpy view per string, which takes ~6 s for
a 49k-token vocabulary; this one reads the same values in well under a second.
Dequantization stays with `gguf.quants`.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_RANK = 4
HEADER_BYTES = 24  # magic, version, tensor count, metadata count

# GGUF metadata value types (gguf.GGUFValueType) -> struct format, for scalars.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: outermost first (the reverse of GGUF's dims)
    ggml_type: int  # gguf.GGMLQuantizationType value
    data: np.ndarray  # raw bytes, u8[...]; see `raw_tensor`


class _Cursor:
    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer = memoryview(buffer)  # type: ignore[arg-type]
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        if self.pos + length > len(self.buffer):
            raise GGUFFormatError(f"a string of {length} bytes runs past the end of the file")
        text = bytes(self.buffer[self.pos : self.pos + length]).decode("utf-8")
        self.pos += length
        return text

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])
        if value_type != _ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {value_type}")
        item_type, length = self.unpack("<I"), self.unpack("<Q")
        if length > len(self.buffer) - self.pos:
            raise GGUFFormatError(f"an array of {length} items runs past the end of the file")
        if item_type in _SCALARS:  # read in one go
            dtype = np.dtype(_SCALARS[item_type])
            items = np.frombuffer(self.buffer, dtype, length, self.pos)
            self.pos += items.nbytes
            return items.tolist()
        return [self.value(item_type) for _ in range(length)]


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """(metadata key -> Python value, tensor name -> TensorInfo); raises GGUFFormatError."""
    import gguf

    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise GGUFFormatError(f"{size} bytes is shorter than a GGUF header")
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(buffer)
    try:
        if bytes(buffer[:4]) != MAGIC:
            raise GGUFFormatError(f"magic {bytes(buffer[:4])!r} is not {MAGIC!r}")
        cursor.pos = 4
        version = cursor.unpack("<I")
        if version not in VERSIONS:
            raise GGUFFormatError(f"version {version} is not one of {VERSIONS} (little-endian)")
        tensor_count, metadata_count = cursor.unpack("<Q"), cursor.unpack("<Q")
        if max(tensor_count, metadata_count) > len(buffer):
            raise GGUFFormatError(f"counts {tensor_count}, {metadata_count} exceed the file size")
        metadata = {}
        for _ in range(metadata_count):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.unpack("<I"))
        infos = []
        for _ in range(tensor_count):
            name, rank = cursor.string(), cursor.unpack("<I")
            if rank > MAX_RANK:
                raise GGUFFormatError(f"tensor {name} has rank {rank} > {MAX_RANK}")
            dims = tuple(cursor.unpack("<Q") for _ in range(rank))
            infos.append((name, dims, cursor.unpack("<I"), cursor.unpack("<Q")))
    except (struct.error, UnicodeDecodeError) as err:
        raise GGUFFormatError(f"truncated or corrupt header ({err})") from err

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, dims, ggml_type, offset in infos:
        try:
            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError) as err:
            raise GGUFFormatError(f"tensor {name} has unknown ggml type {ggml_type}") from err
        shape = tuple(reversed(dims))
        if not dims or dims[0] % block:
            raise GGUFFormatError(f"tensor {name}: dims {dims} do not fit blocks of {block}")
        row_bytes = dims[0] // block * block_bytes
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        start = data_start + offset
        if start + rows * row_bytes > len(buffer):
            raise GGUFFormatError(f"tensor {name} runs past the end of the file")
        data = buffer[start : start + rows * row_bytes].reshape(*shape[:-1], row_bytes)
        tensors[name] = TensorInfo(name, shape, ggml_type, data)
    return metadata, tensors
