"""`attention-kv-caceh sweep`: the harness over a grid of loads, the throughput-latency curve and its knee;
with `--slo`, the highest request rate that meets the SLO.

    attention-kv-caceh sweep [harness flags] --concurrency 1 2 4 8 16 32 [--repeats R] --out-dir DIR
    attention-kv-caceh sweep [harness flags] --request-rate 1 2 4 8 --out-dir DIR
    attention-kv-caceh sweep [harness flags] --slo ttft:2000 tpot:200 [--request-rate START | LOW HIGH]
        [--max-runs 8] --out-dir DIR

Every flag of `harness` applies to every point; one of --concurrency and --request-rate takes several
values. Each point is one harness run with the same seed (so the same prompts, lengths and arrival
draws), `--repeats` times. Before each run the server's prefix cache is emptied with `POST
/reset_prefix_cache` where the server offers it (a 404 is recorded in the CSV as "not offered", not an
error). Each run's per-request JSONL (written as requests finish) and its summary JSON are in DIR as soon
as the run ends, and DIR/sweep.csv (a row per point and repeat) is rewritten after every run, so Ctrl-C
keeps every finished point. At the end: the table, the knee (harness/sweep.py), DIR/sweep.png (the curve),
DIR/pareto.png (tokens/s per user against total tokens/s, the frontier marked)
and DIR/sweep.json. `--backend engine` starts one `serve` for the whole sweep. Exit codes: 0 done (failed
requests at a point are a warning: overload is what a sweep looks for); 1 a runtime failure (server
unreachable, smoke test failed, an output not written); 2 bad usage; 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from attention_kv_caceh.cli import harness, harness_engine
from attention_kv_caceh.cli.common import PROG, UsageError, check_outputs, output_folder, stdout_closed
from attention_kv_caceh.cli.harness_engine import ENGINE_BACKEND
from attention_kv_caceh.cli.harness_output import JsonlSink, error, summary_document
from attention_kv_caceh.files import (
    ignoring_sigint,
    input_files,
    meta_path,
    write_csv_atomic,
    write_json_atomic,
)
from attention_kv_caceh.harness.load import SmokeTestError
from attention_kv_caceh.harness.metrics import parse_goodput
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.repeats import MAX_REPEATS
from attention_kv_caceh.harness.run import HarnessConfig, ModelDiscoveryError, RunResult, run_harness
from attention_kv_caceh.harness.server_counters import reset_prefix_cache
from attention_kv_caceh.harness.summary import summarize_run
from attention_kv_caceh.harness.sweep import (
    CSV_FIELDS,
    SLO_PASS_FRACTION,
    Axis,
    find_knee,
    pareto_points,
    search_slo_rate,
    sweep_row,
)
from attention_kv_caceh.timing import capture_environment

__all__ = ["HELP", "add_arguments", "run"]

HELP = "the harness over a grid of concurrencies or request rates: curve, knee, SLO search"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The harness's flags (with grids for --concurrency and --request-rate) and the sweep's own."""
    harness.add_arguments(parser, sweep=True)
    g = parser.add_argument_group("sweep")
    g.add_argument(
        "--out-dir",
        type=output_folder,
        required=True,
        metavar="DIR",
        help="folder for every run's JSONL and summary, sweep.csv, sweep.png, pareto.png, sweep.json (created; files "
        "of the same names are replaced) (default: none, required)",
    )
    g.add_argument(
        "--repeats", type=int, default=1, help=f"runs per point, at most {MAX_REPEATS} (default: %(default)s)"
    )
    g.add_argument(
        "--slo",
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="search the highest request rate at which >= 99 %% of requests meet these objectives "
        "(--goodput's meaning, e.g. ttft:2000 tpot:200); --request-rate is then the start (one value, "
        "default 1) or LOW HIGH with LOW < HIGH, finite and > 0 (default: no search)",
    )
    g.add_argument(
        "--max-runs", type=int, default=8, help="runs the SLO search may use in all (default: %(default)s)"
    )


