"""The batch-size scan as one recorded run: predictions first, then one batch size at a time, each
finished B's samples and records added to the run's `recorder.RunRecorder` as soon as it is done.

    run = ScanRun(config, impls, build_inputs(config))
    with RunRecorder("batch-size-scan", csv, SAMPLE_FIELDS, config=asdict(config), environment=env,
                     extra=run.meta_extra(...), before_save=run.before_save, side_files=...) as recorder:
        for event in record_scan(run, recorder, user):   # what the command prints as it goes
            ...

Order (as the lab guide tells it): every implementation is calibrated (`calibration.calibrate`: its oracle, then its
call overhead at B = 1, T = 1; the first one's read probe shared by the others) and its roofline
prediction written to the metadata on disk before any B is timed; then `scan.run_batch` at each B
(every live implementation checked, then timed, then the probe). An implementation whose oracle fails
is not timed again (`oracle_failures` in the metadata). A Ctrl-C inside a B keeps the samples it took
(`BatchInterrupted`: raw rows in the CSV, `incomplete_batch` in the metadata, not in the tables); the
recorder's `with` block turns it into `status: interrupted`. Nothing here prints: the events say what
happened, and `report/scan_text.py` words them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from attention_kv_caceh.experiments import scan
from attention_kv_caceh.experiments.calibration import calibrate
from attention_kv_caceh.experiments.prediction import (
    ScanPrediction,
    UserPrediction,
    check_user_prediction,
    make_scan_prediction,
    parse_saturation,
    utc_now,
)
from attention_kv_caceh.experiments.prediction_check import ScanOutcome, evaluate_scan
from attention_kv_caceh.experiments.scan import (
    SAMPLE_FIELDS,
    BatchInterrupted,
    BatchResult,
    ScanConfig,
    ScanInputs,
)
from attention_kv_caceh.experiments.scan_impls import IMPL_CHOICES
from attention_kv_caceh.experiments.scan_stats import SUMMARY_FIELDS, scan_tables, summary_rows
from attention_kv_caceh.files import output_path, write_csv_atomic
from attention_kv_caceh.options import ConfigError, check_options, option
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.recorder import RunRecorder
from attention_kv_caceh.timing import Sample

__all__ = ["PROBE", "ScanEvent", "ScanOptions", "ScanRun", "record_scan", "run_batch"]

# The read probe as the metadata describes it.
PROBE = "np.dot(buf, buf) over a buffer of kv_bytes_per_step bytes (BLAS dot: one read stream)"

# Looked up here at call time, so that a test can stand in for the timed step.
run_batch = scan.run_batch


def _saturation_flag(text: str) -> str:
    """--predict-saturation: a batch size >= 1 or 'none' (`parse_saturation`, ValueError otherwise); the
    text itself is kept, so that None still means "not given"."""
    parse_saturation(text)
    return text


@dataclass(frozen=True)
class ScanOptions:
    """The scan's options that are not measurement parameters (flags of the default command): where
    it writes, how it runs, what the user predicts."""

    csv: Path = option(
        Path("results/benchmark.csv"), help="raw samples CSV", metavar="PATH.csv", parse=output_path(".csv")
    )
    blas_threads: int | None = option(
        None,
        help="pin BLAS threads with threadpoolctl for this run",
        metavar="N",
        minimum=1,
        default_text="not pinned",
    )
    plot: Path | None = option(
        None,
        help="PNG: P50 with P95 bars, positions/s vs B",
        metavar="PATH.png",
        parse=output_path(".png"),
        default_text="no plot",
    )
    impl: str = option(
        "numpy",
        help="decode step to time: numpy (attention.multihead_decode_step), fused (the Numba kernel, one "
        "thread), or all: both, plus torch-sdpa (one thread) where torch can be imported, each checked "
        "and timed at every B in turn, side by side against the same probe",
        choices=IMPL_CHOICES,
    )
    predict: str = option(
        "",
        help="your prediction in words, recorded with a timestamp before the first timed sample and shown "
        "beside the verdicts (not checked: it is prose)",
        metavar="TEXT",
        default_text="none",
    )
    predict_saturation: str | None = option(
        None,
        help="your predicted saturation point: a scanned B other than the largest, or 'none' for not "
        "reached; checked against the measured one",
        metavar="B|none",
        parse=_saturation_flag,
        default_text="not given",
    )

    def __post_init__(self) -> None:
        check_options(self)

    def user_prediction(self, batch_sizes: Sequence[int]) -> UserPrediction:
        """--predict and --predict-saturation as a UserPrediction. Raises ConfigError for a saturation
        no scan of `batch_sizes` could measure (`check_user_prediction`)."""
        given = self.predict_saturation is not None
        saturation = (
            parse_saturation(self.predict_saturation) if self.predict_saturation is not None else None
        )
        user = UserPrediction(self.predict, given, saturation)
        try:
            check_user_prediction(user, batch_sizes)
        except ValueError as exc:
            raise ConfigError("predict_saturation", str(exc)) from None
        return user

    @property
    def summary_csv(self) -> Path:
        """`results/benchmark.csv` -> `results/benchmark-summary.csv`."""
        return self.csv.with_name(f"{self.csv.stem}-summary.csv")


@dataclass(frozen=True)
class ScanEvent:
    """What happened, for the command to print: an implementation's calibration oracle failed
    ("calibration-failed"), every prediction is on disk ("predicted"), batch size B starts ("batch"),
    an implementation's oracle failed at B ("oracle-failed"), or every one did ("all-failed": the run
    ends, `status: oracle-failed`). `message`: the oracle's."""

    kind: Literal["calibration-failed", "predicted", "batch", "oracle-failed", "all-failed"]
    impl: str = ""
    batch_size: int = 0
    message: str = ""


