"""`attention-kv-caceh` with no subcommand: the batch-size scan of decode attention (the main job).

    attention-kv-caceh --csv results/benchmark.csv          # B = 1, 2, 4, 8 at T = 128

    attention-kv-caceh --predict "saturates at B = 4" --predict-saturation 4

    attention-kv-caceh --impl all      # NumPy and the fused kernel (and torch SDPA) side by side

Prints a setup card; measures each implementation's call overhead and the read bandwidth
(`experiments.calibration`) and writes one prediction per implementation (the user's and the two-term
roofline's, `experiments.prediction`) to the `.meta.json`, all before the first timed sample (the
prediction card is printed when the user gave a prediction); then runs `experiments.scan` one batch size
at a time (at each B every implementation of --impl, `experiments.scan_impls`: oracle first, then
timing; then the probe), rewriting the raw CSV, the summary CSV, the metadata and `<stem>.md` (the
run's Markdown, the section `report` renders from the raw file) after every B; then prints the table,
the saturation verdicts, the predictions against the measurement and one JSON line. Exit codes: 0 done, 1
an oracle check failed (that implementation was not timed at that B nor after it; the others were,
and every file is complete) or out of memory, 2 bad usage (nothing touched), 130 interrupted (every
sample taken, and the predictions, are on disk).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

from attention_kv_caceh.cli.common import (
    PROG,
    UsageError,
    add_shape_arguments,
    check_markdown_file,
    check_outputs,
    check_side_files,
    int_list,
    nonnegative_int,
    output_file,
    positive_int,
    shape_from_args,
    warn_if_blas_unpinned,
)
from attention_kv_caceh.experiments.calibration import calibrate
from attention_kv_caceh.experiments.prediction import (
    ScanOutcome,
    ScanPrediction,
    UserPrediction,
    anomaly_lines,
    check_user_prediction,
    evaluate_scan,
    make_scan_prediction,
    outcome_json,
    outcome_text,
    parse_saturation,
    prediction_card,
    utc_now,
    verdict_lines,
)
from attention_kv_caceh.experiments.scan import (
    SAMPLE_FIELDS,
    BatchInterrupted,
    BatchResult,
    ScanConfig,
    ScanInputs,
    build_inputs,
    estimate_scan_bytes,
    kv_bytes_per_step,
    run_batch,
)
from attention_kv_caceh.experiments.scan_impls import IMPL_CHOICES, IMPLS, resolve_impls
from attention_kv_caceh.experiments.scan_stats import (
    SUMMARY_FIELDS,
    format_scan_table,
    saturation_verdict,
    scan_tables,
    summary_rows,
)
from attention_kv_caceh.files import (
    atomic_write_text,
    ignoring_sigint,
    markdown_path,
    meta_path,
    write_csv_atomic,
    write_json_atomic,
)
from attention_kv_caceh.memory import MemoryBudgetError, check_memory
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.presets import get_preset
from attention_kv_caceh.timing import Sample, capture_environment

__all__ = [
    "HELP",
    "add_arguments",
    "run",
    "scan_config",
    "setup_card",
    "summary_path",
]

HELP = "batch-size scan of decode attention over a KV cache (the default command)"
_DEFAULTS = ScanConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the batch-size scan; defaults from `ScanConfig`."""
    d = _DEFAULTS
    parser.add_argument(
        "--csv",
        type=output_file(".csv"),
        default=Path("results/benchmark.csv"),
        metavar="PATH.csv",
        help="raw samples CSV",
    )
    parser.add_argument(
        "--batch-sizes",
        type=int_list,
        default=",".join(str(b) for b in d.batch_sizes),
        metavar="B,B,...",
        help="batch sizes to scan",
    )
    parser.add_argument(
        "--seq-len",
        type=positive_int,
        metavar="T",
        default=d.seq_len,
        help="cached positions T before the step",
    )
    add_shape_arguments(parser, d)
    parser.add_argument("--dtype", choices=("float32", "float64"), default=d.dtype, help="element type")
    parser.add_argument(
        "--cache",
        choices=("dynamic", "preallocated"),
        default=d.cache,
        help="dynamic: np.concatenate each step; preallocated: one buffer, write a slice",
    )
    parser.add_argument(
        "--warmup", type=nonnegative_int, metavar="N", default=d.warmup, help="unrecorded calls before timing"
    )
    parser.add_argument(
        "--repeats", type=positive_int, metavar="N", default=d.repeats, help="timed calls per batch size"
    )
    parser.add_argument(
        "--seed", type=nonnegative_int, default=d.seed, help="seed of np.random.default_rng for all inputs"
    )
    parser.add_argument(
        "--blas-threads",
        type=positive_int,
        metavar="N",
        default=None,
        help="pin BLAS threads with threadpoolctl for this run (default: not pinned)",
    )
    parser.add_argument(
        "--plot",
        type=output_file(".png"),
        default=None,
        metavar="PATH.png",
        help="PNG: P50 with P95 bars, positions/s vs B (default: no plot)",
    )
    parser.add_argument(
        "--impl",
        choices=IMPL_CHOICES,
        default="numpy",
        help="decode step to time: numpy (attention.multihead_decode_step), fused (the Numba kernel, one "
        "thread), or all: both, plus torch-sdpa (one thread) where torch can be imported, each checked "
        "and timed at every B in turn, side by side against the same probe",
    )
    parser.add_argument(
        "--predict",
        default="",
        metavar="TEXT",
        help="your prediction in words, recorded with a timestamp before the first timed sample and shown "
        "beside the verdicts (not checked: it is prose) (default: none)",
    )
    parser.add_argument(
        "--predict-saturation",
        type=_saturation_flag,
        default=None,
        metavar="B|none",
        help="your predicted saturation point: a scanned B other than the largest, or 'none' for not "
        "reached; checked against the measured one (default: not given)",
    )