def _axis(args: argparse.Namespace) -> Axis:
    concurrency: list[int] = args.concurrency
    rates: list[float] = args.request_rate
    grids: tuple[tuple[str, list[float]], ...] = (
        ("--concurrency", [float(c) for c in concurrency]),
        ("--request-rate", rates),
    )
    for flag, values in grids:
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise UsageError(
                f"{flag} {' '.join(f'{v:g}' for v in values)}: {repeated[0]:g} is given twice; each point "
                "runs once (use --repeats for more runs of a point)"
            )
    if args.slo:
        if len(concurrency) != 1:
            raise UsageError(f"--concurrency {concurrency}: the SLO search varies the rate; give one value")
        if len(rates) > 2:
            raise UsageError(f"--request-rate {rates}: with --slo give START or LOW HIGH")
        return "request_rate"
    if len(concurrency) > 1 and len(rates) > 1:
        raise UsageError("--concurrency and --request-rate both have several values: a sweep varies one")
    return "request_rate" if len(rates) > 1 else "concurrency"


def _config_at(args: argparse.Namespace, concurrency: int, rate: float) -> HarnessConfig:
    one = copy.copy(args)
    one.concurrency, one.request_rate = concurrency, rate
    return harness.config_from_args(one)


# What a sweep writes in --out-dir for each point (`_name`, then the suffix) and for the whole sweep.
_POINT_FILE = re.compile(r"(c\d+|rate[0-9a-z.+-]+)-r\d+(\.jsonl|\.jsonl\.meta\.json|\.summary\.json)")
_SWEEP_FILES = ("sweep.csv", "sweep.png", "sweep.json")


def _point_files(out: Path, inputs: list[tuple[str, str | None]]) -> list[Path]:
    """The files in `out` a sweep may replace, beyond sweep.csv and sweep.png: sweep.json, every file
    already there with a point file's name (`_POINT_FILE`; the SLO search picks its rates as it goes),
    and any input named like one (a sweep could write over it)."""
    names = [out / "sweep.json"]
    if out.is_dir():
        names += [p for p in sorted(out.iterdir()) if _POINT_FILE.fullmatch(p.name)]
    for _flag, path in inputs:
        if path is None:
            continue
        for file in input_files(path):
            real = Path(os.path.realpath(file))
            if real.parent == Path(os.path.realpath(out)) and (
                _POINT_FILE.fullmatch(real.name) or real.name in _SWEEP_FILES
            ):
                names.append(real)
    unique = {Path(os.path.realpath(n)): n for n in names}  # one entry per file
    return list(unique.values())


def _name(axis: Axis, value: float, repeat: int) -> str:
    if axis == "concurrency":
        return f"c{int(value)}-r{repeat}"
    return f"rate{value:g}-r{repeat}" if math.isfinite(value) else f"rateinf-r{repeat}"


