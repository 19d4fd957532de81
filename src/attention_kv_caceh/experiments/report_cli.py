"""Command-line front end of `report`: recompute every statistic of a results folder into Markdown.

`add_report_arguments(parser)` / `run_report(args) -> int` are mounted by `cli.SUBCOMMANDS`.
`report.py` finds, reads and checks the raw files and returns the Markdown (it is imported only when
the subcommand runs); this module checks the output paths first, writes the report and prints what it
wrote and the problems it found.
"""

from __future__ import annotations

import argparse
import sys

from attention_kv_caceh.experiments.cache_cli import check_optional_output
from attention_kv_caceh.files import atomic_write_text, check_output_path

__all__ = ["add_report_arguments", "run_report"]


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `report`: `--results FOLDER` (raw files to read), `--out PATH.md` (plots go beside it)."""
    parser.add_argument(
        "--results",
        default="results",
        metavar="FOLDER",
        help="raw CSV / JSONL files and their .meta.json (default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        default="results/REPORT.md",
        metavar="PATH.md",
        help="the Markdown report; PNG plots go beside it (default: %(default)s)",
    )


def run_report(args: argparse.Namespace) -> int:
    """Write the report of a results folder; file problems are listed in it and on stderr (exit 0).

    Raises ValueError when --results is not a folder, or --out or a plot beside it (`<out stem>-<csv
    stem>.png`) cannot be written (nothing written then).
    """
    from attention_kv_caceh.experiments.report import build_report, planned_plots

    out_path = str(args.out)
    check_optional_output("--out", out_path, (".md",))
    for target in planned_plots(args.results, out_path):
        check_output_path(target, f"--out {out_path!r}: the plot beside it")
    result = build_report(args.results, out_path)
    atomic_write_text(out_path, result.markdown)
    print(f"wrote {out_path} from {len(result.sources)} raw file(s): {', '.join(result.sources) or 'none'}")
    for plot in result.plots:
        print(f"wrote {plot}")
    for problem in result.problems:
        print(f"problem: {problem.path}: {problem.problem}", file=sys.stderr)
    return 0
