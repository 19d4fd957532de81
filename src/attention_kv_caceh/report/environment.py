"""The report's environment card: where and with what each run in the folder was measured.

One column per metadata file (`<csv>.meta.json`, the `timing.capture_environment` record the commands
write), so results from different machines, libraries or commits are not compared unawares; raw files
without metadata are named, their environment being unknown.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping, Sequence
from typing import Any

from attention_kv_caceh.tables import markdown_table

__all__ = ["environment_card"]


def environment_card(metas: Mapping[str, Mapping[str, Any]], missing: Sequence[str] = ()) -> str:
    """A table of each metadata file's environment (file name -> its parsed `.meta.json`), one
    column per file, then a line naming the raw files used without metadata (`missing`); a line
    saying the environment is unknown when there are none."""
    note = (
        "No metadata for " + ", ".join(f"`{name}`" for name in missing) + ": their environment is unknown.\n"
        if missing
        else ""
    )
    if not metas:
        return "No metadata found: the environment of these results is unknown.\n" + (
            "\n" + note if note else ""
        )
    keys = [
        ("start_time_utc", "start (UTC)"),
        ("cpu_model", "CPU"),
        ("cpu_count", "CPU count"),
        ("platform", "platform"),
        ("python", "Python"),
        ("numpy", "NumPy"),
        ("blas", "BLAS"),
        ("blas_threads", "BLAS threads"),
        ("thread_env", "thread variables"),
        ("others_busy_cpus", "other processes' busy CPUs at start"),
        ("git_commit", "git commit"),
    ]
    names = list(metas)
    rows: list[list[object]] = []
    for key, label in keys:
        cells: list[object] = [label]
        for name in names:
            env: Any = metas[name].get("environment", {})
            value: Any = typing.cast("dict[str, Any]", env).get(key, "?") if isinstance(env, dict) else "?"
            if key == "blas" and isinstance(value, list):
                value = ", ".join(
                    f"{p.get('internal_api')} {p.get('version')}"
                    for p in typing.cast("list[dict[str, Any]]", value)
                )
            elif key == "thread_env" and isinstance(value, dict):
                value = (
                    " ".join(f"{k}={v}" for k, v in typing.cast("dict[str, Any]", value).items()) or "none"
                )
            elif key == "others_busy_cpus":
                value = "not measured" if value is None else value
            elif key == "git_commit" and isinstance(value, str):
                value = value[:12]
            cells.append(str(value).replace("|", "/"))
        rows.append(cells)
    status = [str(metas[name].get("status", "?")).replace("|", "/") for name in names]
    if any(v != "?" for v in status):
        rows.insert(0, ["run status", *status])
    return markdown_table(["", *names], rows) + ("\n" + note if note else "")