class _Sweep:
    """The state of one sweep: where files go, the rows so far, what was written."""

    def __init__(self, args: argparse.Namespace, axis: Axis, base: HarnessConfig) -> None:
        self.args = args
        self.axis: Axis = axis
        self.base = base
        self.out: Path = args.out_dir
        self.rows: list[dict[str, Any]] = []
        self.environment = capture_environment()
        self.runs = 0
        self.failed_requests = 0
        self.partial: dict[str, Any] | None = None  # the interrupted run's files: {"jsonl", "records"}

    def run_point(self, concurrency: int, rate: float, repeat: int, name: str) -> dict[str, Any]:
        """One harness run; its files written; its row added and returned. Ctrl-C: the run's finished
        records and a summary of them are kept, then KeyboardInterrupt is re-raised. Raises RuntimeError
        when the JSONL cannot be written, and what `run_harness` raises."""
        config = replace(
            self.base,
            concurrency=concurrency,
            request_rate=rate,
            smoke_test=self.base.smoke_test and self.runs == 0,  # once per sweep: the server is the same
            label=f"{self.base.label or 'sweep'} {name}",
        )
        reset = "-"
        if config.backend != "simulated":
            headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
            ok, why = reset_prefix_cache(config.base_url, headers)
            reset = "yes" if ok else why
        jsonl = self.out / f"{name}.jsonl"
        sink = JsonlSink(jsonl)
        finished: list[RequestRecord] = []

        def on_record(record: RequestRecord) -> None:
            if not record.probe:  # probes are written, never summarized with the load
                finished.append(record)
            sink.write(record)

        self.runs += 1
        try:
            result = asyncio.run(run_harness(config, on_record=on_record))
        except KeyboardInterrupt:
            with ignoring_sigint():
                sink.close()
                self._save_partial(config, jsonl, sink, finished)
            raise
        finally:
            sink.close()
        if sink.error is not None:
            raise RuntimeError(f"could not write {jsonl}: {sink.error}")
        self._save(result, config, jsonl, sink)
        row = sweep_row(
            self.axis,
            concurrency,
            rate,
            repeat,
            result.summary,
            reset=reset,
            jsonl=jsonl.name if sink.opened else "",
        )
        self.rows.append(row)
        self.failed_requests += result.summary["failed"]
        write_csv_atomic(self.out / "sweep.csv", self.rows, CSV_FIELDS)
        print(_point_line(name, row), flush=True)
        for warning in result.summary["warnings"]:
            print(f"  warning: {warning}", flush=True)
        return row

    def _save(self, result: RunResult, config: HarnessConfig, jsonl: Path, sink: JsonlSink) -> None:
        if sink.opened:
            meta = {
                "kind": "serving-harness",
                "status": "complete",
                "records": sink.count,
                "config": result.config.describe(),
                "environment": self.environment,
            }
            write_json_atomic(meta_path(jsonl), meta)
        doc = summary_document(result, result.summary, result.config, self.environment)
        write_json_atomic(jsonl.with_suffix(".summary.json"), doc)

    def _save_partial(
        self, config: HarnessConfig, jsonl: Path, sink: JsonlSink, finished: list[RequestRecord]
    ) -> None:
        if not sink.opened or not finished:
            return
        self.partial = {"jsonl": jsonl.name, "records": sink.count}
        meta = {
            "kind": "serving-harness",
            "status": "interrupted",
            "records": sink.count,
            "config": config.describe(),
            "environment": self.environment,
        }
        write_json_atomic(meta_path(jsonl), meta)
        start = min(r.arrival_ns for r in finished)
        end = max(r.stream_end_ns or r.arrival_ns for r in finished)
        summary = summarize_run(finished, max(end - start, 1) / 1e9, slo=config.goodput)
        summary["interrupted"] = True
        write_json_atomic(
            jsonl.with_suffix(".summary.json"), summary_document(None, summary, config, self.environment)
        )


def _ms(value: Any) -> str:
    return "-" if value is None else f"{float(value):.1f}"


def _point_line(name: str, row: Mapping[str, Any]) -> str:
    rate = row["prefix_cache_hit_rate"]
    good = row["good_fraction"]
    return (
        f"sweep: {name}: {row['completed']} ok {row['failed']} failed   output tokens/s "
        f"{row['output_throughput']:.1f}   TTFT p50/p99 {_ms(row['median_ttft_ms'])}/{_ms(row['p99_ttft_ms'])} ms"
        f"   TPOT p50/p99 {_ms(row['median_tpot_ms'])}/{_ms(row['p99_tpot_ms'])} ms"
        + (f"   good {100 * good:.1f} %" if good is not None else "")
        + (f"   prefix-cache hit rate {100 * rate:.1f} %" if rate is not None else "")
        + f"   cache reset: {row['prefix_cache_reset']}"
    )


