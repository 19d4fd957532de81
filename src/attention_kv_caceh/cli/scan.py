"""`attention-kv-caceh` with no subcommand: the batch-size scan of decode attention (the main job).

    attention-kv-caceh --csv results/benchmark.csv          # B = 1, 2, 4, 8 at T = 128

    attention-kv-caceh --predict "saturates at B = 4" --predict-saturation 4

    attention-kv-caceh --impl all      # NumPy and the fused kernel (and torch SDPA) side by side

Flags (`ScanConfig`, `ShapeOptions`, `scan_run.ScanOptions`) -> config -> `scan_run.record_scan` into
a `RunRecorder` (predictions on disk before the first timed sample; every file rewritten after each B)
-> print (`report.scan_text`). Before anything is timed, the CPUs other processes keep busy are measured
for 0.25 s (`measure_load`: `others_busy_cpus` in the metadata's environment; one warning on stderr
from 0.5 CPUs up). Exit codes: 0 done, 1 an oracle check failed (that implementation was
not timed from there on; every file is complete) or out of memory, 2 bad usage (nothing touched), 130
interrupted (every sample taken, and the predictions, are on disk).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import nullcontext
from typing import Any

from attention_kv_caceh.cli.common import PROG, check_memory, check_raw_outputs, warn_if_blas_unpinned
from attention_kv_caceh.cli.flags import add_shaped_options, config_from_args, shaped_config, usage_error
from attention_kv_caceh.experiments.prediction import UserPrediction
from attention_kv_caceh.experiments.scan import ScanConfig, build_inputs, estimate_scan_bytes
from attention_kv_caceh.experiments.scan_impls import IMPLS, resolve_impls
from attention_kv_caceh.experiments.scan_run import ScanOptions, ScanRun, record_scan
from attention_kv_caceh.experiments.scan_stats import SUMMARY_FIELDS
from attention_kv_caceh.files import atomic_write_text, markdown_path, meta_path
from attention_kv_caceh.options import ConfigError
from attention_kv_caceh.recorder import RunRecorder
from attention_kv_caceh.report.scan_text import (
    event_line,
    load_warning,
    plot_title,
    prediction_cards,
    result_records,
    result_text,
    scan_live_markdown,
    setup_card,
    summary_json,
    threads_warning,
)
from attention_kv_caceh.timing import capture_environment

__all__ = ["HELP", "add_arguments", "run", "scan_config", "setup_card"]

HELP = "batch-size scan of decode attention over a KV cache (the default command)"
_DEFAULTS = ScanConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the batch-size scan: the fields of ScanOptions, ScanConfig and ShapeOptions."""
    d = _DEFAULTS
    add_shaped_options(parser, ScanConfig, ScanOptions, ("batch_sizes", "seq_len"), d.num_heads, d.head_dim)


def scan_config(args: argparse.Namespace) -> ScanConfig:
    """The validated ScanConfig of parsed flags (`flags.shaped_config`). Raises UsageError naming the
    flag for a value the config rejects."""
    return shaped_config(ScanConfig, args, _DEFAULTS.num_heads, _DEFAULTS.head_dim)


def run(args: argparse.Namespace) -> int:
    """Run the batch-size scan from parsed flags; writes raw CSV, summary CSV, metadata (and the plot).

    Raises UsageError (nothing touched) for a bad shape, a run too large for this machine's memory, or
    an output file (the CSV, the summary and metadata beside it, the plot) that cannot be written, and
    for a `<stem>.md` beside the CSV that no lab command wrote (`common.check_raw_outputs`).
    """
    config, options = scan_config(args), config_from_args(ScanOptions, args)
    try:
        user = options.user_prediction(config.batch_sizes)
    except ConfigError as exc:
        raise usage_error(ScanOptions, exc) from None
    check_memory(
        estimate_scan_bytes(config, len(IMPLS) if options.impl == "all" else 1),
        f"this scan (B={max(config.batch_sizes)}, T={config.seq_len}, {config.repeats} repeats, "
        f"H_kv={config.num_kv_heads}, D={config.head_dim})",
        "--batch-sizes, --seq-len or --repeats",
    )
    check_raw_outputs(
        options.csv,
        {options.summary_csv: SUMMARY_FIELDS, meta_path(options.csv): ()},
        ("--plot", options.plot, (".png",)),
    )

    from threadpoolctl import threadpool_limits  # pyright: ignore[reportMissingTypeStubs]

    pin = threadpool_limits(limits=options.blas_threads) if options.blas_threads else nullcontext()
    with pin:
        return _scan(config, options, user)


def measure_load(env: dict[str, Any]) -> None:
    """Before timing: the CPUs other processes keep busy (`cpu_load.measure_others_busy`, 0.25 s on
    this process's CPU set) into `env` (`others_busy_cpus`, None where /proc/stat cannot be read;
    `others_busy_window_s`), and one warning on stderr from `cpu_load.LOAD_WARNING_CPUS` (0.5) up."""
    from attention_kv_caceh import cpu_load
    from attention_kv_caceh.cpus import usable_cpus

    others = cpu_load.measure_others_busy(usable_cpus().ids)
    env["others_busy_cpus"] = None if others is None else round(others, 3)
    env["others_busy_window_s"] = cpu_load.START_WINDOW_S
    if (warning := load_warning(others, cpu_load.START_WINDOW_S)) is not None:
        print(warning, file=sys.stderr)


def _scan(config: ScanConfig, options: ScanOptions, user: UserPrediction) -> int:
    env = capture_environment()
    measure_load(env)
    impls = resolve_impls(options.impl)
    if (warning := threads_warning(options.blas_threads, os.cpu_count() or 1)) is not None:
        print(warning, file=sys.stderr)
    if options.blas_threads is None:
        warn_if_blas_unpinned(", or pass --blas-threads N")
    skipped = [i for i in IMPLS if i not in impls] if options.impl == "all" else []
    print(setup_card(config, env, impls, skipped))
    csv, gave = options.csv, bool(user.text) or user.saturation_given
    state = ScanRun(config, impls, build_inputs(config))

    def side_files(recorder: RunRecorder) -> None:
        state.write_summary(options.summary_csv)
        atomic_write_text(markdown_path(csv), scan_live_markdown(csv.name, state, recorder.meta))

    try:
        with state.recorder(options, env, side_files) as recorder:
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
    written = [str(p) for p in (csv, options.summary_csv, meta_path(csv), markdown_path(csv))]
    if options.plot is not None:
        from attention_kv_caceh.report.plots import plot_scan

        tables = state.tables()
        first = next(iter(tables))
        plot_scan(tables[first], options.plot, title=plot_title(config, first if len(tables) > 1 else ""))
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
                print(prediction_cards(state), flush=True)  # a pipe must show them before the timing
            elif event.kind == "batch":
                bar.update(sizes.index(event.batch_size) - bar.n)
                bar.set_postfix(B=event.batch_size)
            elif event.kind != "predicted":
                print(event_line(PROG, event), file=sys.stderr)
                if event.kind == "all-failed":
                    return False
        bar.update(len(sizes) - bar.n)
    return bool(state.predictions)
