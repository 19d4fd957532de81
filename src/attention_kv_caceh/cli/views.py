"""`attention-kv-caceh views`: the view/copy table (which operations share an array's memory, which copy it).

Flags (`report.views.ViewsOptions`) -> output checks (nothing written on a usage error) -> `run_views` -> the
files asked for (`record_views`, the section `report` renders) -> the table (`report.views`).
"""

from __future__ import annotations

import argparse

from attention_kv_caceh.cli.common import check_markdown_file, check_outputs
from attention_kv_caceh.cli.flags import add_options, config_from_args
from attention_kv_caceh.experiments.views import record_views, run_views
from attention_kv_caceh.files import atomic_write_text, markdown_path, meta_path
from attention_kv_caceh.report.views import ViewsOptions, views_markdown, views_section

__all__ = ["HELP", "add_arguments", "run"]

HELP = "the view/copy table: which list and NumPy operations share memory with the original, which copy"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `views`: `--csv PATH.csv`, `--md PATH.md`."""
    add_options(parser, ViewsOptions)


def run(args: argparse.Namespace) -> int:
    """Run the six view/copy experiments, print the Markdown table, write the files asked for.

    Raises UsageError for an output path (`--csv`, its `.meta.json`, `--md`) that has the wrong suffix
    or cannot be written, and for a `<stem>.md` beside the CSV that no lab command wrote
    (`common.check_markdown_file`), before any file is written.
    """
    from attention_kv_caceh.timing import capture_environment

    options = config_from_args(ViewsOptions, args)
    csv_path, md_path = options.csv, options.md
    beside = f"--csv {str(csv_path)!r}: the file beside it"
    section = None if csv_path is None else markdown_path(csv_path)
    if section is not None and md_path is not None and section.resolve() == md_path.resolve():
        section = None  # --md names that file: it gets the table, as asked
    meta = None if csv_path is None else meta_path(csv_path)
    check_outputs(
        [
            ("--csv", csv_path, (".csv",)),
            (beside, meta, ()),
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
        record_views(csv_path, rows, capture_environment())
        written += [str(csv_path), str(meta_path(csv_path))]
        if section is not None:
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
