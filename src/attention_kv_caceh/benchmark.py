"""The `attention-kv-caceh` command. With no subcommand it runs the batch-size scan (the main job).

    attention-kv-caceh --csv results/benchmark.csv          # batch-size scan, B = 1, 2, 4, 8 at T = 128
    attention-kv-caceh SUBCOMMAND --help                    # the other experiments

The CLI is the only part that prints. Exit codes: 0 done, 1 an oracle check failed (nothing was timed
for that B), 2 bad usage (one line on stderr, no traceback, no file touched), 130 interrupted (every
sample already taken is on disk).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from attention_kv_caceh.experiments.scan import (
    SAMPLE_FIELDS,
    SUMMARY_FIELDS,
    BatchResult,
    ScanConfig,
    build_inputs,
    kv_bytes_per_step,
    run_batch,
    saturation_verdict,
    scan_table,
)
from attention_kv_caceh.files import (
    check_output_path,
    ignoring_sigint,
    meta_path,
    write_csv_atomic,
    write_json_atomic,
)
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.presets import MODEL_PRESETS, get_preset
from attention_kv_caceh.timing import (
    Sample,
    blas_threads_pinned,
    capture_environment,
    memory_limit_bytes,
)

__all__ = ["Sample", "main", "measure", "summarize_samples"]

from attention_kv_caceh.timing import measure, summarize_samples  # re-exported: the notes' names

PROG = "attention-kv-caceh"


class UsageError(Exception):
    """Bad command-line input: reported as one line and exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line (no usage block) so a usage error reads like any other."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


# Subcommands: name -> (help, add_arguments, run). The default (no name) is the scan.
Subcommand = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _subcommands() -> dict[str, Subcommand]:
    from attention_kv_caceh.experiments.cli import SUBCOMMANDS as EXPERIMENTS
    from attention_kv_caceh.harness import cli as harness_cli

    return {
        **{name: (help_text, add, run) for name, (add, run, help_text) in EXPERIMENTS.items()},
        "harness": (
            "streaming serving harness: TTFT, ITL, TPOT, E2EL per request (simulated or OpenAI-compatible)",
            harness_cli.add_arguments,
            harness_cli.run,
        ),
    }


def _positive_int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.replace(" ", "").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_scan_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the batch-size scan; defaults are the notes' M1 scan."""
    parser.add_argument(
        "--csv", type=Path, default=Path("results/benchmark.csv"), metavar="PATH", help="raw samples CSV"
    )
    parser.add_argument(
        "--batch-sizes",
        type=_positive_int_list,
        default="1,2,4,8",
        metavar="B,B,...",
        help="batch sizes to scan",
    )
    parser.add_argument(
        "--seq-len", type=int, metavar="T", default=128, help="cached positions T before the step"
    )
    parser.add_argument(
        "--head-dim", type=int, metavar="D", default=None, help="D (default: 64, or the model's)"
    )
    parser.add_argument(
        "--num-heads", type=int, metavar="H", default=None, help="H (default: 1, or the model's)"
    )
    parser.add_argument(
        "--num-kv-heads",
        type=int,
        metavar="H_KV",
        default=None,
        help="H_kv (default: num heads, or the model's)",
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODEL_PRESETS),
        default=None,
        metavar="PRESET",
        help=f"take H, H_kv and D from a real model: {', '.join(sorted(MODEL_PRESETS))}",
    )
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="element type")
    parser.add_argument(
        "--cache",
        choices=("dynamic", "preallocated"),
        default="dynamic",
        help="dynamic: np.concatenate each step; preallocated: one buffer, write a slice",
    )
    parser.add_argument("--warmup", type=int, metavar="N", default=3, help="unrecorded calls before timing")
    parser.add_argument("--repeats", type=int, metavar="N", default=30, help="timed calls per batch size")
    parser.add_argument("--seed", type=int, default=42, help="seed of np.random.default_rng for all inputs")
    parser.add_argument(
        "--blas-threads",
        type=int,
        metavar="N",
        default=None,
        help="pin BLAS threads with threadpoolctl for this run",
    )
    parser.add_argument(
        "--plot", type=Path, default=None, metavar="PATH.png", help="PNG: P50 with P95 bars, positions/s vs B"
    )