@dataclass
class ScanRun:
    """One scan's state as it runs, what its files are rewritten from.

    predictions: impl -> its roofline prediction (implementations whose calibration passed);
    results: every finished B; partial: the samples of a B cut short by Ctrl-C (raw rows only), and
    partial_stage what the Ctrl-C cut (`scan.BatchInterrupted.stage`); failures: impl -> where its oracle failed ("B=2: ...", "calibration (B=1, T=1): ...").
    """

    config: ScanConfig
    impls: tuple[str, ...]
    inputs: ScanInputs
    predictions: dict[str, ScanPrediction] = field(default_factory=lambda: dict[str, ScanPrediction]())
    results: list[BatchResult] = field(default_factory=lambda: list[BatchResult]())
    partial: tuple[Sample, ...] = ()
    partial_stage: str = ""
    failures: dict[str, str] = field(default_factory=lambda: dict[str, str]())

    @property
    def samples(self) -> list[Sample]:
        """Every sample of the finished batch sizes (not those of a B cut short)."""
        return [s for r in self.results for s in r.samples]

    def tables(self) -> dict[str, list[dict[str, float]]]:
        """`scan_stats.scan_tables` of every finished B: impl -> rows, against each B's probe."""
        return scan_tables(
            self.samples,
            {r.batch_size: r.probe_samples_ms for r in self.results},
            {r.batch_size: r.kv_bytes_per_step for r in self.results},
        )

    def outcomes(self) -> dict[str, ScanOutcome]:
        """Each timed implementation's prediction against its samples (`evaluate_scan`)."""
        samples = self.samples
        return {
            impl: evaluate_scan(self.predictions[impl], [s for s in samples if s.impl == impl])
            for impl in self.tables()
            if impl in self.predictions
        }

    def meta_extra(self, blas_threads: int | None, files: dict[str, str]) -> dict[str, Any]:
        """The metadata a scan records beside its kind, status, config and environment."""
        return {
            "impls": list(self.impls),
            "blas_threads_flag": blas_threads,
            "probe": PROBE,
            "probe_samples_ms": {},
            "kv_bytes_per_step": {},
            "oracle_max_abs_error": {},
            "oracle_max_abs_error_by_impl": {},
            "files": files,
        }

    def recorder(
        self,
        options: ScanOptions,
        environment: dict[str, Any],
        side_files: Callable[[RunRecorder], None] | None = None,
    ) -> RunRecorder:
        """The run's recorder: `options.csv` (SAMPLE_FIELDS) and its metadata, kind "batch-size-scan"."""
        files = {"raw_csv": str(options.csv), "summary_csv": str(options.summary_csv)}
        return RunRecorder(
            "batch-size-scan",
            options.csv,
            SAMPLE_FIELDS,
            config=asdict(self.config),
            environment=environment,
            extra=self.meta_extra(options.blas_threads, files),
            before_save=self.before_save,
            side_files=side_files,
        )

    def before_save(self, recorder: RunRecorder) -> None:
        """Before each save: the kernels' first-call compile (or disk-cache load) seconds, kept out of
        every sample, when the fused kernel runs."""
        if "fused" in self.impls:
            from attention_kv_caceh.kernels.decode_attention import compile_seconds

            recorder.meta["kernel_compile_seconds"] = compile_seconds()

    def write_summary(self, path: str | Path) -> None:
        """The summary CSV of the finished batch sizes, header-only before the first, rewritten with the
        raw file every time so that an earlier run's summary never sits beside this run's files."""
        write_csv_atomic(path, summary_rows(self.tables()) if self.results else [], SUMMARY_FIELDS)


