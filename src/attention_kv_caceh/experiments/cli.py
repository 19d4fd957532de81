"""Command-line front ends of the experiments: `cache`, `views` and `report`.

Each subcommand is a pair `add_*_arguments(parser)` / `run_*(args) -> int`, collected in `SUBCOMMANDS`
so the main command (`attention-kv-caceh`) can mount them next to its default batch-size scan. The pairs
live in `cache_cli.py`, `views_cli.py` and `report_cli.py` (one module per subcommand) and are
re-exported here, so this stays the one import for callers; those modules are the only ones here that
print. Bad input raises ValueError naming the value, before any file is created or truncated; `main`
(for running this module on its own) turns it into one line and exit 2.

    uv run python -m attention_kv_caceh.experiments.cli views --csv results/views.csv
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from attention_kv_caceh.experiments.cache_cli import CACHE_DEFAULTS as CACHE_DEFAULTS
from attention_kv_caceh.experiments.cache_cli import MEMORY_SHARE as MEMORY_SHARE
from attention_kv_caceh.experiments.cache_cli import PROG as PROG
from attention_kv_caceh.experiments.cache_cli import (
    add_cache_arguments,
    cache_config_from_args,
    cache_side_paths,
    check_cache_memory,
    format_cache_summary,
    run_cache,
)
from attention_kv_caceh.experiments.report_cli import add_report_arguments, run_report
from attention_kv_caceh.experiments.views_cli import add_views_arguments, run_views_command

__all__ = [
    "SUBCOMMANDS",
    "add_cache_arguments",
    "add_report_arguments",
    "add_views_arguments",
    "build_parser",
    "cache_config_from_args",
    "cache_side_paths",
    "check_cache_memory",
    "format_cache_summary",
    "main",
    "run_cache",
    "run_report",
    "run_views_command",
]


Runner = Callable[[argparse.Namespace], int]

SUBCOMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Runner, str]] = {
    "cache": (
        add_cache_arguments,
        run_cache,
        "decode N steps over a Dynamic and a Preallocated KV cache: per-step time and memory",
    ),
    "report": (
        add_report_arguments,
        run_report,
        "recompute every statistic from the raw files of a folder and write a Markdown report",
    ),
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
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_arguments, runner, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,  # as the main command's
        )
        add_arguments(p)
        p.set_defaults(_run=runner)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the subcommand; a ValueError becomes one line on stderr and exit code 2,
    an OSError (a file that cannot be written) one line and exit code 1, as in the main command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    runner: Any = args._run
    try:
        return int(runner(args))
    except ValueError as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
