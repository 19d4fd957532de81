"""`attention-kv-caceh views`: the view/copy table (which operations share an array's memory, which copy it).

`experiments/views.py` runs the six experiments and returns rows; this module prints the table and
writes the files asked for, after checking every output path (UsageError naming the flag, nothing
written).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from attention_kv_caceh.cli.common import check_outputs, output_file
from attention_kv_caceh.experiments.views import VIEW_TABLE_COLUMNS, run_views, views_markdown
from attention_kv_caceh.files import (
    atomic_write_text,
    markdown_path,
    meta_path,
    write_csv_atomic,
    write_json_atomic,
)
from attention_kv_caceh.timing import capture_environment

__all__ = ["HELP", "add_arguments", "run"]

HELP = "the view/copy table: which list and NumPy operations share memory with the original, which copy"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `views`: `--csv PATH.csv`, `--md PATH.md` (both optional; the table is printed anyway)."""
    parser.add_argument(
        "--csv",
        type=output_file(".csv"),
        default=None,
        metavar="PATH.csv",
        help="write the table as CSV, plus <csv>.meta.json and the run's Markdown <stem>.md beside it "
        "(default: not written)",
    )
    parser.add_argument(
        "--md",
        type=output_file(".md", ".markdown"),
        default=None,
        metavar="PATH.md",
        help="write the table as Markdown (default: not written)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the six view/copy experiments, print the Markdown table, write the files asked for.

    Raises UsageError for an output path (`--csv`, its `.meta.json`, `--md`) that has the wrong suffix
    or cannot be written, before any file is written.
    """
    csv_path: Path | None = args.csv
    md_path: Path | None = args.md
    beside = f"--csv {str(csv_path)!r}: the file beside it"
    section = None if csv_path is None else markdown_path(csv_path)
    if section is not None and md_path is not None and section.resolve() == md_path.resolve():
        section = None  # --md names that file: it gets the table, as asked
    check_outputs(
        [
            ("--csv", csv_path, (".csv",)),
            (beside, None if csv_path is None else meta_path(csv_path), ()),
            (beside, section, ()),
            ("--md", md_path, (".md", ".markdown")),
        ]
    )
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
        written += [str(csv_path), str(meta_path(csv_path))]
        if section is not None:  # the section `report` renders from the CSV
            from attention_kv_caceh.report.sections import views_section

            written.append(str(atomic_write_text(section, views_section(csv_path.name, rows))))
    if md_path is not None:
        atomic_write_text(md_path, table)
        written.append(str(md_path))
    print(table, end="")
    held = sum(r.prediction_held for r in rows)
    print(f"\n{held} of {len(rows)} predictions held.")
    if written:
        print(f"wrote {', '.join(written)}")
    return 0