def _saturation_flag(text: str) -> str:
    """argparse `type=` of --predict-saturation: a batch size >= 1 or 'none' (`parse_saturation`); the
    text itself is returned, so that None still means "not given"."""
    try:
        parse_saturation(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def scan_config(args: argparse.Namespace) -> ScanConfig:
    """The validated ScanConfig of parsed flags. Raises UsageError for a value the config rejects."""
    shape = shape_from_args(args, _DEFAULTS)
    try:
        return ScanConfig(
            batch_sizes=tuple(args.batch_sizes),
            seq_len=args.seq_len,
            head_dim=shape.head_dim,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            dtype=args.dtype,
            cache=args.cache,
            model=shape.model,
            warmup=args.warmup,
            repeats=args.repeats,
            seed=args.seed,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _user_prediction(args: argparse.Namespace, batch_sizes: Sequence[int]) -> UserPrediction:
    """--predict and --predict-saturation; UsageError for a saturation no scan of `batch_sizes` could
    measure (`check_user_prediction`)."""
    given = args.predict_saturation is not None
    user = UserPrediction(
        text=args.predict,
        saturation_given=given,
        saturation=parse_saturation(args.predict_saturation) if given else None,
    )
    try:
        check_user_prediction(user, batch_sizes)
    except ValueError as exc:
        raise UsageError(f"--predict-saturation: {exc}") from None
    return user


def _check_memory(config: ScanConfig, num_impls: int) -> None:
    """Refuse a scan whose arrays alone would not fit (`memory.check_memory`)."""
    try:
        check_memory(
            estimate_scan_bytes(config, num_impls),
            f"this scan (B={max(config.batch_sizes)}, T={config.seq_len}, {config.repeats} repeats, "
            f"H_kv={config.num_kv_heads}, D={config.head_dim})",
            "--batch-sizes, --seq-len or --repeats",
        )
    except MemoryBudgetError as exc:
        raise UsageError(str(exc)) from None


def summary_path(csv_path: Path) -> Path:
    """`results/benchmark.csv` -> `results/benchmark-summary.csv`."""
    return csv_path.with_name(f"{csv_path.stem}-summary.csv")


def run(args: argparse.Namespace) -> int:
    """Run the batch-size scan from parsed flags; writes raw CSV, summary CSV, metadata (and the plot).

    Raises UsageError (nothing touched) for a bad shape, a run too large for this machine's memory, or
    an output file (the CSV, the summary and metadata beside it, the plot) that cannot be written, and
    for a `<stem>.md` beside the CSV that no lab command wrote (`common.check_markdown_file`).
    """
    config = scan_config(args)
    _check_memory(config, len(IMPLS) if args.impl == "all" else 1)
    user = _user_prediction(args, config.batch_sizes)
    csv_path: Path = args.csv
    beside = f"--csv {str(csv_path)!r}: the file beside it"
    check_outputs(
        [
            ("--csv", csv_path, (".csv",)),
            (beside, summary_path(csv_path), ()),
            (beside, meta_path(csv_path), ()),
            (beside, markdown_path(csv_path), ()),
            ("--plot", args.plot, (".png",)),
        ]
    )
    check_side_files("--csv", {summary_path(csv_path): SUMMARY_FIELDS, meta_path(csv_path): ()})
    check_markdown_file("--csv", csv_path)

    from threadpoolctl import threadpool_limits  # pyright: ignore[reportMissingTypeStubs]

    pin = threadpool_limits(limits=args.blas_threads) if args.blas_threads else nullcontext()
    with pin:
        return _scan(config, args, csv_path, user)


def _scan(config: ScanConfig, args: argparse.Namespace, csv_path: Path, user: UserPrediction) -> int:
    env = capture_environment()
    impls = resolve_impls(args.impl)
    cpus = os.cpu_count() or 1
    if args.blas_threads is not None and args.blas_threads > cpus:
        print(
            f"warning: --blas-threads {args.blas_threads} is more than the {cpus} logical CPUs here; "
            "the threads will compete for cores",
            file=sys.stderr,
        )
    if args.blas_threads is None:
        warn_if_blas_unpinned(", or pass --blas-threads N")
    skipped = [i for i in IMPLS if i not in impls] if args.impl == "all" else []
    print(setup_card(config, env, impls, skipped))
    meta: dict[str, Any] = {
        "kind": "batch-size-scan",
        "status": "running",
        "config": asdict(config),
        "impls": list(impls),
        "environment": env,
        "blas_threads_flag": args.blas_threads,
        "probe": "np.dot(buf, buf) over a buffer of kv_bytes_per_step bytes (BLAS dot: one read stream)",
        "probe_samples_ms": {},
        "kv_bytes_per_step": {},
        "oracle_max_abs_error": {},
        "oracle_max_abs_error_by_impl": {},
        "files": {"raw_csv": str(csv_path), "summary_csv": str(summary_path(csv_path))},
    }
    results: list[BatchResult] = []
    alive = list(impls)  # an implementation whose oracle fails is not timed again
    partial: list[Sample] = []  # the samples of a B cut short by Ctrl-C: raw rows, not summarised

    def flush(status: str) -> None:
        samples = [s for r in results for s in r.samples]
        write_csv_atomic(csv_path, (asdict(s) for s in [*samples, *partial]), SAMPLE_FIELDS)
        if "fused" in impls:
            from attention_kv_caceh.kernels import compile_seconds

            # First-call compile (or disk-cache load) of each kernel variant, kept out of every sample.
            meta["kernel_compile_seconds"] = compile_seconds()
        meta["status"] = status
        write_json_atomic(meta_path(csv_path), meta)
        # Rewritten with the raw file every time (header-only before the first B), so a summary left
        # by an earlier run never sits beside this run's raw file and metadata.
        rows = summary_rows(_tables(results)) if results else []
        write_csv_atomic(summary_path(csv_path), rows, SUMMARY_FIELDS)
        atomic_write_text(markdown_path(csv_path), _markdown(csv_path.name, samples, meta, len(partial)))

    from tqdm import tqdm

    inputs = build_inputs(config)
    try:
        predictions = _predict_before_timing(config, inputs, user, impls, meta, flush)
        if predictions is None:
            return 1
        alive[:] = [i for i in alive if i in predictions]
        meta["timing_started_utc"] = utc_now()
        bar = tqdm(
            config.batch_sizes, desc="batch sizes", unit="B", delay=2.0, disable=not sys.stderr.isatty()
        )
        with bar as progress:  # closed before any handler below prints
            for b in progress:
                progress.set_postfix(B=b)
                try:
                    result = run_batch(config, inputs, b, tuple(alive))  # check, then time, at B = b
                except OracleMismatch as exc:
                    flush("oracle-failed")
                    print(
                        f"{PROG}: oracle check failed at B={b}, nothing timed for it: {exc}", file=sys.stderr
                    )
                    return 1
                for impl, message in result.oracle_failures:
                    alive.remove(impl)
                    meta.setdefault("oracle_failures", {})[impl] = f"B={b}: {message}"
                    print(
                        f"{PROG}: oracle check failed for {impl} at B={b}, nothing timed for it from here "
                        f"on: {message}",
                        file=sys.stderr,
                    )
                results.append(result)
                meta["probe_samples_ms"][str(b)] = list(result.probe_samples_ms)
                meta["kv_bytes_per_step"][str(b)] = result.kv_bytes_per_step
                meta["oracle_max_abs_error"][str(b)] = result.oracle_max_abs_error
                for impl, err in result.oracle_errors:
                    meta["oracle_max_abs_error_by_impl"].setdefault(impl, {})[str(b)] = err
                flush("running")
    except (KeyboardInterrupt, MemoryError) as exc:
        interrupted = isinstance(exc, KeyboardInterrupt)
        if isinstance(exc, BatchInterrupted) and exc.samples:
            partial[:] = exc.samples
            meta["incomplete_batch"] = {"batch_size": exc.samples[0].batch_size, "samples": len(partial)}
        with ignoring_sigint():  # a second Ctrl-C must not cut the save short
            flush("interrupted" if interrupted else "out-of-memory")
        done = sum(len(r.samples) for r in results) + len(partial)
        what = "interrupted" if interrupted else "error: out of memory"
        print(f"{PROG}: {what}; {done} samples kept in {csv_path}", file=sys.stderr)
        return 130 if interrupted else 1
    return _finish(config, args.plot, csv_path, results, predictions, meta, flush, user_gave=_gave(user))


def _gave(user: UserPrediction) -> bool:
    return bool(user.text) or user.saturation_given


def _predict_before_timing(
    config: ScanConfig,
    inputs: ScanInputs,
    user: UserPrediction,
    impls: Sequence[str],
    meta: dict[str, Any],
    flush: Callable[[str], None],
) -> dict[str, ScanPrediction] | None:
    """Calibrate each implementation, then write its prediction to the metadata on disk (and print its
    card when the user gave a prediction), before any B is timed. Returns impl -> prediction.

    Every implementation's calibration times its own step at B = 1, T = 1; all share the first one's
    read probe. An implementation whose calibration oracle fails is left out (one line on stderr,
    `oracle_failures` in the metadata) and never timed. Returns None after saving `status:
    oracle-failed` when every one failed. The metadata gets `predictions` (impl -> record) and
    `prediction`: the first implementation's.
    """
    predictions: dict[str, ScanPrediction] = {}
    probe: tuple[float, ...] | None = None
    for impl in impls:
        try:
            calibration = calibrate(config, inputs, impl, probe)
        except OracleMismatch as exc:
            meta.setdefault("oracle_failures", {})[impl] = f"calibration (B=1, T=1): {exc}"
            print(
                f"{PROG}: oracle check failed in the calibration of {impl} (B=1, T=1), nothing timed "
                f"for it: {exc}",
                file=sys.stderr,
            )
            continue
        probe = calibration.probe_samples_ms
        predictions[impl] = make_scan_prediction(config, calibration, user)
    if not predictions:
        flush("oracle-failed")
        return None
    meta["prediction"] = next(iter(predictions.values())).to_json()
    meta["predictions"] = {impl: p.to_json() for impl, p in predictions.items()}
    flush("running")  # on disk before the first timed sample
    if _gave(user):
        for impl, prediction in predictions.items():
            print()
            if len(impls) > 1:
                print(f"[{impl}]")
            print(prediction_card(prediction), flush=True)  # flushed: a pipe must show it before the timing
    return predictions


def _finish(
    config: ScanConfig,
    plot: Path | None,
    csv_path: Path,
    results: Sequence[BatchResult],
    predictions: dict[str, ScanPrediction],
    meta: dict[str, Any],
    flush: Callable[[str], None],
    *,
    user_gave: bool,
) -> int:
    """After the last B: the verdicts and the prediction check per implementation, the files' last
    state ("complete", or "oracle-failed"), the table, the plot and one JSON line. Returns 1 when an
    implementation failed its oracle, else 0.

    The prediction's full table and boundary paragraph are printed when the user gave a prediction;
    otherwise the model's verdicts only, one line each (and the anomalies, when there are some)."""
    tables = _tables(results)
    several = len(tables) > 1
    verdicts = {impl: saturation_verdict(t) for impl, t in tables.items()}
    samples = [s for r in results for s in r.samples]
    outcomes = {
        impl: evaluate_scan(predictions[impl], [s for s in samples if s.impl == impl])
        for impl in tables
        if impl in predictions
    }
    first = next(iter(tables))
    meta["saturation"] = verdicts[first]
    meta["saturation_by_impl"] = verdicts
    records = {
        impl: outcome_json(o.verdicts, o.anomalies) | {"measured_saturation": o.measured_saturation}
        for impl, o in outcomes.items()
    }
    meta["prediction_outcome"] = records[first]
    meta["prediction_outcomes"] = records
    failed = meta.get("oracle_failures", {})
    flush("oracle-failed" if failed else "complete")
    print()
    print(format_scan_table(tables))
    print()
    for impl, verdict in verdicts.items():
        print(f"Saturation{f' ({impl})' if several else ''}: {verdict}")
    for impl, outcome in outcomes.items():
        print()
        print(_outcome_lines(outcome, f" ({impl})" if several else "", full=user_gave))
    print()
    passed = [impl for impl in tables if impl not in failed]
    if passed:
        worst = max(
            (e for r in results for impl, e in r.oracle_errors if impl in passed),
            default=max(r.oracle_max_abs_error for r in results),
        )
        print(
            f"Oracle: every B of {', '.join(passed)} matched the float64 per-sequence reference "
            f"(max |error| {worst:.2e})"
        )
    for impl in failed:
        print(f"Oracle FAILED for {impl}: {failed[impl]}")
    written = [
        str(csv_path),
        str(summary_path(csv_path)),
        str(meta_path(csv_path)),
        str(markdown_path(csv_path)),
    ]
    if plot is not None:
        from attention_kv_caceh.report.plots import plot_scan

        plot_scan(tables[first], plot, title=_plot_title(config) + ("" if not several else f", {first}"))
        written.append(str(plot))
    print(f"Wrote {', '.join(written)}")
    summary = {
        "raw_csv": str(csv_path),
        "rows": len(samples),
        "saturation": verdicts[first],
        "p50_ms": {int(r["batch_size"]): round(r["p50_ms"], 6) for r in tables[first]},
        "predictions": {v.name: v.held for v in outcomes[first].verdicts} if first in outcomes else {},
        "impls": {
            impl: {
                "p50_ms": {int(r["batch_size"]): round(r["p50_ms"], 6) for r in t},
                "bandwidth_ratio": {int(r["batch_size"]): round(r["bandwidth_ratio"], 4) for r in t},
                "saturation": verdicts[impl],
            }
            for impl, t in tables.items()
        },
        "oracle_failures": sorted(failed),
    }
    print(json.dumps(summary))
    return 1 if failed else 0


def _outcome_lines(outcome: ScanOutcome, impl: str, *, full: bool) -> str:
    """The prediction against the measurement: `outcome_text` in full, or the model's verdicts only."""
    if full:
        return (f"[{impl.strip(' ()')}]\n" if impl else "") + outcome_text(outcome)
    c = outcome.prediction.calibration
    lines = [
        f"Model{impl}: P50(B) = {c.overhead_ms:.4f} ms call overhead + bytes moved / {c.bandwidth_gb_s:.2f} GB/s "
        "read probe, written before the first timed sample",
        *verdict_lines(outcome, indent="  "),
    ]
    if outcome.anomalies:
        lines += ["  anomalies: " + outcome.anomaly_note, *("    " + a for a in anomaly_lines(outcome))]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- text of the scan


def _markdown(name: str, samples: list[Sample], meta: dict[str, Any], partial: int = 0) -> str:
    """The run's Markdown (`report.predictions.scan_run_markdown`, as `report` renders it from the raw
    file), with its status; a line saying so before the first B has finished. `partial` samples of a
    B cut short by Ctrl-C are in the raw file but not in the tables (the status line says so)."""
    status = f"Status: {meta['status']}.\n\n"
    if partial:
        b = meta["incomplete_batch"]["batch_size"]
        status = (
            f"Status: {meta['status']}; B = {b} incomplete: its {partial} samples are in the raw CSV, "
            "not in this summary or the verdicts.\n\n"
        )
    if not samples:
        return f"### Batch-size scan: `{name}`\n\n{status}No batch size has finished.\n"
    from attention_kv_caceh.report.predictions import scan_run_markdown

    text, _ = scan_run_markdown(name, samples, meta, [])
    return text.replace("\n\n", f"\n\n{status}", 1)


def _tables(results: Sequence[BatchResult]) -> dict[str, list[dict[str, float]]]:
    """`scan_stats.scan_tables` of every finished B: impl -> rows, against each B's probe."""
    return scan_tables(
        [s for r in results for s in r.samples],
        {r.batch_size: r.probe_samples_ms for r in results},
        {r.batch_size: r.kv_bytes_per_step for r in results},
    )


def setup_card(
    config: ScanConfig, env: dict[str, Any], impls: Sequence[str] = ("numpy",), skipped: Sequence[str] = ()
) -> str:
    """The setup printed before a scan; `skipped`: implementations of --impl all that are not run
    (torch-sdpa where torch cannot be imported), each on a line of its own."""
    one_thread = [i for i in impls if i != "numpy"]
    itemsize = 4 if config.dtype == "float32" else 8
    pools: list[dict[str, Any]] = env["blas"]
    blas = ", ".join(f"{p['internal_api']} {p['version']} ({p['num_threads']} threads)" for p in pools)
    lines = [
        "Batch-size scan: one decode step = append 1 position to the KV cache, attend over T+1",
        f"  shape    B in {list(config.batch_sizes)}, H={config.num_heads}, H_kv={config.num_kv_heads}, "
        f"T={config.seq_len}, D={config.head_dim}, {config.dtype}, {config.cache} cache"
        + (f", model {config.model} (one layer)" if config.model else ""),
        f"  timing   {config.warmup} warm-up + {config.repeats} timed calls per B, seed {config.seed}",
    ]
    if len(impls) > 1 or impls[0] != "numpy":
        lines.append(
            f"  impls    {', '.join(impls)}, checked then timed at every B in this order"
            + (f"; {', '.join(one_thread)}: 1 thread" if one_thread else "")
        )
    lines += [f"  {impl}: skipped (torch not importable)" for impl in skipped]
    lines += [
        f"  BLAS     {blas or 'none found'}",
        f"  CPU      {env['cpu_model']} ({env['cpu_count']} logical CPUs)",
        f"  KV read  {kv_bytes_per_step(config, 1) / 1e6:.3f} MB per step per sequence "
        f"(2 x H_kv x (T+1) x D x {itemsize} B)",
    ]
    if config.model:
        preset = get_preset(config.model)
        per_token = preset.kv_bytes_per_token(config.dtype)
        lines.append(
            f"  model    {config.model}: {preset.num_layers} layers, KV cache {per_token / 1024:.0f} KiB "
            f"per token in {config.dtype}, {per_token * config.seq_len / 2**20:.1f} MiB per sequence at T="
            f"{config.seq_len}"
        )
    return "\n".join(lines)


def _plot_title(config: ScanConfig) -> str:
    return (
        f"decode step, T={config.seq_len}, H={config.num_heads}, H_kv={config.num_kv_heads}, "
        f"D={config.head_dim}, {config.dtype}, {config.cache} cache"
    )