def _scan_config(args: argparse.Namespace) -> ScanConfig:
    preset = get_preset(args.model) if args.model else None
    num_heads = args.num_heads if args.num_heads is not None else (preset.num_heads if preset else 1)
    head_dim = args.head_dim if args.head_dim is not None else (preset.head_dim if preset else 64)
    if args.num_kv_heads is not None:
        num_kv_heads = args.num_kv_heads
    elif preset and args.num_heads is None:
        num_kv_heads = preset.num_kv_heads
    else:
        num_kv_heads = num_heads
    return ScanConfig(
        batch_sizes=tuple(args.batch_sizes),
        seq_len=args.seq_len,
        head_dim=head_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        dtype=args.dtype,
        cache=args.cache,
        model=args.model or "",
        warmup=args.warmup,
        repeats=args.repeats,
        seed=args.seed,
    )


def name_flags(message: str, fields: Iterable[str]) -> str:
    """A config's error message with each of its field names (`seq_len`) replaced by the kebab-case flag
    that sets it (`--seq-len`), so a CLI user reads the name they typed."""
    names = sorted(fields, key=len, reverse=True)
    pattern = r"\b(" + "|".join(re.escape(n) for n in names) + r")\b"
    return re.sub(pattern, lambda m: "--" + m.group(1).replace("_", "-"), message)


def warn_if_blas_unpinned(hint: str = "") -> None:
    """Print a warning on stderr when no BLAS/OpenMP thread count was fixed before the process began."""
    if not blas_threads_pinned():
        print(
            "warning: BLAS threads were not pinned before start (set OPENBLAS_NUM_THREADS=1 "
            f"OMP_NUM_THREADS=1{hint}); timings may vary with thread count",
            file=sys.stderr,
        )


def _check_memory(config: ScanConfig) -> None:
    """Refuse a scan whose arrays alone would not fit in this machine's memory."""
    b = max(config.batch_sizes)
    itemsize = np.dtype(config.dtype).itemsize
    kv = kv_bytes_per_step(config, b)
    inputs = itemsize * b * (config.num_heads * config.head_dim) + kv  # q_t, prefix and new K/V
    rows = config.repeats * len(config.batch_sizes) * 2  # raw samples and probe samples
    needed = inputs + 3 * kv + rows * 400  # cache, a concatenation's new arrays, probe; ~400 B per row
    total = memory_limit_bytes()
    if total is not None and needed > 0.8 * total:
        raise UsageError(
            f"this scan needs about {needed / 2**30:.1f} GiB for B={b}, T={config.seq_len}, "
            f"{config.repeats} repeats, "
            f"H_kv={config.num_kv_heads}, D={config.head_dim}, more than 80 % of the "
            f"{total / 2**30:.1f} GiB this process may use; lower --batch-sizes, --seq-len or --repeats"
        )


def summary_path(csv_path: Path) -> Path:
    """`results/benchmark.csv` -> `results/benchmark-summary.csv`."""
    return csv_path.with_name(f"{csv_path.stem}-summary.csv")


def _fmt(value: float, digits: int = 3) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.{digits}f}"


