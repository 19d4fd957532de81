"""`attention-kv-caceh` with no subcommand: the batch-size scan of decode attention (the main job).

    attention-kv-caceh --csv results/benchmark.csv          # B = 1, 2, 4, 8 at T = 128

    attention-kv-caceh --predict "saturates at B = 4" --predict-saturation 4

    attention-kv-caceh --impl all      # NumPy and the fused kernel (and torch SDPA) side by side

Prints a setup card; measures each implementation's call overhead and the read bandwidth
(`experiments.calibration`), writes one prediction per implementation (the user's and the two-term roofline's, `experiments.prediction`) to the
`.meta.json` and prints it, all before the first timed sample; then runs `experiments.scan` one batch
size at a time (at each B every implementation of --impl, `experiments.scan_impls`: oracle first, then
timing; then the probe), rewriting the raw CSV, the summary CSV and the metadata
after every B; then (`cli/scan_finish.py`) prints the table, the saturation verdicts, the predictions
against the measurement (`experiments.prediction_check`: verdicts, anomalies, the boundary paragraph)
and one JSON line. Exit codes: 0 done, 1 an oracle check failed (that implementation was not timed at
that B nor after it; the others were, and every file is complete) or out of memory, 2 bad usage
(nothing touched), 130 interrupted (every sample taken, and the predictions, are on disk).
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

from attention_kv_caceh.cli.common import (
    PROG,
    UsageError,
    check_outputs,
    check_side_files,
    int_list,
    nonnegative_int,
    output_file,
    positive_int,
    preset_name,
    warn_if_blas_unpinned,
)
from attention_kv_caceh.cli.scan_finish import finish_scan, scan_result_tables, summary_path
from attention_kv_caceh.cli.scan_output import format_scan_table, setup_card, summary_rows
from attention_kv_caceh.cli.scan_prediction import (
    add_prediction_arguments,
    predict_before_timing,
    user_prediction,
)
from attention_kv_caceh.experiments.prediction import UserPrediction, utc_now
from attention_kv_caceh.experiments.scan import (
    SAMPLE_FIELDS,
    BatchResult,
    ScanConfig,
    build_inputs,
    kv_bytes_per_step,
    run_batch,
)
from attention_kv_caceh.experiments.scan_impls import IMPL_CHOICES, IMPLS, resolve_impls
from attention_kv_caceh.experiments.scan_stats import SUMMARY_FIELDS
from attention_kv_caceh.files import ignoring_sigint, meta_path, write_csv_atomic, write_json_atomic
from attention_kv_caceh.memory import MemoryBudgetError, check_memory
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.presets import MODEL_PRESETS, resolve_shape
from attention_kv_caceh.timing import capture_environment

__all__ = [
    "HELP",
    "add_arguments",
    "format_scan_table",
    "run",
    "scan_config",
    "summary_path",
]

HELP = "batch-size scan of decode attention over a KV cache (the default command)"
_DEFAULTS = ScanConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the batch-size scan; defaults are the notes' M1 scan."""
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
    parser.add_argument(
        "--head-dim", type=positive_int, metavar="D", default=None, help="D (default: 64, or the model's)"
    )
    parser.add_argument(
        "--num-heads", type=positive_int, metavar="H", default=None, help="H (default: 1, or the model's)"
    )
    parser.add_argument(
        "--num-kv-heads",
        type=positive_int,
        metavar="H_KV",
        default=None,
        help="H_kv (default: the model's, or H)",
    )
    parser.add_argument(
        "--model",
        type=preset_name,
        default=None,
        metavar="PRESET",
        help=f"take H, H_kv and D from a real model (any case): {', '.join(sorted(MODEL_PRESETS))}; "
        "explicit flags win (default: none)",
    )
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
    add_prediction_arguments(parser)


def scan_config(args: argparse.Namespace) -> ScanConfig:
    """The validated ScanConfig of parsed flags; the shape from `presets.resolve_shape`.

    Raises UsageError when H is not a multiple of H_kv (or the config rejects a value)."""
    shape = resolve_shape(
        args.model,
        args.num_heads,
        args.num_kv_heads,
        args.head_dim,
        default_num_heads=_DEFAULTS.num_heads,
        default_head_dim=_DEFAULTS.head_dim,
    )
    if shape.num_heads % shape.num_kv_heads:
        raise UsageError(
            f"--num-heads {shape.num_heads} must be a multiple of --num-kv-heads {shape.num_kv_heads}"
        )
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


