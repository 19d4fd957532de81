"""`--dataset`: real prompts from a JSONL file, read and checked before anything is sent.

One `{"prompt": str, "output_len": int}` object per line (`output_len` optional). Kept apart from
`prompts.py` (which talks to tokenizers and servers) so that `HarnessConfig` can check a dataset up
front, when the flags are validated, without importing the HTTP client.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

__all__ = ["dataset_objects", "read_dataset"]


def dataset_objects(path: str | Path) -> Iterator[tuple[str, object]]:
    """(where, parsed JSON value) of each non-blank line of the JSONL file `path`; `where` names the
    flag, the file and the line for error messages. Raises ValueError for an unreadable file or a line
    that is not JSON."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--dataset {str(path)!r}: cannot read it: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--dataset {str(path)!r} line {number}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None


def read_dataset(path: str | Path) -> list[tuple[str, int | None]]:
    """(prompt, output_len or None) of each line of a JSONL file of `{"prompt": str, "output_len": int}`.

    Raises ValueError naming the file and line for a missing file, bad JSON, an empty or non-string
    prompt, or an output_len that is not an integer >= 1; and for a file without entries.
    """
    entries: list[tuple[str, int | None]] = []
    for where, obj in dataset_objects(path):
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object")
        row = cast("dict[str, Any]", obj)
        prompt, output_len = row.get("prompt"), row.get("output_len")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f'{where}: "prompt" must be a non-empty string')
        if output_len is not None and (
            isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1
        ):
            raise ValueError(f'{where}: "output_len" must be an integer >= 1, got {output_len!r}')
        entries.append((prompt, output_len))
    if not entries:
        raise ValueError(f"--dataset {str(path)!r}: no entries")
    return entries
