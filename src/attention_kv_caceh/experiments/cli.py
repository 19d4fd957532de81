"""Command-line front ends of the experiments: `cache`, `views` and `report`.

Each subcommand is a pair `add_*_arguments(parser)` / `run_*(args) -> int`, collected in `SUBCOMMANDS`
so the main command (`attention-kv-caceh`) can mount them next to its default batch-size scan. This is
the only module here that prints. Bad input raises ValueError naming the value, before any file is
created or truncated; `main` (for running this module on its own) turns it into one line and exit 2.

    uv run python -m attention_kv_caceh.experiments.cli views --csv results/views.csv
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attention_kv_caceh.experiments.views import VIEW_TABLE_COLUMNS, run_views, views_markdown
from attention_kv_caceh.files import atomic_write_text, write_csv_atomic, write_json_atomic
from attention_kv_caceh.timing import capture_environment

__all__ = [
    "SUBCOMMANDS",
    "add_views_arguments",
    "build_parser",
    "main",
    "meta_path",
    "run_views_command",
]


def meta_path(csv_path: str | Path) -> Path:
    """The metadata file beside a raw CSV: `<csv>.meta.json`."""
    return Path(f"{csv_path}.meta.json")


def _check_output_path(flag: str, path: str | None, suffixes: tuple[str, ...]) -> None:
    """Raise ValueError for an output path with the wrong suffix or one that names a folder."""
    if path is None:
        return
    p = Path(path)
    if p.suffix.lower() not in suffixes:
        raise ValueError(f"{flag} {path!r} must end in {' or '.join(suffixes)}")
    if p.is_dir():
        raise ValueError(f"{flag} {path!r} is a folder, expected a file path")


# ---------------------------------------------------------------------------------------------- views


def add_views_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `views`: `--csv PATH.csv`, `--md PATH.md` (both optional; the table is printed anyway)."""
    parser.add_argument("--csv", default=None, help="write the table as CSV (plus <csv>.meta.json)")
    parser.add_argument("--md", default=None, help="write the table as Markdown")


def run_views_command(args: argparse.Namespace) -> int:
    """Run the six view/copy experiments, print the Markdown table, write the files asked for.

    Raises ValueError for an output path with the wrong suffix.
    """
    csv_path: str | None = args.csv
    md_path: str | None = args.md
    _check_output_path("--csv", csv_path, (".csv",))
    _check_output_path("--md", md_path, (".md", ".markdown"))
    rows = run_views()
    table = views_markdown(rows)
    if csv_path is not None:
        write_csv_atomic(csv_path, (dataclasses.asdict(r) for r in rows), VIEW_TABLE_COLUMNS)
        write_json_atomic(
            meta_path(csv_path),
            {"environment": capture_environment(), "config": {"experiment": "views"}},
        )
    if md_path is not None:
        atomic_write_text(md_path, table)
    print(table, end="")
    held = sum(r.prediction_held for r in rows)
    print(f"\n{held} of {len(rows)} predictions held.")
    return 0


# ----------------------------------------------------------------------------------------------- main

Runner = Callable[[argparse.Namespace], int]

SUBCOMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Runner, str]] = {
    "views": (
        add_views_arguments,
        run_views_command,
        "the view/copy table of the notes (exercise 9.1)",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser with one subparser per entry of SUBCOMMANDS."""
    parser = argparse.ArgumentParser(
        prog="python -m attention_kv_caceh.experiments.cli",
        description="Experiments of the attention-kv-caceh lab.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_arguments, runner, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        add_arguments(p)
        p.set_defaults(_run=runner)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the subcommand; a ValueError becomes one line on stderr and exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    runner: Any = args._run
    try:
        return int(runner(args))
    except ValueError as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