def format_table(rows: list[dict[str, Any]], axis: Axis) -> str:
    """The sweep's table: one line per run."""
    head = "concurrency" if axis == "concurrency" else "rate (req/s)"
    header = (
        f"{head:>12}{'repeat':>7}{'ok':>6}{'req/s':>8}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'TPOT p99':>10}{'hit rate':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        rate = r["prefix_cache_hit_rate"]
        lines.append(
            f"{r['value']:>12g}{r['repeat']:>7}{r['completed']:>6}{r['request_throughput']:>8.2f}"
            f"{r['output_throughput']:>10.1f}{_ms(r['median_ttft_ms']):>10}{_ms(r['p99_ttft_ms']):>10}"
            f"{_ms(r['median_tpot_ms']):>10}{_ms(r['p99_tpot_ms']):>10}"
            f"{'-' if rate is None else f'{100 * rate:.1f}%':>9}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the sweep from parsed `args`; returns the exit code (module docstring). Raises UsageError for
    bad input, before any file is written or server started."""
    axis = _axis(args)
    if not 1 <= args.repeats <= MAX_REPEATS:  # the rule of harness --repeats
        raise UsageError(f"--repeats must be in [1, {MAX_REPEATS}], got {args.repeats}")
    if args.slo:
        if args.repeats != 1:
            raise UsageError(f"--repeats {args.repeats}: the SLO search runs each rate once")
        if args.goodput:
            raise UsageError("--goodput and --slo: the SLO search sets the objectives; give one of them")
        try:
            parse_goodput(args.slo)
        except ValueError as exc:
            raise UsageError(str(exc).replace("--goodput", "--slo")) from None
        args.goodput = list(args.slo)
        if args.max_runs < 1:
            raise UsageError(f"--max-runs must be >= 1, got {args.max_runs}")
        rates: list[float] = args.request_rate
        if any(not (math.isfinite(r) and r > 0) for r in rates) and rates != [math.inf]:
            raise UsageError(f"--request-rate {rates}: the SLO search needs finite rates > 0")
        if len(rates) == 2 and not rates[0] < rates[1]:
            raise UsageError(f"--request-rate {rates[0]:g} {rates[1]:g}: with --slo expected LOW < HIGH")
    points = [(c, r) for c in args.concurrency for r in args.request_rate]
    if args.slo:
        points = [(args.concurrency[0], r if math.isfinite(r) else 1.0) for r in args.request_rate]
    configs = [_config_at(args, c, r) for c, r in points]  # every point checked before anything starts
    harness.warn_server_temperature(configs[0])
    out: Path = args.out_dir
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out-dir {out}: exists and is not a folder")
    check_outputs(
        [
            ("--out-dir", out / "sweep.csv", (".csv",)),
            ("--out-dir", out / "sweep.png", (".png",)),
            ("--out-dir", out / "pareto.png", (".png",)),
        ]
        + [("--out-dir", path, ()) for path in _point_files(out, harness.input_paths(args))],
        harness.input_paths(args),
    )
    out.mkdir(parents=True, exist_ok=True)
    if args.backend != ENGINE_BACKEND:
        return _sweep(args, axis, configs[0], None)
    from attention_kv_caceh.harness.engine_server import ServerStartError

    try:
        return harness_engine.run_against_engine(
            args,
            "sweep",
            lambda url, describe: _sweep(args, axis, replace(configs[0], base_url=url), describe),
        )
    except ServerStartError as exc:
        error(f"serve --model {args.model}: {exc}")
        return 2 if exc.returncode == 2 else 1  # 2: serve refused the model or a flag (its line above)


def _sweep(
    args: argparse.Namespace, axis: Axis, base: HarnessConfig, describe: Callable[[], dict[str, Any]] | None
) -> int:
    sweep = _Sweep(args, axis, base)
    print(
        f"sweep: backend={args.backend} axis={axis} concurrency={args.concurrency} "
        f"request_rate={args.request_rate} repeats={args.repeats} num_requests={base.num_requests} "
        f"workload={base.workload.kind} seed={base.seed} out_dir={sweep.out}"
        + "".join(f" {k}={v}" for k, v in base.sampling.body_fields().items()),
        flush=True,
    )
    doc: dict[str, Any] = {"kind": "serving-sweep", "axis": axis, "config": base.describe()}
    code = 0
    try:
        if args.slo:
            slo: dict[str, Any] = {
                "objectives_ms": base.goodput.as_dict(),
                "pass_fraction": SLO_PASS_FRACTION,
                "tries": [],
            }
            doc["slo"] = slo
            _slo(args, sweep, base, slo)
        else:
            values: list[float] = args.concurrency if axis == "concurrency" else args.request_rate
            for value in values:
                for repeat in range(args.repeats):
                    c = int(value) if axis == "concurrency" else base.concurrency
                    r = float(value) if axis == "request_rate" else base.request_rate
                    sweep.run_point(c, r, repeat, _name(axis, value, repeat))
    except KeyboardInterrupt:
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
        code = 130
    except BrokenPipeError:  # stdout's reader left (`| head`): stop quietly, keep what finished
        stdout_closed()
        code = 1
    except (SmokeTestError, ModelDiscoveryError, RuntimeError, ValueError, OSError) as exc:
        error(exc)
        code = 1
    if not sweep.rows:
        return code
    with ignoring_sigint():
        return _finish(args, sweep, doc, describe, code)


def _slo(args: argparse.Namespace, sweep: _Sweep, base: HarnessConfig, out: dict[str, Any]) -> None:
    """Run the SLO search; every try is added to `out["tries"]` as it ends (an interrupted search keeps
    them), then `best_rate` and `lowest_failing_rate`."""
    rates: list[float] = args.request_rate
    bracket = (rates[0], rates[1]) if len(rates) == 2 else None
    start = rates[0] if math.isfinite(rates[0]) else 1.0
    tries: list[dict[str, Any]] = out["tries"]

    def try_rate(rate: float) -> tuple[float, Mapping[str, Any]]:
        row = sweep.run_point(base.concurrency, rate, 0, f"slo-try{len(sweep.rows)}-rate{rate:.4g}")
        fraction = 0.0 if row["good_fraction"] is None else float(row["good_fraction"])
        passed = fraction >= SLO_PASS_FRACTION
        tries.append({"rate": rate, "good_fraction": fraction, "passed": passed, "jsonl": row["jsonl"]})
        print(
            f"SLO search: try {len(tries) - 1}: rate {rate:.4g} req/s: {100 * fraction:.1f} % good: "
            + ("pass" if passed else "fail"),
            flush=True,
        )
        return fraction, row

    result = search_slo_rate(try_rate, start=start, bracket=bracket, max_runs=args.max_runs)
    out["best_rate"], out["lowest_failing_rate"] = result.best_rate, result.lowest_failing_rate
    print(f"SLO search ({' '.join(args.slo)}, pass: >= {100 * SLO_PASS_FRACTION:.0f} % of requests good):")
    for i, t in enumerate(result.tries):
        print(
            f"  try {i}: rate {t.rate:.4g} req/s: {100 * t.good_fraction:.1f} % good: {'pass' if t.passed else 'fail'}"
        )
    if result.best_rate is None:
        lowest = min(t.rate for t in result.tries)
        print(f"SLO search: no rate passed in {len(result.tries)} runs (lowest tried {lowest:.4g} req/s)")
    else:
        print(
            f"SLO search: highest passing rate {result.best_rate:.4g} req/s"
            + (
                f" (lowest failing {result.lowest_failing_rate:.4g} req/s)"
                if result.lowest_failing_rate is not None
                else " (no failing rate found: raise --max-runs or the start)"
            )
            + f", {len(result.tries)} runs"
        )


def _finish(
    args: argparse.Namespace,
    sweep: _Sweep,
    doc: dict[str, Any],
    describe: Callable[[], dict[str, Any]] | None,
    code: int,
) -> int:
    """Write sweep.png, pareto.png and sweep.json, then print the table, the knee and what was written (files
    first: a closed stdout cannot lose them); returns the exit code."""
    written = [str(sweep.out / "sweep.csv")]
    doc["rows"] = sweep.rows
    doc["prefix_cache_reset"] = sorted({str(r["prefix_cache_reset"]) for r in sweep.rows})
    verdict: str | None = None
    failed: OSError | None = None
    try:
        if not args.slo:
            knee = find_knee(sweep.rows, sweep.axis)
            verdict = knee.verdict
            doc["knee"] = {"value": knee.value, "verdict": knee.verdict, "gains_per_doubling": knee.gains}
            from attention_kv_caceh.harness.sweep_plot import plot_pareto, plot_sweep

            title = (
                f"sweep over {sweep.axis} ({args.backend}, {sweep.base.num_requests} requests a run, "
                f"prompt {sweep.base.prompt_len}, output {sweep.base.output_len}, workload "
                f"{sweep.base.workload.kind})"
            )
            written.append(str(plot_sweep(sweep.rows, sweep.axis, knee, sweep.out / "sweep.png", title)))
            pareto = sweep.out / "pareto.png"
            written.append(str(plot_pareto(sweep.rows, sweep.axis, pareto, "Pareto: " + title)))
            doc["pareto"] = [dataclasses.asdict(p) for p in pareto_points(sweep.rows)]
        if describe is not None:
            doc["server"] = describe()
        doc["environment"] = sweep.environment
        if code == 130:
            doc["interrupted"] = True
            if sweep.partial is not None:
                doc["interrupted_run"] = sweep.partial
        written.append(str(write_json_atomic(sweep.out / "sweep.json", doc)))
    except OSError as exc:
        failed = exc
    print(format_table(sweep.rows, sweep.axis))
    if sweep.failed_requests:
        print(f"warning: {sweep.failed_requests} requests failed across the sweep (see each run's JSONL)")
    if verdict is not None:
        print(verdict)
    if failed is not None:
        error(f"could not write an output file: {failed}")
        return 1
    print("wrote: " + ", ".join(written) + f" and {len(sweep.rows)} runs' JSONL and summary files")
    return code
