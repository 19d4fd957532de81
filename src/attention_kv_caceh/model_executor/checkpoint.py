"""Read a local Hugging Face checkpoint folder: `config.json` and `*.safetensors` tensors as NumPy arrays.

What vLLM spreads over `model_executor/model_loader/` (weight_utils.py's safetensors iterators, the
default loader's index handling) at this project's size: one folder on disk, no hub downloads, no
torch. Tensors come through the `safetensors` library's NumPy API, except bfloat16: NumPy has no such
dtype (`safe_open(..., framework="np").get_tensor` raises `TypeError: data type 'bfloat16' not
understood`), so a BF16 tensor's raw bytes are read from the offsets in the file header and widened
exactly, `float32 bits = bf16 bits << 16`.

Layouts read: one `model.safetensors`; shards listed by `model.safetensors.index.json` (`weight_map`,
tensor name -> file); or, without an index, every `*.safetensors` file in the folder.

Every problem with the folder (missing file or key, unknown dtype, tensor of the wrong shape, a setting
the model does not implement, a config value of the wrong type, a truncated or corrupt safetensors file,
an unreadable file) is one `CheckpointError`, a ValueError whose message names the file and the key:
every safetensors read goes through `_reading`, which turns the library's SafetensorError, an OSError
(a failed read or mmap) and a malformed header into one.

Left out: hub downloads, PyTorch `.bin` / `.pt` weights, sharding weights across tensor-parallel ranks at
load, quantized safetensors checkpoints (AWQ, GPTQ, FP8, ...), and vLLM's other loaders (tensorizer,
bitsandbytes, sharded state, the Run:ai streamer); GGUF files are read by gguf_checkpoint.py.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Generator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError, safe_open

__all__ = ["CheckpointError", "SafetensorsCheckpoint", "read_config_json", "widen_bfloat16"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype names -> NumPy dtypes for the floating types `safe_open(framework="np")` returns.
_NUMPY_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}


class CheckpointError(ValueError):
    """A checkpoint folder this package cannot load; the message names the file and the key."""


def read_config_json(folder: str | Path) -> dict[str, Any]:
    """Parse `folder/config.json` into a dict.

    Raises CheckpointError when the file is missing, is not valid JSON, or is not a JSON object.
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found (a Hugging Face model folder needs config.json)")
    try:
        config: object = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return dict(config)  # pyright: ignore[reportUnknownArgumentType]


def widen_bfloat16(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    """bfloat16 bit patterns (uint16, any shape) -> the same values as float32, exactly.

    bfloat16 is the upper half of an IEEE float32 (1 sign, 8 exponent, 7 mantissa bits), so shifting
    the 16 bits into the high half of a uint32 and viewing it as float32 loses nothing.
    """
    return (bits.astype(np.uint32) << 16).view(np.float32)


class SafetensorsCheckpoint:
    """The tensors of one checkpoint folder, by Hugging Face name, loaded one at a time on request.

    `names` lists every tensor in the folder; `shape(name)` and `get(name, dtype)` read one. Files are
    opened per call (safetensors memory-maps them), so no handle stays open.

    Raises CheckpointError (from the constructor) when the folder has no safetensors file, the index
    is unreadable, or the index names a file that does not exist.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._file_of: dict[str, Path] = {}
        index = self.folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map: object = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index}: unreadable index, key 'weight_map' ({err!r})") from err
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: key 'weight_map' must be an object")
            for name, file in weight_map.items():  # pyright: ignore[reportUnknownVariableType]
                shard = self.folder / str(file)  # pyright: ignore[reportUnknownArgumentType]
                if not shard.is_file():
                    raise CheckpointError(f"{index}: key {name!r} points to missing file {shard.name}")
                self._file_of[str(name)] = shard  # pyright: ignore[reportUnknownArgumentType]
            self.source = index
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.folder / SINGLE_FILE}: file not found (no *.safetensors)")
            for file in files:
                with _reading(file), _open(file) as f:
                    for name in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                        self._file_of[name] = file
            self.source = files[0] if len(files) == 1 else self.folder

    @property
    def names(self) -> list[str]:
        """Every tensor name in the folder, sorted."""
        return sorted(self._file_of)

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def _file(self, name: str) -> Path:
        try:
            return self._file_of[name]
        except KeyError:
            raise CheckpointError(f"{self.source}: missing tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor `name`. Raises CheckpointError when it is absent."""
        file = self._file(name)
        with _reading(file, name), _open(file) as f:
            return tuple(f.get_slice(name).get_shape())

    def get(self, name: str, dtype: npt.DTypeLike) -> npt.NDArray[np.floating[Any]]:
        """Tensor `name` as a new C-contiguous array of floating `dtype` (F64/F32/F16/BF16 on disk).

        BF16 and F16 widen exactly to float32/float64; narrowing (float32 on disk to a float16
        engine dtype, say) rounds to nearest. Raises CheckpointError when the tensor is absent or has
        a non-floating dtype on disk.
        """
        file = self._file(name)
        with _reading(file, name), _open(file) as f:
            stored = f.get_slice(name).get_dtype()
            if stored in _NUMPY_DTYPES:
                return np.ascontiguousarray(f.get_tensor(name), dtype=dtype)
        if stored == "BF16":
            with _reading(file, name):
                raw = _read_raw(file, name, np.uint16)
            return np.ascontiguousarray(widen_bfloat16(raw), dtype=dtype)
        raise CheckpointError(f"{file}: tensor {name!r} has dtype {stored}, expected F32, F16, BF16 or F64")


@contextlib.contextmanager
def _reading(file: Path, name: str | None = None) -> Generator[None]:
    """Turn any failure to read safetensors `file` (tensor `name`) into one CheckpointError naming both.

    Caught: SafetensorError (a header that does not parse, a file shorter than its header says), OSError
    (open, read, mmap), and the ValueError / KeyError / struct.error of a malformed header read by hand.
    """
    where = f"{file}" if name is None else f"{file}: tensor {name!r}"
    try:
        yield
    except CheckpointError:
        raise
    except (SafetensorError, OSError, struct.error, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{where}: not a readable safetensors file ({err})") from err


def _open(file: Path) -> Any:
    """`safe_open(file, framework="np")`: a context manager with keys(), get_slice(), get_tensor()."""
    return safe_open(file, framework="np")


def _read_raw(file: Path, name: str, dtype: type[np.uint16]) -> npt.NDArray[np.uint16]:
    """Tensor `name` of `file` as raw elements of `dtype`, by the offsets in the safetensors header.

    Format (safetensors README): 8-byte little-endian header length n, n bytes of JSON mapping each
    name to {dtype, shape, data_offsets: [begin, end]}, then the data, offsets counted from its start.
    """
    with file.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        entry: dict[str, Any] = json.loads(fh.read(n))[name]
        begin, end = (int(x) for x in entry["data_offsets"])
        shape = tuple(int(s) for s in entry["shape"])
        fh.seek(8 + n + begin)
        raw = fh.read(end - begin)
        if len(raw) != end - begin:
            raise CheckpointError(f"{file}: tensor {name!r} is truncated ({len(raw)} of {end - begin} bytes)")
        data = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
    if data.size != int(np.prod(shape)):
        raise CheckpointError(f"{file}: tensor {name!r} holds {data.size} elements, shape says {shape}")
    return data.reshape(shape).astype(dtype)
