"""Read a GGUF file's header (metadata keys and tensor infos) lazily from a memory map, in milliseconds.

vLLM reads GGUF headers through the `gguf` library's `GGUFReader` (`model_loader/gguf_loader.py`,
`transformers_utils/config.py`), which builds a NumPy view for every element of every key: for a
49,152-token vocabulary and its 48,900 merges that is about a million small arrays, seconds per process.
This reader walks the same layout (GGUF v2/v3, little-endian; `gguf-py/gguf/gguf_reader.py` and
llama.cpp's `ggml/src/gguf.cpp`) with `struct` over an `mmap`: scalars and single strings are decoded
as read, numeric arrays become one NumPy view over the map, and an array of strings is only skipped
(its lengths walked) until `value(key)` asks for it, then decoded once and kept. The value and tensor
type codes are the library's (`GGUFValueType`, `GGMLQuantizationType`, `GGML_QUANT_SIZES`).

Layout (all little-endian):

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x   key: string | value_type u32 | value
    tensor_count x   name: string | n_dims u32 | dims u64 x n_dims (innermost first) | ggml_type u32 | offset u64
    padding to general.alignment (u32, default 32) | tensor data (each offset relative to its start, aligned)

    string = length u64 | UTF-8 bytes;  array = item_type u32 | count u64 | count items (arrays may nest)

Every problem (not GGUF, a version other than 2 or 3, a big-endian file, truncated anywhere, a string
or an array past the end, an unknown value or tensor type, a duplicate key or tensor, a bad alignment,
an unaligned or out-of-file tensor) is one `CheckpointError` naming the file and what is wrong.

Left out: writing (the `gguf` library's GGUFWriter does it), big-endian files, and GGUF v1 (which
stored lengths as u32; llama.cpp dropped it in 2023).
"""

from __future__ import annotations

import functools
import importlib.metadata
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from attention_kv_caceh.model_executor.checkpoint import CheckpointError

