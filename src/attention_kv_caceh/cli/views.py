"""`attention-kv-caceh views`: the view/copy table (which operations share an array's memory, which copy it).

Flags (`ViewsOptions`) -> the output checks (UsageError naming the flag, nothing written) ->
`experiments.views.run_views` (six experiments, rows) -> the files asked for (the CSV through a
`RunRecorder`, with its metadata and the section `report` renders beside it) -> the table printed
(`report.sections.views_markdown`).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from attention_kv_caceh.cli.common import check_markdown_file, check_outputs, output_file
from attention_kv_caceh.cli.flags import add_options, config_from_args
from attention_kv_caceh.experiments.views import VIEW_TABLE_COLUMNS, ViewRow, run_views
from attention_kv_caceh.files import atomic_write_text, markdown_path, meta_path
from attention_kv_caceh.options import check_options, option

__all__ = ["HELP", "ViewsOptions", "add_arguments", "run"]

HELP = "the view/copy table: which list and NumPy operations share memory with the original, which copy"


@dataclass(frozen=True)
class ViewsOptions:
    """Where `views` writes the table (both optional: it is printed anyway)."""

    csv: Path | None = option(  # noqa: RUF009  (option() returns a dataclasses.field)
        None,
        help="write the table as CSV, plus <csv>.meta.json and the run's Markdown <stem>.md beside it",
        metavar="PATH.csv",
        parse=output_file(".csv"),
        default_text="not written",
    )
    md: Path | None = option(  # noqa: RUF009
        None,
        help="write the table as Markdown",
        metavar="PATH.md",
        parse=output_file(".md", ".markdown"),
        default_text="not written",
    )

    def __post_init__(self) -> None:
        check_options(self)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `views`: `--csv PATH.csv`, `--md PATH.md`."""
    add_options(parser, ViewsOptions)


def run(args: argparse.Namespace) -> int:
    """Run the six view/copy experiments, print the Markdown table, write the files asked for.

    Raises UsageError for an output path (`--csv`, its `.meta.json`, `--md`) that has the wrong suffix
    or cannot be written, and for a `<stem>.md` beside the CSV that no lab command wrote
    (`common.check_markdown_file`), before any file is written.
    """
    from attention_kv_caceh.report.sections import views_markdown

    options = config_from_args(ViewsOptions, args)
    csv_path, md_path = options.csv, options.md
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
    if section is not None and csv_path is not None:
        check_markdown_file("--csv", csv_path)
    rows = run_views()
    table = views_markdown(rows)
    written: list[str] = []
    if csv_path is not None:
        written += _write_csv(csv_path, rows, section)
    if md_path is not None:
        atomic_write_text(md_path, table)
        written.append(str(md_path))
    print(table, end="")
    held = sum(r.prediction_held for r in rows)
    print(f"\n{held} of {len(rows)} predictions held.")
    if written:
        print(f"wrote {', '.join(written)}")
    return 0


def _write_csv(csv_path: Path, rows: list[ViewRow], section: Path | None) -> list[str]:
    """The CSV and its metadata (one recorded run), and the section `report` renders from the CSV."""
    from attention_kv_caceh.recorder import RunRecorder
    from attention_kv_caceh.report.sections import views_section
    from attention_kv_caceh.timing import capture_environment

    env = capture_environment()
    with RunRecorder(
        "view-copy-table", csv_path, VIEW_TABLE_COLUMNS, config={"experiment": "views"}, environment=env
    ) as run:
        run.add(dataclasses.asdict(r) for r in rows)
    written = [str(csv_path), str(meta_path(csv_path))]
    if section is not None:
        written.append(str(atomic_write_text(section, views_section(csv_path.name, rows))))
    return written