def format_scan_table(table: Sequence[dict[str, float]]) -> str:
    """Fixed-width text table of `scan_table` rows."""
    header = (
        f"{'B':>4} {'P50 ms':>9} {'P95 ms':>9} {'min ms':>9} {'max ms':>9} {'ms/seq':>9} "
        f"{'positions/s':>13} {'speedup':>8} {'KV GB/s':>8} {'probe GB/s':>10} {'ratio':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in table:
        lines.append(
            f"{int(r['batch_size']):>4} {r['p50_ms']:>9.4f} {r['p95_ms']:>9.4f} {r['min_ms']:>9.4f} "
            f"{r['max_ms']:>9.4f} {r['per_sequence_ms']:>9.4f} {r['positions_per_s']:>13,.0f} "
            f"{r['speedup']:>7.2f}x {_fmt(r['kv_read_gb_s'], 2):>8} {_fmt(r['probe_read_gb_s'], 2):>10} "
            f"{_fmt(r['bandwidth_ratio'], 2):>6}"
        )
    return "\n".join(lines)


def _blas_line(env: dict[str, Any]) -> str:
    pools: list[dict[str, Any]] = env["blas"]
    text = ", ".join(f"{p['internal_api']} {p['version']} ({p['num_threads']} threads)" for p in pools)
    return text or "none found"


def _setup_card(config: ScanConfig, env: dict[str, Any]) -> str:
    itemsize = 4 if config.dtype == "float32" else 8
    lines = [
        "Batch-size scan: one decode step = append 1 position to the KV cache, attend over T+1",
        f"  shape    B in {list(config.batch_sizes)}, H={config.num_heads}, H_kv={config.num_kv_heads}, "
        f"T={config.seq_len}, D={config.head_dim}, {config.dtype}, {config.cache} cache"
        + (f", model {config.model} (one layer)" if config.model else ""),
        f"  timing   {config.warmup} warm-up + {config.repeats} timed calls per B, seed {config.seed}",
        f"  BLAS     {_blas_line(env)}",
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


def run_scan(args: argparse.Namespace) -> int:
    """Run the batch-size scan from parsed arguments; writes raw CSV, summary CSV and metadata."""
    try:
        config = _scan_config(args)
    except ValueError as exc:
        raise UsageError(name_flags(str(exc), (f.name for f in fields(ScanConfig)))) from None
    if args.blas_threads is not None and args.blas_threads < 1:
        raise UsageError(f"--blas-threads must be >= 1, got {args.blas_threads}")
    _check_memory(config)
    csv_path: Path = args.csv
    try:
        check_output_path(csv_path, "--csv", (".csv",))
        if args.plot is not None:
            check_output_path(args.plot, "--plot", (".png",))
    except ValueError as exc:
        raise UsageError(str(exc)) from None

    from threadpoolctl import threadpool_limits  # pyright: ignore[reportMissingTypeStubs]

    pin = threadpool_limits(limits=args.blas_threads) if args.blas_threads else nullcontext()
    with pin:
        return _scan(config, args, csv_path)


def _scan(config: ScanConfig, args: argparse.Namespace, csv_path: Path) -> int:
    env = capture_environment()
    cpus = os.cpu_count() or 1
    if args.blas_threads is not None and args.blas_threads > cpus:
        print(
            f"warning: --blas-threads {args.blas_threads} is more than the {cpus} logical CPUs here; "
            "the threads will compete for cores",
            file=sys.stderr,
        )
    if args.blas_threads is None:
        warn_if_blas_unpinned(", or pass --blas-threads N")
    print(_setup_card(config, env))
    meta: dict[str, Any] = {
        "kind": "batch-size-scan",
        "status": "running",
        "config": asdict(config),
        "environment": env,
        "blas_threads_flag": args.blas_threads,
        "probe": "np.dot(buf, buf) over a buffer of kv_bytes_per_step bytes (BLAS dot: one read stream)",
        "probe_samples_ms": {},
        "kv_bytes_per_step": {},
        "oracle_max_abs_error": {},
        "files": {"raw_csv": str(csv_path), "summary_csv": str(summary_path(csv_path))},
    }
    results: list[BatchResult] = []

    def flush(status: str) -> None:
        samples = [s for r in results for s in r.samples]
        write_csv_atomic(csv_path, (asdict(s) for s in samples), SAMPLE_FIELDS)
        meta["status"] = status
        write_json_atomic(meta_path(csv_path), meta)
        if results:
            write_csv_atomic(summary_path(csv_path), _table(results), SUMMARY_FIELDS)

    from tqdm import tqdm

    inputs = build_inputs(config)
    progress = tqdm(
        config.batch_sizes, desc="batch sizes", unit="B", delay=2.0, disable=not sys.stderr.isatty()
    )
    try:
        for b in progress:
            progress.set_postfix(B=b)
            try:
                result = run_batch(config, inputs, b)
            except OracleMismatch as exc:
                flush("oracle-failed")
                print(f"{PROG}: oracle check failed at B={b}, nothing timed for it: {exc}", file=sys.stderr)
                return 1
            results.append(result)
            meta["probe_samples_ms"][str(b)] = list(result.probe_samples_ms)
            meta["kv_bytes_per_step"][str(b)] = result.kv_bytes_per_step
            meta["oracle_max_abs_error"][str(b)] = result.oracle_max_abs_error
            flush("running")
    except KeyboardInterrupt:
        progress.close()
        with ignoring_sigint():  # a second Ctrl-C must not cut the save short
            flush("interrupted")
        done = sum(len(r.samples) for r in results)
        print(f"{PROG}: interrupted; {done} samples kept in {csv_path}", file=sys.stderr)
        return 130
    except MemoryError:
        progress.close()
        with ignoring_sigint():
            flush("out-of-memory")
        done = sum(len(r.samples) for r in results)
        print(f"{PROG}: error: out of memory; {done} samples kept in {csv_path}", file=sys.stderr)
        return 1
    finally:
        progress.close()

    table = _table(results)
    verdict = saturation_verdict(table)
    meta["saturation"] = verdict
    flush("complete")
    print()
    print(format_scan_table(table))
    print(f"\nSaturation: {verdict}")
    print(
        "Oracle: every B matched the float64 per-sequence reference "
        f"(max |error| {max(r.oracle_max_abs_error for r in results):.2e})"
    )
    written = [str(csv_path), str(summary_path(csv_path)), str(meta_path(csv_path))]
    if args.plot is not None:
        from attention_kv_caceh.plots import plot_scan

        plot_scan(table, args.plot, title=_plot_title(config))
        written.append(str(args.plot))
    print(f"Wrote {', '.join(written)}")
    summary = {
        "raw_csv": str(csv_path),
        "rows": sum(len(r.samples) for r in results),
        "saturation": verdict,
        "p50_ms": {int(r["batch_size"]): round(r["p50_ms"], 6) for r in table},
    }
    print(json.dumps(summary))
    return 0


def _plot_title(config: ScanConfig) -> str:
    return (
        f"decode step, T={config.seq_len}, H={config.num_heads}, H_kv={config.num_kv_heads}, "
        f"D={config.head_dim}, {config.dtype}, {config.cache} cache"
    )


def _table(results: Sequence[BatchResult]) -> list[dict[str, float]]:
    return scan_table(
        [s for r in results for s in r.samples],
        {r.batch_size: r.probe_samples_ms for r in results},
        {r.batch_size: r.kv_bytes_per_step for r in results},
    )


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The scan parser (the default command) and one parser per subcommand."""
    subs = _subcommands()
    epilog = "subcommands (each has --help):\n" + "\n".join(
        f"  {name:<10} {help_text}" for name, (help_text, _, _) in subs.items()
    )
    scan = _Parser(
        prog=PROG,
        description="Batch-size scan of decode attention over a KV cache (the default command).",
        epilog=epilog if subs else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_scan_arguments(scan)
    for action in scan._actions:  # show defaults in --help
        if (
            action.default not in (None, argparse.SUPPRESS)
            and action.help
            and "%(default)" not in action.help
        ):
            action.help += " (default: %(default)s)"
    parsers: dict[str, argparse.ArgumentParser] = {}
    for name, (help_text, add_arguments, _) in subs.items():
        p = _Parser(
            prog=f"{PROG} {name}",
            description=help_text,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        add_arguments(p)
        parsers[name] = p
    return scan, parsers


def main(argv: list[str] | None = None) -> int:
    """Entry point of `attention-kv-caceh`; returns the exit code (see the module docstring)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        scan_parser, parsers = build_parser()
        subs = _subcommands()
        if args_list and args_list[0] in subs:
            name = args_list[0]
            args = parsers[name].parse_args(args_list[1:])
            try:
                return subs[name][2](args)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        args = scan_parser.parse_args(args_list)
        return run_scan(args)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file could not be written: say which, without a traceback
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # commands that keep samples handle Ctrl-C themselves; the rest stop here
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