def _check_memory(config: ScanConfig, num_impls: int) -> None:
    """Refuse a scan whose arrays alone would not fit (`memory.check_memory`)."""
    b = max(config.batch_sizes)
    itemsize = 4 if config.dtype == "float32" else 8
    kv = kv_bytes_per_step(config, b)
    inputs = itemsize * b * (config.num_heads * config.head_dim) + kv  # q_t, prefix and new K/V
    # raw samples and probe samples per B, and the calibration's overhead and probe samples
    rows = config.repeats * (len(config.batch_sizes) + 1) * 2
    rows *= num_impls
    # cache, the oracle's second cache, a concatenation's new arrays, probe (the calibration's probe
    # is as large, not at once)
    needed = inputs + 4 * kv + rows * 400  # ~400 B per row
    try:
        check_memory(
            needed,
            f"this scan (B={b}, T={config.seq_len}, {config.repeats} repeats, H_kv={config.num_kv_heads}, "
            f"D={config.head_dim})",
            "--batch-sizes, --seq-len or --repeats",
        )
    except MemoryBudgetError as exc:
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Run the batch-size scan from parsed flags; writes raw CSV, summary CSV, metadata (and the plot).

    Raises UsageError (nothing touched) for a bad shape, a run too large for this machine's memory, or
    an output file (the CSV, the summary and metadata beside it, the plot) that cannot be written.
    """
    config = scan_config(args)
    _check_memory(config, len(IMPLS) if args.impl == "all" else 1)
    user = user_prediction(args, config.batch_sizes)
    csv_path: Path = args.csv
    beside = f"--csv {str(csv_path)!r}: the file beside it"
    check_outputs(
        [
            ("--csv", csv_path, (".csv",)),
            (beside, summary_path(csv_path), ()),
            (beside, meta_path(csv_path), ()),
            ("--plot", args.plot, (".png",)),
        ]
    )
    check_side_files("--csv", {summary_path(csv_path): SUMMARY_FIELDS, meta_path(csv_path): ()})

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

    def flush(status: str) -> None:
        samples = [s for r in results for s in r.samples]
        write_csv_atomic(csv_path, (asdict(s) for s in samples), SAMPLE_FIELDS)
        if "fused" in impls:
            from attention_kv_caceh.kernels import compile_seconds

            # First-call compile (or disk-cache load) of each kernel variant, kept out of every sample.
            meta["kernel_compile_seconds"] = compile_seconds()
        meta["status"] = status
        write_json_atomic(meta_path(csv_path), meta)
        # Rewritten with the raw file every time (header-only before the first B), so a summary left
        # by an earlier run never sits beside this run's raw file and metadata.
        rows = summary_rows(scan_result_tables(results)) if results else []
        write_csv_atomic(summary_path(csv_path), rows, SUMMARY_FIELDS)

    from tqdm import tqdm

    inputs = build_inputs(config)

    def time_batch(b: int) -> BatchResult:
        """Check, then time, every live implementation at batch size b (the only line that knows what
        is timed)."""
        return run_batch(config, inputs, b, tuple(alive))

    try:
        predictions = predict_before_timing(config, inputs, user, impls, meta, flush)
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
                    result = time_batch(b)
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
    except KeyboardInterrupt:
        with ignoring_sigint():  # a second Ctrl-C must not cut the save short
            flush("interrupted")
        done = sum(len(r.samples) for r in results)
        print(f"{PROG}: interrupted; {done} samples kept in {csv_path}", file=sys.stderr)
        return 130
    except MemoryError:
        with ignoring_sigint():
            flush("out-of-memory")
        done = sum(len(r.samples) for r in results)
        print(f"{PROG}: error: out of memory; {done} samples kept in {csv_path}", file=sys.stderr)
        return 1
    return finish_scan(config, args.plot, csv_path, results, predictions, meta, flush)
