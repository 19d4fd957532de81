"""`sweep`'s runs: its options (`SweepOptions`), one harness run per point of the grid or per try of the
SLO search (`SweepRun`), and the files of the whole sweep (`SweepRun.finish`).

Each point is one harness run with the same seed, `repeats` times, the prefix cache emptied before each
(`repeat_run.reset_cache`). Each run's per-request JSONL (a `run_files.RecordSink`, written as requests
finish), its metadata and its summary JSON are in the folder as soon as the run ends, and sweep.csv (a
row per point and repeat) is rewritten after every run, so Ctrl-C keeps every finished point and the
records of the one in progress (metadata `status: interrupted`, a summary of them). At the end:
sweep.png (the curve and its knee), pareto.png and sweep.json (docs/files.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from attention_kv_caceh.files import ignoring_sigint, path_problem, write_csv_atomic, write_json_atomic
from attention_kv_caceh.harness.config import HarnessConfig
from attention_kv_caceh.harness.discovery import ModelDiscoveryError
from attention_kv_caceh.harness.load import SmokeTestError
from attention_kv_caceh.harness.metrics import parse_goodput
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.repeat_run import reset_cache
from attention_kv_caceh.harness.repeats import MAX_REPEATS
from attention_kv_caceh.harness.run import run_harness
from attention_kv_caceh.harness.run_files import RecordSink, partial_summary, summary_document
from attention_kv_caceh.harness.run_text import point_line, slo_lines
from attention_kv_caceh.harness.sweep import (
    CSV_FIELDS,
    SLO_PASS_FRACTION,
    Axis,
    find_knee,
    pareto_points,
    search_slo_rate,
    sweep_row,
)
from attention_kv_caceh.options import ConfigError, check_options, option
from attention_kv_caceh.timing import capture_environment

__all__ = ["SweepOptions", "SweepRun", "point_name"]

_GRID = "; several values: a grid of points"


def _folder(text: str) -> Path:
    problem = path_problem(text)
    if problem is not None:
        raise ValueError(problem)
    return Path(text)


@dataclass(frozen=True)
class SweepOptions:
    """The grid (`concurrency` or `request_rate` with several values), the folder, the repeats and the
    SLO search (`slo`: --goodput's items; `request_rate` is then its start or bracket). Raises
    ConfigError naming the field."""

    concurrency: list[int] = option(
        default_factory=lambda: [4],
        nargs="+",
        parse=int,
        metavar="CONCURRENCY",
        help="client in-flight limit (the semaphore)" + _GRID,
        default_text="[4]",
    )
    request_rate: list[float] = option(
        default_factory=lambda: [math.inf],
        nargs="+",
        parse=float,
        metavar="REQUEST_RATE",
        help="arrivals per second (inf: all at once; else Poisson/gamma)" + _GRID,
        default_text="[inf]",
    )
    out_dir: Path | None = option(
        None,
        parse=_folder,
        metavar="DIR",
        help="folder for every run's JSONL and summary, sweep.csv, sweep.png, pareto.png, sweep.json "
        "(created; files of the same names are replaced)",
        default_text="none, required",
    )
    repeats: int = option(1, help=f"runs per point, at most {MAX_REPEATS}")
    slo: list[str] = option(
        default_factory=lambda: list[str](),
        nargs="+",
        metavar="METRIC:MS",
        help="search the highest request rate at which >= 99 %% of requests meet these objectives "
        "(--goodput's meaning, e.g. ttft:2000 tpot:200); --request-rate is then the start (one value, "
        "default 1) or LOW HIGH with LOW < HIGH, finite and > 0",
        default_text="no search",
    )
    max_runs: int = option(8, help="runs the SLO search may use in all", minimum=1)

    def __post_init__(self) -> None:
        check_options(self)
        if not 1 <= self.repeats <= MAX_REPEATS:  # the rule of harness --repeats
            raise ConfigError("repeats", f"must be in [1, {MAX_REPEATS}], got {self.repeats}")
        if self.out_dir is None:
            raise ConfigError("out_dir", "required: the folder of the sweep's files")
        for name in ("concurrency", "request_rate"):
            values = [float(v) for v in getattr(self, name)]
            repeated = sorted({v for v in values if values.count(v) > 1})
            if repeated:
                raise ConfigError(
                    name,
                    f"{' '.join(f'{v:g}' for v in values)}: {repeated[0]:g} is given twice; each point "
                    "runs once (use repeats for more runs of a point)",
                )
        if self.slo:
            self._check_slo()
        elif len(self.concurrency) > 1 and len(self.request_rate) > 1:
            raise ConfigError("concurrency", "and request_rate both have several values: a sweep varies one")

    def _check_slo(self) -> None:
        try:
            parse_goodput(self.slo)
        except ValueError as exc:
            raise ConfigError("slo", str(exc)) from None
        rates = self.request_rate
        if len(self.concurrency) != 1:
            raise ConfigError(
                "concurrency", f"{self.concurrency}: the SLO search varies the rate; give one value"
            )
        if len(rates) > 2:
            raise ConfigError("request_rate", f"{rates}: with an SLO give START or LOW HIGH")
        if self.repeats != 1:
            raise ConfigError("repeats", f"{self.repeats}: the SLO search runs each rate once")
        if any(not (math.isfinite(r) and r > 0) for r in rates) and rates != [math.inf]:
            raise ConfigError("request_rate", f"{rates}: the SLO search needs finite rates > 0")
        if len(rates) == 2 and not rates[0] < rates[1]:
            raise ConfigError("request_rate", f"{rates[0]:g} {rates[1]:g}: with an SLO expected LOW < HIGH")

    @property
    def axis(self) -> Axis:
        return "request_rate" if self.slo or len(self.request_rate) > 1 else "concurrency"

    def points(self) -> list[tuple[int, float]]:
        """Every (concurrency, request rate) the sweep may run first (the SLO search: its start)."""
        if self.slo:
            return [(self.concurrency[0], r if math.isfinite(r) else 1.0) for r in self.request_rate]
        return [(c, r) for c in self.concurrency for r in self.request_rate]


def point_name(axis: Axis, value: float, repeat: int) -> str:
    """The file stem of one run: `c4-r0`, `rate2.5-r1`, `rateinf-r0`."""
    if axis == "concurrency":
        return f"c{int(value)}-r{repeat}"
    return f"rate{value:g}-r{repeat}" if math.isfinite(value) else f"rateinf-r{repeat}"


Ending = Literal["complete", "failed", "interrupted"]


@dataclass
class SweepRun:
    """The state of one sweep: where files go, the rows so far, the interrupted run's files. `say`
    takes each progress line (a point's, the SLO search's)."""

    options: SweepOptions
    base: HarnessConfig
    say: Callable[[str], None]
    rows: list[dict[str, Any]] = field(default_factory=lambda: list[dict[str, Any]]())
    environment: dict[str, Any] = field(default_factory=capture_environment)
    runs: int = 0
    failed_requests: int = 0
    partial: dict[str, Any] | None = None  # the interrupted run's files: {"jsonl", "records"}
    doc: dict[str, Any] = field(default_factory=lambda: dict[str, Any]())

    @property
    def out(self) -> Path:
        assert self.options.out_dir is not None
        return self.options.out_dir

    def run(self, error: Callable[[str], None]) -> Ending:
        """Every point (or the SLO search); a runtime failure is one line to `error`. A closed stdout
        (BrokenPipeError) is raised; every finished run is kept whichever way it ends."""
        self.doc = {"kind": "serving-sweep", "axis": self.options.axis, "config": self.base.describe()}
        try:
            if self.options.slo:
                self._slo()
            else:
                axis = self.options.axis
                values: list[float] = [
                    *(self.options.concurrency if axis == "concurrency" else self.options.request_rate)
                ]
                for value in values:
                    for repeat in range(self.options.repeats):
                        c = int(value) if axis == "concurrency" else self.base.concurrency
                        r = float(value) if axis == "request_rate" else self.base.request_rate
                        self.run_point(c, r, repeat, point_name(axis, value, repeat))
        except KeyboardInterrupt:
            return "interrupted"
        except BrokenPipeError:
            raise
        except (SmokeTestError, ModelDiscoveryError, RuntimeError, ValueError, OSError) as exc:
            error(str(exc))
            return "failed"
        return "complete"

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
        reset = reset_cache(config)
        jsonl = self.out / f"{name}.jsonl"
        sink = RecordSink(jsonl)
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
                self._save_partial(config, sink, finished)
            raise
        finally:
            sink.close()
        if sink.error is not None:
            raise RuntimeError(f"could not write {jsonl}: {sink.error}")
        sink.finish("complete", result.config, self.environment, None, None, [])
        doc = summary_document(result, result.summary, result.config, self.environment)
        write_json_atomic(jsonl.with_suffix(".summary.json"), doc)
        row = sweep_row(
            self.options.axis, concurrency, rate, repeat, result.summary, reset=reset,
            jsonl=jsonl.name if sink.opened else "",
        )  # fmt: skip
        self.rows.append(row)
        self.failed_requests += result.summary["failed"]
        write_csv_atomic(self.out / "sweep.csv", self.rows, CSV_FIELDS)
        self.say(point_line(name, row))
        for warning in result.summary["warnings"]:
            self.say(f"  warning: {warning}")
        return row

    def _save_partial(self, config: HarnessConfig, sink: RecordSink, finished: list[RequestRecord]) -> None:
        if not sink.opened or not finished or sink.path is None:
            return
        self.partial = {"jsonl": sink.path.name, "records": sink.count}
        sink.finish("interrupted", config, self.environment, None, None, [])
        doc = summary_document(None, partial_summary(config, finished), config, self.environment)
        write_json_atomic(sink.path.with_suffix(".summary.json"), doc)

    def _slo(self) -> None:
        """Run the SLO search; every try is added to the document's `slo.tries` as it ends (an
        interrupted search keeps them), then `best_rate` and `lowest_failing_rate`."""
        rates = self.options.request_rate
        tries: list[dict[str, Any]] = []
        slo: dict[str, Any] = {
            "objectives_ms": self.base.goodput.as_dict(),
            "pass_fraction": SLO_PASS_FRACTION,
            "tries": tries,
        }
        self.doc["slo"] = slo

        def try_rate(rate: float) -> tuple[float, Mapping[str, Any]]:
            row = self.run_point(self.base.concurrency, rate, 0, f"slo-try{len(self.rows)}-rate{rate:.4g}")
            fraction = 0.0 if row["good_fraction"] is None else float(row["good_fraction"])
            passed = fraction >= SLO_PASS_FRACTION
            tries.append({"rate": rate, "good_fraction": fraction, "passed": passed, "jsonl": row["jsonl"]})
            self.say(
                f"SLO search: try {len(tries) - 1}: rate {rate:.4g} req/s: {100 * fraction:.1f} % good: "
                + ("pass" if passed else "fail")
            )
            return fraction, row

        result = search_slo_rate(
            try_rate,
            start=rates[0] if math.isfinite(rates[0]) else 1.0,
            bracket=(rates[0], rates[1]) if len(rates) == 2 else None,
            max_runs=self.options.max_runs,
        )
        slo["best_rate"], slo["lowest_failing_rate"] = result.best_rate, result.lowest_failing_rate
        done = [(t.rate, t.good_fraction, t.passed) for t in result.tries]
        for line in slo_lines(
            self.options.slo, SLO_PASS_FRACTION, done, result.best_rate, result.lowest_failing_rate
        ):
            self.say(line)

    def finish(
        self, title: str, describe: Callable[[], dict[str, Any]] | None, interrupted: bool
    ) -> tuple[str | None, list[str], OSError | None]:
        """Write sweep.png, pareto.png (a grid, not an SLO search) and sweep.json; returns the knee's
        verdict (None for an SLO search), the paths written and the OSError that stopped the writes."""
        written = [str(self.out / "sweep.csv")]
        doc = self.doc
        doc["rows"] = self.rows
        doc["prefix_cache_reset"] = sorted({str(r["prefix_cache_reset"]) for r in self.rows})
        verdict: str | None = None
        try:
            if not self.options.slo:
                axis = self.options.axis
                knee = find_knee(self.rows, axis)
                verdict = knee.verdict
                doc["knee"] = {"value": knee.value, "verdict": knee.verdict, "gains_per_doubling": knee.gains}
                from attention_kv_caceh.harness.sweep_plot import plot_pareto, plot_sweep

                written.append(str(plot_sweep(self.rows, axis, knee, self.out / "sweep.png", title)))
                pareto = self.out / "pareto.png"
                written.append(str(plot_pareto(self.rows, axis, pareto, "Pareto: " + title)))
                doc["pareto"] = [dataclasses.asdict(p) for p in pareto_points(self.rows)]
            if describe is not None:
                doc["server"] = describe()
            doc["environment"] = self.environment
            if interrupted:
                doc["interrupted"] = True
                if self.partial is not None:
                    doc["interrupted_run"] = self.partial
            written.append(str(write_json_atomic(self.out / "sweep.json", doc)))
        except OSError as exc:
            return verdict, written, exc
        return verdict, written, None