__all__ = ["GGUF_MAGIC", "GGUFFile", "TensorInfo", "open_gguf"]

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# value type -> (struct format, NumPy dtype) of the fixed-size types
_SCALARS: dict[GGUFValueType, tuple[str, type[np.generic]]] = {
    GGUFValueType.UINT8: ("<B", np.uint8),
    GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16),
    GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32),
    GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32),
    GGUFValueType.UINT64: ("<Q", np.uint64),
    GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
    GGUFValueType.BOOL: ("<?", np.bool_),
}
# tensor types stored as plain elements (the rest: raw blocks, uint8 rows), as GGUFReader views them
_ELEMENT_DTYPES: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in the header.

    dims: GGUF's order, innermost (contiguous) first, as the file lists them. offset: the absolute byte
    offset of its data in the file. n_bytes: its size on disk. data: a read-only view of those bytes
    over the memory map, shaped as `GGUFReader` shapes `ReaderTensor.data`: F32/F16/F64/I8..I64 as that
    dtype with `reversed(dims)`; block types as uint8 with the last dim in bytes (`quant_shape_to_byte_shape`).
    """

    name: str
    tensor_type: GGMLQuantizationType
    dims: tuple[int, ...]
    offset: int
    n_bytes: int
    data: npt.NDArray[Any]

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64))


@dataclass
class _Field:
    """A key's value types (GGUFReader's `ReaderField.types`: [ARRAY, ..., item type]) and where its
    value lies: decoded `value`, or for an array of strings the offset and count to decode on demand."""

    types: list[GGUFValueType]
    value: Any = None
    strings_at: tuple[int, int] | None = None  # (offset of the first string, count)


class GGUFFile:
    """The header of one GGUF file, memory-mapped; tensors' data are views of the map.

    `keys` (file order), `value(key)`, `types(key)`, `array(key)`, `tensors` (file order), `version`,
    `alignment`, `data_offset`, `size`. Raises CheckpointError (from the constructor) for any problem
    the module docstring lists. The map stays open while a view of it lives.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with self.path.open("rb") as fh:
                self.size = int(fh.seek(0, 2))
                if self.size < 4:
                    raise self._error(f"not a GGUF file ({self.size} bytes, shorter than the magic)")
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as err:
            raise CheckpointError(f"{self.path}: cannot read it ({err.strerror or err})") from err
        magic = bytes(self._map[:4])
        if magic != GGUF_MAGIC:
            raise self._error(f"not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
        self.version = self._u32(4, "the version")
        if self.version not in VERSIONS:
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            why = "a big-endian file, which is not read" if swapped in VERSIONS else "readable: 2, 3"
            raise self._error(f"GGUF version {self.version} ({why})")
        tensor_count = self._u64(8, "the tensor count")
        kv_count = self._u64(16, "the key count")
        offset = 24
        self._fields: dict[str, _Field] = {}
        # a key takes at least 13 bytes, a tensor info 24: a count past that is corrupt, not a long loop
        self._check_count(kv_count, 12, offset, "keys")
        for _ in range(kv_count):
            key, offset = self._string(offset, "a key name")
            if key in self._fields:
                raise self._error(f"key {key!r} appears twice")
            raw = self._u32(offset, f"key {key!r}: its type")
            field = _Field([])
            offset = self._value(offset + 4, raw, key, field, field.types, depth=0)
            self._fields[key] = field
        self.alignment = self._alignment()
        self._check_count(tensor_count, 24, offset, "tensors")
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(tensor_count):
            name, offset = self._string(offset, "a tensor name")
            n_dims = self._u32(offset, f"tensor {name!r}: its dimension count")
            if n_dims > 4:  # GGML_MAX_DIMS; llama.cpp refuses more too
                raise self._error(f"tensor {name!r}: {n_dims} dimensions (GGML has at most 4)")
            dims = tuple(self._u64(offset + 4 + 8 * i, f"tensor {name!r}: its dims") for i in range(n_dims))
            offset += 4 + 8 * n_dims
            raw_type = self._u32(offset, f"tensor {name!r}: its type")
            relative = self._u64(offset + 4, f"tensor {name!r}: its offset")
            infos.append((name, dims, raw_type, relative))
            offset += 12
        self.data_offset = -(-offset // self.alignment) * self.alignment
        self.tensors = self._tensors(infos)

    # -- values ----------------------------------------------------------------------------------

    @property
    def keys(self) -> list[str]:
        """Every metadata key, in file order."""
        return list(self._fields)

    def __contains__(self, key: object) -> bool:
        return key in self._fields

    def types(self, key: str) -> list[GGUFValueType]:
        """The value types of `key` as GGUFReader's `ReaderField.types` lists them ([UINT32], [STRING],
        [ARRAY, STRING], [ARRAY, ARRAY, INT32] for nested arrays), [] when absent."""
        field = self._fields.get(key)
        return [] if field is None else list(field.types)

    def value(self, key: str, default: Any = None) -> Any:
        """The value of `key` as Python: int, float, bool, str, or a list of them (nested lists for
        nested arrays); `default` when absent. An array of strings is decoded on the first call."""
        field = self._fields.get(key)
        if field is None:
            return default
        if field.strings_at is not None:
            start, count = field.strings_at
            field.value = self._strings(start, count, key)
            field.strings_at = None
        value = field.value
        if isinstance(value, np.ndarray):
            return value.tolist()  # pyright: ignore[reportUnknownVariableType, reportUnknownMemberType]
        return value

    def array(self, key: str) -> npt.NDArray[Any] | None:
        """A numeric array's values as a read-only NumPy view of the map (token scores, token types),
        without building Python numbers; None when absent or not a flat numeric array."""
        field = self._fields.get(key)
        if field is None or not isinstance(field.value, np.ndarray):
            return None
        return field.value  # pyright: ignore[reportUnknownVariableType]

    # -- parsing ---------------------------------------------------------------------------------

    def _error(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {why}")

    def _need(self, offset: int, n: int, what: str) -> None:
        if offset + n > self.size:
            raise self._error(
                f"truncated GGUF file: {what} needs bytes {offset:,}..{offset + n:,}, the file has {self.size:,}"
            )

    def _u32(self, offset: int, what: str) -> int:
        self._need(offset, 4, what)
        return int(_U32.unpack_from(self._map, offset)[0])

    def _u64(self, offset: int, what: str) -> int:
        self._need(offset, 8, what)
        return int(_U64.unpack_from(self._map, offset)[0])

    def _check_count(self, count: int, least: int, offset: int, what: str) -> None:
        if count * least > self.size - offset:
            raise self._error(
                f"truncated or corrupt GGUF file: the header declares {count:,} {what}, more than the {self.size - offset:,} bytes left can hold"
            )

    def _string(self, offset: int, what: str) -> tuple[str, int]:
        n = self._u64(offset, what)
        if offset + 8 + n > self.size:
            raise self._error(
                f"truncated or corrupt GGUF file: {what}: a string of {n:,} bytes at byte {offset:,} runs "
                "past the end of the file "
                f"({self.size:,} bytes)"
            )
        raw = self._map[offset + 8 : offset + 8 + n]
        try:
            return raw.decode("utf-8"), offset + 8 + n
        except UnicodeDecodeError as err:
            raise self._error(f"{what}: the string at byte {offset:,} is not UTF-8 ({err.reason})") from None

    def _value(
        self, offset: int, raw: int, key: str, field: _Field, types: list[GGUFValueType], depth: int
    ) -> int:
        """Parse one value of type code `raw` at `offset` into `field` (depth 0) and return the offset
        after it; nested array items (depth > 0) are stored as nested lists."""
        try:
            kind = GGUFValueType(raw)
        except ValueError:
            raise self._error(f"key {key!r}: unknown value type {raw}") from None
        types.append(kind)
        if kind in _SCALARS:
            fmt, _ = _SCALARS[kind]
            size = struct.calcsize(fmt)
            self._need(offset, size, f"key {key!r}")
            field.value = struct.unpack_from(fmt, self._map, offset)[0]
            return offset + size
        if kind == GGUFValueType.STRING:
            field.value, end = self._string(offset, f"key {key!r}")
            return end
        item_raw = self._u32(offset, f"key {key!r}: its item type")
        count = self._u64(offset + 4, f"key {key!r}: its length")
        offset += 12
        try:
            item = GGUFValueType(item_raw)
        except ValueError:
            raise self._error(f"key {key!r}: unknown array item type {item_raw}") from None
        if count:  # GGUFReader lists the item type only for a non-empty array
            types.append(item)
        if item in _SCALARS:
            fmt, dtype = _SCALARS[item]
            size = struct.calcsize(fmt) * count
            if offset + size > self.size:
                raise self._error(
                    f"truncated or corrupt GGUF file: key {key!r}: an array of {count:,} {item.name} at "
                    f"byte {offset:,} runs past the end "
                    f"of the file ({self.size:,} bytes)"
                )
            field.value = np.frombuffer(
                self._map, dtype=np.dtype(dtype).newbyteorder("<"), count=count, offset=offset
            )
            return offset + size
        if item == GGUFValueType.STRING:
            self._check_count(count, 8, offset, f"strings in key {key!r}")
            start = offset
            for _ in range(count):  # walk the lengths only; decode on demand
                n = self._u64(offset, f"key {key!r}: a string length")
                offset += 8 + n
                if offset > self.size:
                    raise self._error(
                        f"truncated or corrupt GGUF file: key {key!r}: a string of {n:,} bytes at byte "
                        f"{offset - n - 8:,} runs past the end "
                        f"of the file ({self.size:,} bytes)"
                    )
            if depth == 0:
                field.strings_at = (start, count)
            else:
                field.value = self._strings(start, count, key)
            return offset
        # an array of arrays: each item parsed on its own, kept as a list
        if depth > 8:
            raise self._error(f"key {key!r}: arrays nested deeper than 8")
        self._check_count(count, 12, offset, f"arrays in key {key!r}")
        items: list[Any] = []
        for i in range(count):
            sub = _Field([])
            offset = self._value(offset, item_raw, key, sub, sub.types, depth + 1)
            if i == 0:
                types += sub.types[1:]  # the first item's nested types, as GGUFReader lists them
            value = sub.value
            items.append(value.tolist() if isinstance(value, np.ndarray) else value)  # pyright: ignore[reportUnknownMemberType]
        field.value = items
        return offset

    def _strings(self, offset: int, count: int, key: str) -> list[str]:
        out: list[str] = []
        data = self._map
        unpack = _U64.unpack_from
        try:
            for _ in range(count):
                (n,) = unpack(data, offset)
                out.append(data[offset + 8 : offset + 8 + n].decode("utf-8"))
                offset += 8 + n
        except UnicodeDecodeError as err:
            raise self._error(f"key {key!r}: string {len(out)} is not UTF-8 ({err.reason})") from None
        return out

    def _alignment(self) -> int:
        field = self._fields.get("general.alignment")
        if field is None:
            return DEFAULT_ALIGNMENT
        value = field.value
        if (
            field.types != [GGUFValueType.UINT32]
            or not isinstance(value, int)
            or value < 1
            or value & (value - 1)
        ):
            raise self._error(f"key 'general.alignment': must be a power of two (uint32), got {value!r}")
        return value

    def _tensors(self, infos: list[tuple[str, tuple[int, ...], int, int]]) -> list[TensorInfo]:
        out: list[TensorInfo] = []
        seen: set[str] = set()
        for name, dims, raw_type, relative in infos:
            if name in seen:
                raise self._error(f"tensor {name!r} appears twice")
            seen.add(name)
            try:
                kind = GGMLQuantizationType(raw_type)
            except ValueError:
                raise self._error(
                    f"tensor {name!r} has GGML type {raw_type}, which gguf "
                    f"{importlib.metadata.version('gguf')} does not define"
                ) from None
            if relative % self.alignment:
                raise self._error(
                    f"tensor {name!r}: data offset {relative:,} is not a multiple of the alignment {self.alignment}"
                )
            block_size, type_size = GGML_QUANT_SIZES[kind]
            n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
            if dims and dims[0] % block_size:
                raise self._error(
                    f"tensor {name!r}: a row of {dims[0]} is not a multiple of {kind.name}'s block of {block_size}"
                )
            n_bytes = n_elements // block_size * type_size
            start = self.data_offset + relative
            if start + n_bytes > self.size:
                raise self._error(
                    f"truncated GGUF file: tensor {name!r} ends at byte {start + n_bytes:,}, the file has "
                    f"{self.size:,}"
                )
            shape = tuple(reversed(dims))
            if kind in _ELEMENT_DTYPES:
                dtype = np.dtype(_ELEMENT_DTYPES[kind]).newbyteorder("<")
                data = np.frombuffer(self._map, dtype=dtype, count=n_elements, offset=start)
            else:
                data = np.frombuffer(self._map, dtype=np.uint8, count=n_bytes, offset=start)
                shape = (*shape[:-1], shape[-1] // block_size * type_size) if shape else shape
            out.append(TensorInfo(name, kind, dims, start, n_bytes, data.reshape(shape)))
        return out


@functools.lru_cache(maxsize=8)
def _cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    del size, mtime_ns  # part of the cache key only
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed header of `path`, once per process and file version (size, mtime): the engine opens a
    file for its config, its tokenizer, its chat template and its weights. Raises CheckpointError."""
    file = Path(path)
    try:
        stat = file.stat()
    except OSError as err:
        raise CheckpointError(f"{file}: cannot read it ({err.strerror or err})") from err
    return _cached(str(file), stat.st_size, stat.st_mtime_ns)
