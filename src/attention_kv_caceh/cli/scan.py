"""`attention-kv-caceh` with no subcommand: the batch-size scan of decode attention (the main job).

    attention-kv-caceh --csv results/benchmark.csv          # B = 1, 2, 4, 8 at T = 128

    attention-kv-caceh --predict "saturates at B = 4" --predict-saturation 4

    attention-kv-caceh --impl all      # NumPy and the fused kernel (and torch SDPA) side by side

Flags (`ScanConfig`, `ShapeOptions` and `ScanOptions` fields) -> config -> `experiments.scan_run.
record_scan` into a `RunRecorder` -> print (`report.scan_text`). Prints a setup card; the run measures
each implementation's call overhead and the read bandwidth and writes one prediction per
implementation to the `.meta.json` before the first timed sample (the prediction card is printed when
the user gave a prediction); then one batch size at a time, rewriting the raw CSV, the summary CSV,
the metadata and `<stem>.md` (the run's Markdown, the section `report` renders from the raw file) after
every B; then prints the table, the saturation verdicts, the predictions against the measurement and
one JSON line. Exit codes: 0 done, 1 an oracle check failed (that implementation was not timed at that
B nor after it; the others were, and every file is complete) or out of memory, 2 bad usage (nothing
touched), 130 interrupted (every sample taken, and the predictions, are on disk).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

from attention_kv_caceh.cli.common import (
    PROG,
    UsageError,
    check_markdown_file,
    check_outputs,
    check_side_files,
    output_file,
    warn_if_blas_unpinned,
)
from attention_kv_caceh.cli.flags import add_options, config_from_args
from attention_kv_caceh.experiments.prediction import UserPrediction, check_user_prediction, parse_saturation
from attention_kv_caceh.experiments.scan import SAMPLE_FIELDS, ScanConfig, build_inputs, estimate_scan_bytes
from attention_kv_caceh.experiments.scan_impls import IMPL_CHOICES, IMPLS, resolve_impls
from attention_kv_caceh.experiments.scan_run import ScanRun, record_scan
from attention_kv_caceh.experiments.scan_stats import SUMMARY_FIELDS
from attention_kv_caceh.experiments.shape import ShapeOptions
from attention_kv_caceh.files import atomic_write_text, markdown_path, meta_path
from attention_kv_caceh.memory import MemoryBudgetError, check_memory
from attention_kv_caceh.options import check_options, option
from attention_kv_caceh.recorder import RunRecorder
from attention_kv_caceh.report.outcome import prediction_card
from attention_kv_caceh.report.scan_text import (
    event_line,
    plot_title,
    result_records,
    result_text,
    scan_live_markdown,
    setup_card,
    summary_json,
)
from attention_kv_caceh.timing import capture_environment

__all__ = ["HELP", "ScanOptions", "add_arguments", "run", "scan_config", "setup_card", "summary_path"]

HELP = "batch-size scan of decode attention over a KV cache (the default command)"
_DEFAULTS = ScanConfig()


def _saturation_flag(text: str) -> str:
    """--predict-saturation: a batch size >= 1 or 'none' (`parse_saturation`, ValueError otherwise); the
    text itself is kept, so that None still means "not given"."""
    parse_saturation(text)
    return text


@dataclass(frozen=True)
class ScanOptions:
    """The scan's flags that are not measurement parameters: where it writes, how it runs, what the
    user predicts."""

    csv: Path = option(  # noqa: RUF009  (option() returns a dataclasses.field)
        Path("results/benchmark.csv"), help="raw samples CSV", metavar="PATH.csv", parse=output_file(".csv")
    )
    blas_threads: int | None = option(
        None,
        help="pin BLAS threads with threadpoolctl for this run",
        metavar="N",
        minimum=1,
        default_text="not pinned",
    )
    plot: Path | None = option(  # noqa: RUF009
        None,
        help="PNG: P50 with P95 bars, positions/s vs B",
        metavar="PATH.png",
        parse=output_file(".png"),
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the batch-size scan: the fields of ScanOptions, ScanConfig and ShapeOptions."""
    add_options(parser, ScanOptions, only=("csv",))
    add_options(parser, ScanConfig, only=("batch_sizes", "seq_len"))
    add_options(
        parser,
        ShapeOptions,
        default_texts=ShapeOptions.default_texts(_DEFAULTS.num_heads, _DEFAULTS.head_dim),
    )
    add_options(parser, ScanConfig, exclude=("batch_sizes", "seq_len"))
    add_options(parser, ScanOptions, exclude=("csv",))


def scan_config(args: argparse.Namespace) -> ScanConfig:
    """The validated ScanConfig of parsed flags (the shape resolved: explicit flags, then the preset).
    Raises UsageError naming the flag for a value the config rejects."""
    shape = config_from_args(ShapeOptions, args).resolve(_DEFAULTS.num_heads, _DEFAULTS.head_dim)
    return config_from_args(ScanConfig, args, ShapeOptions, **asdict(shape))


def _user_prediction(options: ScanOptions, batch_sizes: Sequence[int]) -> UserPrediction:
    """--predict and --predict-saturation; UsageError for a saturation no scan of `batch_sizes` could
    measure (`check_user_prediction`)."""
    given = options.predict_saturation is not None
    saturation = (
        parse_saturation(options.predict_saturation) if options.predict_saturation is not None else None
    )
    user = UserPrediction(options.predict, given, saturation)
    try:
        check_user_prediction(user, batch_sizes)
    except ValueError as exc:
        raise UsageError(f"--predict-saturation: {exc}") from None
    return user


