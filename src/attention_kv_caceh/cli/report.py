"""`attention-kv-caceh report`: recompute every statistic of a results folder into Markdown.

`attention_kv_caceh.report` finds, reads and checks the raw files and returns the Markdown (imported
only when the subcommand runs); this module checks the output paths first, writes the report and prints
what it wrote and the problems it found.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from attention_kv_caceh.cli.common import UsageError, check_outputs
from attention_kv_caceh.cli.flags import add_options, config_from_args
from attention_kv_caceh.files import atomic_write_text, input_files, output_path
from attention_kv_caceh.options import option

__all__ = ["HELP", "ReportOptions", "add_arguments", "run"]

HELP = "recompute every statistic from the raw files of a folder and write a Markdown report"


@dataclass(frozen=True)
class ReportOptions:
    """The folder `report` reads (`--results`) and the report it writes (`--out`; plots beside it)."""

    results: str = option("results", help="raw CSV / JSONL files and their .meta.json", metavar="FOLDER")
    out: Path = option(
        Path("results/REPORT.md"),
        help="the Markdown report; PNG plots go beside it",
        metavar="PATH.md",
        parse=output_path(".md"),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `report`: the fields of ReportOptions."""
    add_options(parser, ReportOptions)


def run(args: argparse.Namespace) -> int:
    """Write the report of a results folder; file problems are listed in it and on stderr (exit 0).
    Raises UsageError when --results is not a folder, or --out or a plot beside it (`<out stem>-<csv
    stem>.png`) cannot be written (nothing written then)."""
    from attention_kv_caceh.report import build_report, planned_plots

    options = config_from_args(ReportOptions, args)
    out_path, results = str(options.out), options.results
    if str(results) == "":
        raise UsageError("--results: empty path; give the folder of raw files (default: results)")
    if not Path(results).is_dir():
        raise UsageError(f"--results {str(results)!r} is not a folder")
    beside = f"--out {out_path!r}: the plot beside it"
    raw = input_files(results, (".csv", ".jsonl", ".json"))  # what build_report reads there
    check_outputs(
        [("--out", out_path, (".md",))] + [(beside, p, ()) for p in planned_plots(results, out_path)],
        [("--results", f) for f in raw],
    )
    result = build_report(results, out_path)
    atomic_write_text(out_path, result.markdown)
    print(f"wrote {out_path} from {len(result.sources)} raw file(s): {', '.join(result.sources) or 'none'}")
    for plot in result.plots:
        print(f"wrote {plot}")
    for problem in result.problems:
        print(f"problem: {problem.path}: {problem.problem}", file=sys.stderr)
    return 0
