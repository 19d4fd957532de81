"""A GGUF model split over several files (llama.cpp's `gguf-split`): find and check every part.

llama.cpp's `llama-gguf-split --split` writes `<prefix>-00001-of-00003.gguf` ... `<prefix>-00003-of-00003.gguf`
(`llama_split_path`). The first part holds every metadata key; each part holds the keys `split.no` (u16,
0-based), `split.count` (u16) and `split.tensors.count` (i32, the tensors of the whole model) and its share
of the tensors, each part a complete GGUF file with its own tensor offsets. llama.cpp's loader
(`llama_model_loader`) is given the first part and opens the others by name; so is this. vLLM reads only
single-file GGUF models (its docs ask users to merge split files with `gguf-split --merge`); this follows
llama.cpp. Left out: merging the parts into one file, and parts named other than as `gguf-split` names them.

Refused, each by name: a file that is not the first part, a missing part, a part whose `split.no` or
`split.count` disagrees with its name, a tensor in two parts, a total of tensors other than
`split.tensors.count`.
"""

from __future__ import annotations

import re
from pathlib import Path

from gguf import GGUFValueType

from attention_kv_caceh.model_executor.checkpoint import CheckpointError
from attention_kv_caceh.model_executor.gguf_metadata import GGUFFile, open_gguf

__all__ = ["PART_NAME", "first_part", "part_path", "split_parts"]

PART_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
"""A part's file name as `gguf-split` writes it ("%s-%05d-of-%05d.gguf", numbered from 1)."""

_INTEGERS = {
    GGUFValueType.UINT8,
    GGUFValueType.UINT16,
    GGUFValueType.UINT32,
    GGUFValueType.UINT64,
    GGUFValueType.INT8,
    GGUFValueType.INT16,
    GGUFValueType.INT32,
    GGUFValueType.INT64,
}


def part_path(prefix: Path, no: int, count: int) -> Path:
    """The file of part `no` (0-based) of `count` with `prefix` (a path without the numbering)."""
    return prefix.with_name(f"{prefix.name}-{no + 1:05d}-of-{count:05d}.gguf")


def first_part(files: list[Path]) -> Path | None:
    """The first part when `files` (two or more, any order) are all parts of one split model, even with
    parts missing (`split_parts` then names the first missing one), else None.

    Raises CheckpointError when they are parts of one split model but part 1 is not among them.
    """
    names = [PART_NAME.fullmatch(f.name) for f in files]
    if len(files) < 2 or any(m is None for m in names):
        return None
    keys = {(m.group("prefix"), int(m.group("count"))) for m in names if m is not None}
    if len(keys) != 1:
        return None
    prefix, count = keys.pop()
    first = next(
        (f for f, m in zip(files, names, strict=True) if m is not None and m.group("no") == "00001"), None
    )
    if first is None:
        missing = part_path(files[0].with_name(prefix), 0, count)
        raise CheckpointError(
            f"{missing}: missing part 1 of {count} of a split model (the folder holds the others)"
        )
    return first


def _integer(file: GGUFFile, key: str) -> int | None:
    types = file.types(key)
    if not types:
        return None
    if len(types) != 1 or types[0] not in _INTEGERS:
        raise CheckpointError(f"{file.path}: key {key!r}: must be an integer, got {file.value(key)!r}")
    return int(file.value(key))


def split_parts(first: GGUFFile) -> list[GGUFFile]:
    """Every part of the model whose first (or only) file is `first`, in order: `[first]` for a file
    without `split.count` (or with 1). Raises CheckpointError naming the file for the refusals of the
    module docstring."""
    count = _integer(first, "split.count")
    if count is None or count == 1:
        return [first]
    no = _integer(first, "split.no")
    if count < 1 or no is None or not 0 <= no < count:
        raise CheckpointError(
            f"{first.path}: keys 'split.no' {no!r} / 'split.count' {count!r} are inconsistent"
        )
    match = PART_NAME.fullmatch(first.path.name)
    if match is None:
        raise CheckpointError(
            f"{first.path}: part {no + 1} of a model split in {count}, but not named as gguf-split names "
            "parts (<prefix>-00001-of-00003.gguf), so the other parts cannot be found"
        )
    prefix = first.path.with_name(match.group("prefix"))
    if no != 0:
        raise CheckpointError(
            f"{first.path}: part {no + 1} of a model split in {count}; give the first part, "
            f"{part_path(prefix, 0, count).name}"
        )
    if (int(match.group("no")), int(match.group("count"))) != (1, count):
        raise CheckpointError(
            f"{first.path}: its name says part {int(match.group('no'))} of {int(match.group('count'))}, "
            f"its keys part 1 of {count}"
        )
    parts = [first]
    for i in range(1, count):
        path = part_path(prefix, i, count)
        if not path.is_file():
            raise CheckpointError(
                f"{path}: missing part {i + 1} of {count} of the split model {first.path.name}"
            )
        part = open_gguf(path)
        got = (_integer(part, "split.no"), _integer(part, "split.count"))
        if got != (i, count):
            raise CheckpointError(
                f"{path}: keys 'split.no' / 'split.count' are {got[0]!r} / {got[1]!r}, expected {i} / {count} "
                f"(part {i + 1} of the split model {first.path.name})"
            )
        parts.append(part)
    seen: dict[str, Path] = {}
    for part in parts:
        for tensor in part.tensors:
            if tensor.name in seen:
                raise CheckpointError(
                    f"{part.path}: tensor {tensor.name!r} is also in {seen[tensor.name].name}"
                )
            seen[tensor.name] = part.path
    declared = _integer(first, "split.tensors.count")
    if declared is not None and declared != len(seen):
        raise CheckpointError(
            f"{first.path}: key 'split.tensors.count' says {declared} tensors, the {count} parts hold {len(seen)}"
        )
    return parts