def summary_path(csv_path: Path) -> Path:
    """`results/benchmark.csv` -> `results/benchmark-summary.csv`."""
    return csv_path.with_name(f"{csv_path.stem}-summary.csv")


def run(args: argparse.Namespace) -> int:
    """Run the batch-size scan from parsed flags; writes raw CSV, summary CSV, metadata (and the plot).

    Raises UsageError (nothing touched) for a bad shape, a run too large for this machine's memory, or
    an output file (the CSV, the summary and metadata beside it, the plot) that cannot be written, and
    for a `<stem>.md` beside the CSV that no lab command wrote (`common.check_markdown_file`).
    """
    config, options = scan_config(args), config_from_args(ScanOptions, args)
    try:
        check_memory(
            estimate_scan_bytes(config, len(IMPLS) if options.impl == "all" else 1),
            f"this scan (B={max(config.batch_sizes)}, T={config.seq_len}, {config.repeats} repeats, "
            f"H_kv={config.num_kv_heads}, D={config.head_dim})",
            "--batch-sizes, --seq-len or --repeats",
        )
    except MemoryBudgetError as exc:
        raise UsageError(str(exc)) from None
    user = _user_prediction(options, config.batch_sizes)
    csv = options.csv
    beside = f"--csv {str(csv)!r}: the file beside it"
    side = (summary_path(csv), meta_path(csv), markdown_path(csv))
    check_outputs(
        [("--csv", csv, (".csv",)), *((beside, p, ()) for p in side), ("--plot", options.plot, (".png",))]
    )
    check_side_files("--csv", {summary_path(csv): SUMMARY_FIELDS, meta_path(csv): ()})
    check_markdown_file("--csv", csv)

    from threadpoolctl import threadpool_limits  # pyright: ignore[reportMissingTypeStubs]

    pin = threadpool_limits(limits=options.blas_threads) if options.blas_threads else nullcontext()
    with pin:
        return _scan(config, options, user)


def _scan(config: ScanConfig, options: ScanOptions, user: UserPrediction) -> int:
    env = capture_environment()
    impls = resolve_impls(options.impl)
    cpus = os.cpu_count() or 1
    if options.blas_threads is not None and options.blas_threads > cpus:
        print(
            f"warning: --blas-threads {options.blas_threads} is more than the {cpus} logical CPUs here; "
            "the threads will compete for cores",
            file=sys.stderr,
        )
    if options.blas_threads is None:
        warn_if_blas_unpinned(", or pass --blas-threads N")
    skipped = [i for i in IMPLS if i not in impls] if options.impl == "all" else []
    print(setup_card(config, env, impls, skipped))
    csv, gave = options.csv, bool(user.text) or user.saturation_given
    state = ScanRun(config, impls, build_inputs(config))

    def side_files(recorder: RunRecorder) -> None:
        state.write_summary(summary_path(csv))
        atomic_write_text(markdown_path(csv), scan_live_markdown(csv.name, state, recorder.meta))

    files = {"raw_csv": str(csv), "summary_csv": str(summary_path(csv))}
    try:
        with RunRecorder(
            "batch-size-scan",
            csv,
            SAMPLE_FIELDS,
            config=asdict(config),
            environment=env,
            extra=state.meta_extra(options.blas_threads, files),
            before_save=state.before_save,
            side_files=side_files,
        ) as recorder:
            if not _measure(state, recorder, user, gave=gave):
                return 1
            outcomes = state.outcomes()
            recorder.meta.update(result_records(state, outcomes))
            recorder.finish("oracle-failed" if state.failures else "complete")
    except (KeyboardInterrupt, MemoryError) as exc:
        what = "interrupted" if isinstance(exc, KeyboardInterrupt) else "error: out of memory"
        kept = len(state.samples) + len(state.partial)
        print(f"{PROG}: {what}; {kept} samples kept in {csv}", file=sys.stderr)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    print(result_text(state, outcomes, user_gave=gave))
    written = [str(p) for p in (csv, summary_path(csv), meta_path(csv), markdown_path(csv))]
    if options.plot is not None:
        from attention_kv_caceh.report.plots import plot_scan

        tables = state.tables()
        first = next(iter(tables))
        title = plot_title(config) + ("" if len(tables) == 1 else f", {first}")
        plot_scan(tables[first], options.plot, title=title)
        written.append(str(options.plot))
    print(f"Wrote {', '.join(written)}")
    print(json.dumps(summary_json(state, outcomes, str(csv))))
    return 1 if state.failures else 0


def _measure(state: ScanRun, recorder: RunRecorder, user: UserPrediction, *, gave: bool) -> bool:
    """Run `record_scan`, printing its events: the prediction cards (when the user gave a prediction)
    and each oracle failure; a progress bar on a terminal. False when the run ended with every
    implementation's oracle failed."""
    from tqdm import tqdm

    sizes = state.config.batch_sizes
    bar = tqdm(total=len(sizes), desc="batch sizes", unit="B", delay=2.0, disable=not sys.stderr.isatty())
    with bar:  # closed before any handler of the caller prints
        for event in record_scan(state, recorder, user):
            if event.kind == "predicted" and gave:
                for impl, prediction in state.predictions.items():
                    print()
                    if len(state.impls) > 1:
                        print(f"[{impl}]")
                    print(prediction_card(prediction), flush=True)  # a pipe must show it before the timing
            elif event.kind == "batch":
                bar.update(sizes.index(event.batch_size) - bar.n)
                bar.set_postfix(B=event.batch_size)
            elif event.kind != "predicted":
                print(event_line(PROG, event), file=sys.stderr)
                if event.kind == "all-failed":
                    return False
        bar.update(len(sizes) - bar.n)
    return bool(state.predictions)
