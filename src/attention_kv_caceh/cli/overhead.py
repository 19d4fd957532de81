"""`attention-kv-caceh overhead`: the harness's own ITL and TTFT error against the scripted server.

Flags (`harness.overhead_run.OverheadConfig`, `--json`) -> config -> `measure_overheads` (the scripted
server in a child process on 127.0.0.1, one token every `--itl-ms` on absolute deadlines; one run per
`--concurrency`) -> print P50/P99 (mean, max) of measured minus scripted ITL and TTFT in ms
(`report.overhead`). Bad flags exit 2 before the server starts; a failed request exits 1.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from attention_kv_caceh.cli.common import CommandFailed, check_outputs
from attention_kv_caceh.cli.flags import add_options, config_from_args
from attention_kv_caceh.files import output_path
from attention_kv_caceh.harness.overhead_run import OverheadConfig, measure_overheads
from attention_kv_caceh.options import option

__all__ = ["HELP", "add_arguments", "run"]

HELP = "the harness's own overhead: ITL and TTFT error against a scripted local server"


@dataclass(frozen=True)
class _Output:
    json: Path | None = option(
        None,
        help="also save the results as JSON here",
        metavar="PATH",
        parse=output_path(".json"),
        default_text="not written",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `overhead`: the fields of OverheadConfig, then --json."""
    add_options(parser, OverheadConfig)
    add_options(parser, _Output)


def run(args: argparse.Namespace) -> int:
    """Measure and print the overhead table; raises UsageError for a bad flag or an unwritable --json
    (before the server starts), CommandFailed when a request failed or --json could not be written."""
    config = config_from_args(OverheadConfig, args, concurrency=tuple(args.concurrency))
    json_path = config_from_args(_Output, args).json
    check_outputs([("--json", json_path, (".json",))])

    from attention_kv_caceh.files import write_json_atomic
    from attention_kv_caceh.report.overhead import format_overhead, overhead_heading
    from attention_kv_caceh.timing import capture_environment

    try:
        rows = list(measure_overheads(config))
    except RuntimeError as exc:
        raise CommandFailed(str(exc)) from None
    print(overhead_heading(config.itl_ms, config.ttft_ms, config.tokens))
    print(format_overhead(rows))
    if json_path:
        try:
            write_json_atomic(json_path, {"environment": capture_environment(), "rows": rows})
        except OSError as exc:
            raise CommandFailed(f"could not write --json {json_path}: {exc}") from None
    return 0
