"""Command-line front end of the `views` experiment: the view/copy table of the notes (exercise 9.1).

`add_views_arguments(parser)` / `run_views_command(args) -> int` are mounted by `cli.SUBCOMMANDS`.
`views.py` runs the six experiments and returns rows; this module prints the table and writes the
files asked for, after checking every output path (ValueError naming the flag, nothing written).
"""

from __future__ import annotations

import argparse
import dataclasses

from attention_kv_caceh.experiments.cache_cli import check_optional_output, optional_arg
from attention_kv_caceh.experiments.views import VIEW_TABLE_COLUMNS, run_views, views_markdown
from attention_kv_caceh.files import (
    atomic_write_text,
    check_output_path,
    meta_path,
    write_csv_atomic,
    write_json_atomic,
)
from attention_kv_caceh.timing import capture_environment

__all__ = ["add_views_arguments", "run_views_command"]


def add_views_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `views`: `--csv PATH.csv`, `--md PATH.md` (both optional; the table is printed anyway)."""
    parser.add_argument(
        "--csv",
        default=argparse.SUPPRESS,
        metavar="PATH.csv",
        help="write the table as CSV, plus <csv>.meta.json (default: not written)",
    )
    parser.add_argument(
        "--md",
        default=argparse.SUPPRESS,
        metavar="PATH.md",
        help="write the table as Markdown (default: not written)",
    )


def run_views_command(args: argparse.Namespace) -> int:
    """Run the six view/copy experiments, print the Markdown table, write the files asked for.

    Raises ValueError for an output path (`--csv`, its `.meta.json`, `--md`) that has the wrong suffix
    or cannot be written, before any file is written.
    """
    csv_path: str | None = optional_arg(args, "csv")
    md_path: str | None = optional_arg(args, "md")
    check_optional_output("--csv", csv_path, (".csv",))
    if csv_path is not None:
        check_output_path(meta_path(csv_path), f"--csv {csv_path!r}: the file beside it")
    check_optional_output("--md", md_path, (".md", ".markdown"))
    rows = run_views()
    table = views_markdown(rows)
    written: list[str] = []
    if csv_path is not None:
        write_csv_atomic(csv_path, (dataclasses.asdict(r) for r in rows), VIEW_TABLE_COLUMNS)
        write_json_atomic(
            meta_path(csv_path),
            {
                "status": "complete",
                "environment": capture_environment(),
                "config": {"experiment": "views"},
            },
        )
        written += [csv_path, str(meta_path(csv_path))]
    if md_path is not None:
        atomic_write_text(md_path, table)
        written.append(md_path)
    print(table, end="")
    held = sum(r.prediction_held for r in rows)
    print(f"\n{held} of {len(rows)} predictions held.")
    if written:
        print(f"wrote {', '.join(written)}")
    return 0