def _predict(run: ScanRun, recorder: RunRecorder, user: UserPrediction) -> Iterator[ScanEvent]:
    """Calibrate each implementation and record its prediction (module docstring)."""
    probe: tuple[float, ...] | None = None
    for impl in run.impls:
        try:
            calibration = calibrate(run.config, run.inputs, impl, probe)
        except OracleMismatch as exc:
            run.failures[impl] = f"calibration (B=1, T=1): {exc}"
            recorder.meta["oracle_failures"] = dict(run.failures)
            yield ScanEvent("calibration-failed", impl, message=str(exc))
            continue
        probe = calibration.probe_samples_ms
        run.predictions[impl] = make_scan_prediction(run.config, calibration, user)
    if not run.predictions:
        return
    recorder.meta["prediction"] = next(iter(run.predictions.values())).to_json()
    recorder.meta["predictions"] = {impl: p.to_json() for impl, p in run.predictions.items()}
    recorder.save()  # on disk before the first timed sample
    yield ScanEvent("predicted")


def _record_batch(run: ScanRun, recorder: RunRecorder, result: BatchResult) -> None:
    b, meta = str(result.batch_size), recorder.meta
    run.results.append(result)
    meta["probe_samples_ms"][b] = list(result.probe_samples_ms)
    meta["kv_bytes_per_step"][b] = result.kv_bytes_per_step
    meta["oracle_max_abs_error"][b] = result.oracle_max_abs_error
    for impl, err in result.oracle_errors:
        meta["oracle_max_abs_error_by_impl"].setdefault(impl, {})[b] = err
    recorder.add(asdict(s) for s in result.samples)


def record_scan(run: ScanRun, recorder: RunRecorder, user: UserPrediction) -> Iterator[ScanEvent]:
    """Run the scan into `recorder`, yielding what the command prints as it goes (`ScanEvent`).

    Ends early after `recorder.finish("oracle-failed")` when every implementation failed its
    calibration (no "predicted" event) or its oracle at one B ("all-failed"). Raises
    BatchInterrupted (a KeyboardInterrupt) after adding the samples of the B it cut short.
    """
    yield from _predict(run, recorder, user)
    if not run.predictions:
        recorder.finish("oracle-failed")
        return
    recorder.meta["timing_started_utc"] = utc_now()
    alive: list[str] = [i for i in run.impls if i in run.predictions]
    for b in run.config.batch_sizes:
        yield ScanEvent("batch", batch_size=b)
        try:
            result = run_batch(run.config, run.inputs, b, tuple(alive))  # check, then time, at B = b
        except OracleMismatch as exc:
            recorder.finish("oracle-failed")
            yield ScanEvent("all-failed", batch_size=b, message=str(exc))
            return
        except BatchInterrupted as exc:
            _keep_partial(run, recorder, exc.samples, exc.stage)
            raise
        for impl, message in result.oracle_failures:
            alive.remove(impl)
            run.failures[impl] = f"B={b}: {message}"
            recorder.meta["oracle_failures"] = dict(run.failures)
            yield ScanEvent("oracle-failed", impl, b, message)
        _record_batch(run, recorder, result)


def _keep_partial(run: ScanRun, recorder: RunRecorder, samples: Sequence[Sample], stage: str) -> None:
    """The samples of a B cut short go into the raw CSV (not the tables); the metadata names the B and
    the stage the Ctrl-C cut (an implementation, or "probe": the samples are whole, the read probe not)."""
    if not samples:
        return
    run.partial = tuple(samples)
    run.partial_stage = stage
    recorder.meta["incomplete_batch"] = {
        "batch_size": samples[0].batch_size,
        "samples": len(samples),
        "cut_during": stage,
    }
    recorder.add(asdict(s) for s in samples)
