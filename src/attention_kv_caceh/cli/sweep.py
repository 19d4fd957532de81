"""`attention-kv-caceh sweep`: the harness over a grid of loads, the throughput-latency curve and its knee;
with `--slo`, the highest request rate that meets the SLO.

    attention-kv-caceh sweep [harness flags] --concurrency 1 2 4 8 16 32 [--repeats R] --out-dir DIR
    attention-kv-caceh sweep [harness flags] --request-rate 1 2 4 8 --out-dir DIR
    attention-kv-caceh sweep [harness flags] --slo ttft:2000 tpot:200 [--request-rate START | LOW HIGH]
        [--max-runs 8] --out-dir DIR

Flags (every flag of `harness` applies to every point; one of --concurrency and --request-rate takes
several values: `harness.sweep_run.SweepOptions`) -> one HarnessConfig per point, every one checked
before anything starts -> `SweepRun` (one harness run per point, `--repeats` times, same seed, the
prefix cache emptied before each; each run's JSONL, metadata and summary JSON in DIR as the run ends,
DIR/sweep.csv rewritten after every run, so Ctrl-C keeps every finished point) -> the table, the knee
(harness/sweep.py), DIR/sweep.png, DIR/pareto.png and DIR/sweep.json. `--backend engine` starts one
`serve` for the whole sweep. Exit codes: 0 done (failed requests at a point are a warning: overload is
what a sweep looks for); 1 a runtime failure (server unreachable, smoke test failed, an output not
written); 2 bad usage; 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attention_kv_caceh.cli import flags, harness, harness_engine
from attention_kv_caceh.cli.common import PROG, UsageError, check_outputs, stdout_closed
from attention_kv_caceh.files import ignoring_sigint, input_files
from attention_kv_caceh.harness.config import HarnessConfig
from attention_kv_caceh.harness.sweep_run import SweepOptions, SweepRun

__all__ = ["HELP", "add_arguments", "run"]

HELP = "the harness over a grid of concurrencies or request rates: curve, knee, SLO search"

# What a sweep writes in --out-dir for each point (`point_name`, then the suffix) and for the whole sweep.
_POINT_FILE = re.compile(r"(c\d+|rate[0-9a-z.+-]+)-r\d+(\.jsonl|\.jsonl\.meta\.json|\.summary\.json)")
_SWEEP_FILES = ("sweep.csv", "sweep.png", "sweep.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The harness's flags (with grids for --concurrency and --request-rate) and the sweep's own."""
    harness.add_arguments(parser, sweep=True)
    group = parser.add_argument_group("sweep")
    flags.add_options(group, SweepOptions, exclude=("concurrency", "request_rate"))


def _point_files(out: Path, inputs: list[tuple[str, str | None]]) -> list[Path]:
    """The files in `out` a sweep may replace, beyond sweep.csv and sweep.png: sweep.json, every file
    already there with a point file's name (`_POINT_FILE`; the SLO search picks its rates as it goes),
    and any input named like one (a sweep could write over it)."""
    names = [out / "sweep.json"]
    if out.is_dir():
        names += [p for p in sorted(out.iterdir()) if _POINT_FILE.fullmatch(p.name)]
    for _flag, path in inputs:
        for file in input_files(path) if path is not None else []:
            real = Path(os.path.realpath(file))
            if real.parent == Path(os.path.realpath(out)) and (
                _POINT_FILE.fullmatch(real.name) or real.name in _SWEEP_FILES
            ):
                names.append(real)
    unique = {Path(os.path.realpath(n)): n for n in names}  # one entry per file
    return list(unique.values())


def run(args: argparse.Namespace) -> int:
    """Run the sweep from parsed `args`; returns the exit code (module docstring). Raises UsageError for
    bad input, before any file is written or server started."""
    options = flags.config_from_args(SweepOptions, args)
    if options.slo and isinstance(args.goodput, list):  # given (its default is the empty GoodputSLO)
        raise UsageError("--goodput and --slo: the SLO search sets the objectives; give one of them")
    slo = {"goodput": list(options.slo)} if options.slo else {}
    # every point checked before anything starts
    configs = [
        harness.config_from_args(args, concurrency=c, request_rate=r, **slo) for c, r in options.points()
    ]
    harness.warn_server_temperature(configs[0])
    out = options.out_dir
    assert out is not None
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out-dir {out}: exists and is not a folder")
    inputs = harness.input_paths(args)
    check_outputs(
        [("--out-dir", out / name, (name[-4:],)) for name in ("sweep.csv", "sweep.png", "pareto.png")]
        + [("--out-dir", path, ()) for path in _point_files(out, inputs)],
        inputs,
    )
    out.mkdir(parents=True, exist_ok=True)
    return harness_engine.run_maybe_with_engine(
        args, "sweep", configs[0], lambda base, describe: _sweep(args, options, base, describe), harness.error
    )


def _sweep(
    args: argparse.Namespace,
    options: SweepOptions,
    base: HarnessConfig,
    describe: Callable[[], dict[str, Any]] | None,
) -> int:
    from attention_kv_caceh.harness.run_text import format_sweep_table

    sweep = SweepRun(options, base, lambda line: print(line, flush=True))
    print(
        f"sweep: backend={args.backend} axis={options.axis} concurrency={options.concurrency} "
        f"request_rate={options.request_rate} repeats={options.repeats} num_requests={base.num_requests} "
        f"workload={base.workload.kind} seed={base.seed} out_dir={sweep.out}"
        + "".join(f" {k}={v}" for k, v in base.sampling.body_fields().items()),
        flush=True,
    )
    try:
        ending = sweep.run(harness.error)
    except BrokenPipeError:  # stdout's reader left (`| head`): stop quietly, keep what finished
        stdout_closed()
        ending = "failed"
    if ending == "interrupted":
        partial = (
            ""
            if sweep.partial is None
            else f", and the interrupted run's {sweep.partial['records']} finished requests in "
            f"{sweep.partial['jsonl']} (status interrupted)"
        )
        print(
            f"{PROG}: interrupted; {len(sweep.rows)} finished runs kept in {sweep.out}{partial}",
            file=sys.stderr,
        )
    if not sweep.rows:
        return harness.EXIT[ending]
    title = (
        f"sweep over {options.axis} ({args.backend}, {base.num_requests} requests a run, prompt "
        f"{base.prompt_len}, output {base.output_len}, workload {base.workload.kind})"
    )
    with ignoring_sigint():  # the files first: a closed stdout cannot lose them
        verdict, written, failed = sweep.finish(title, describe, ending == "interrupted")
        print(format_sweep_table(sweep.rows, options.axis))
        if sweep.failed_requests:
            print(f"warning: {sweep.failed_requests} requests failed across the sweep (see each run's JSONL)")
        if verdict is not None:
            print(verdict)
        if failed is not None:
            harness.error(f"could not write an output file: {failed}")
            return 1
        print("wrote: " + ", ".join(written) + f" and {len(sweep.rows)} runs' JSONL and summary files")
    return harness.EXIT[ending]
