"""Command-line front end of the `cache` experiment: its flags, its config, the memory check, the run.

`add_cache_arguments(parser)` / `run_cache(args) -> int` are mounted by `cli.SUBCOMMANDS`; everything
the subcommand prints and every file it writes is decided here, so `cache_growth.py` stays a library
that returns rows. The two small flag helpers the other subcommands share (`optional_arg`,
`check_optional_output`) live here too, as `cache` uses them most. Bad input raises ValueError naming
the flag, before any file is created or truncated.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from attention_kv_caceh.benchmark import name_flags, warn_if_blas_unpinned
from attention_kv_caceh.experiments.cache_growth import (
    CacheGrowthConfig,
    estimate_run_bytes,
    kv_size_card,
    run_cache_growth,
    total_steps,
)
from attention_kv_caceh.experiments.cache_growth_stats import (
    CACHE_KINDS,
    CacheGrowthSummary,
    CacheMemoryRow,
    CacheStepSample,
    partial_passes,
    summarize_cache_growth,
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
from attention_kv_caceh.timing import capture_environment, memory_limit_bytes

__all__ = [
    "CACHE_DEFAULTS",
    "MEMORY_SHARE",
    "PROG",
    "add_cache_arguments",
    "cache_config_from_args",
    "cache_side_paths",
    "check_cache_memory",
    "check_optional_output",
    "format_cache_summary",
    "optional_arg",
    "run_cache",
]


# The main command's name: runtime messages start with it, as the main command's own do.
PROG = "attention-kv-caceh"


def check_optional_output(flag: str, path: str | None, suffixes: tuple[str, ...]) -> None:
    """`files.check_output_path` for an optional flag: nothing to check when `path` is None."""
    if path is not None:
        check_output_path(path, flag, suffixes)


def optional_arg(args: argparse.Namespace, name: str) -> Any:
    """An optional flag's value, None when absent (flags defaulting to SUPPRESS are then missing)."""
    return getattr(args, name, None)


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


CACHE_DEFAULTS = CacheGrowthConfig()
# Share of this machine's memory a run may plan to use (as the batch-size scan's check).
MEMORY_SHARE = 0.8


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `cache`: output paths, the shape (or a `--model` preset), dtype and the timing knobs.

    Flags without a value of their own (the shape flags a preset may fill, `--model`, `--plot`) default
    to argparse.SUPPRESS: absent from the namespace unless given, and no "(default: None)" in --help.
    """
    d = CACHE_DEFAULTS
    parser.add_argument(
        "--csv",
        default="results/cache.csv",
        metavar="PATH.csv",
        help="raw per-step CSV; <stem>-memory.csv, <stem>-summary.csv and their .meta.json go beside "
        "it (default: %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=d.steps,
        metavar="N",
        help="decode steps, at least 2 (default: %(default)s)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        metavar="B",
        help="sequences decoded together (default: %(default)s)",
    )
    parser.add_argument(
        "--num-heads",
        type=int,
        default=argparse.SUPPRESS,
        metavar="H",
        help=f"query heads (default: {d.num_heads}, or the model's)",
    )
    parser.add_argument(
        "--num-kv-heads",
        type=int,
        default=argparse.SUPPRESS,
        metavar="H_KV",
        help=f"KV heads (default: {d.num_kv_heads}, or the model's)",
    )
    parser.add_argument(
        "--head-dim",
        type=int,
        default=argparse.SUPPRESS,
        metavar="D",
        help=f"head dim (default: {d.head_dim}, or the model's)",
    )
    parser.add_argument(
        "--model",
        default=argparse.SUPPRESS,
        metavar="PRESET",
        help=f"take H, H_kv and D from a preset ({', '.join(MODEL_PRESETS)}); explicit flags win "
        "(default: none)",
    )
    parser.add_argument(
        "--dtype", default=d.dtype, metavar="DTYPE", help="float32 or float64 (default: %(default)s)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=d.repeats,
        metavar="N",
        help="timed passes per cache (default: %(default)s)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=d.warmup,
        metavar="N",
        help="unrecorded passes per cache (default: %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        metavar="N",
        help="seed of the inputs, >= 0 (default: %(default)s)",
    )
    parser.add_argument(
        "--plot",
        default=argparse.SUPPRESS,
        metavar="PATH.png",
        help="PNG: per-step time and bytes per step against T (default: no plot)",
    )


def cache_config_from_args(args: argparse.Namespace) -> CacheGrowthConfig:
    """Build the validated config; a `--model` preset fills H, H_kv and D unless given explicitly.

    Raises ValueError naming the flag for an unknown preset, any invalid value (see
    CacheGrowthConfig), or fewer than 2 steps (the summary fits a line over T).
    """
    d = CACHE_DEFAULTS
    heads, kv_heads, head_dim, model = d.num_heads, d.num_kv_heads, d.head_dim, ""
    model_flag: str | None = optional_arg(args, "model")
    if model_flag:
        try:
            preset = get_preset(model_flag)
        except ValueError as exc:
            raise ValueError(f"--model: {exc}") from None
        heads, kv_heads, head_dim, model = (
            preset.num_heads,
            preset.num_kv_heads,
            preset.head_dim,
            preset.name,
        )
    given = {name: optional_arg(args, name) for name in ("num_heads", "num_kv_heads", "head_dim")}
    try:
        config = CacheGrowthConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            num_heads=heads if given["num_heads"] is None else given["num_heads"],
            num_kv_heads=kv_heads if given["num_kv_heads"] is None else given["num_kv_heads"],
            head_dim=head_dim if given["head_dim"] is None else given["head_dim"],
            dtype=args.dtype,
            repeats=args.repeats,
            warmup=args.warmup,
            seed=args.seed,
            model=model,
        )
    except ValueError as exc:
        raise ValueError(
            name_flags(str(exc), (f.name for f in dataclasses.fields(CacheGrowthConfig)))
        ) from None
    if config.steps < 2:
        raise ValueError(f"--steps must be at least 2 (the summary fits a line over T), got {config.steps}")
    return config


def check_cache_memory(config: CacheGrowthConfig) -> None:
    """Refuse a run whose arrays and rows would not fit in the memory this process may use.

    Compares `cache_growth.estimate_run_bytes` with MEMORY_SHARE of the smaller of the physical memory
    and the address-space limit (`ulimit -v`); raises ValueError with both sizes in GiB and the flags
    to lower. Does nothing where neither is known.
    """
    needed = estimate_run_bytes(config)
    total = memory_limit_bytes()
    if total is not None and needed > MEMORY_SHARE * total:
        raise ValueError(
            f"this run needs about {needed / 2**30:.1f} GiB for N={config.steps}, B={config.batch_size}, "
            f"H={config.num_heads}, H_kv={config.num_kv_heads}, D={config.head_dim}, {config.dtype}, "
            f"{config.repeats} repeats: more than {MEMORY_SHARE:.0%} of the {total / 2**30:.1f} GiB "
            "this process may use; lower --steps, --batch-size, --num-heads, --num-kv-heads, --head-dim or --repeats"
        )


def cache_side_paths(csv_path: str | Path) -> dict[str, Path]:
    """Files a `cache` run writes beside its raw CSV: memory rows, summary and metadata."""
    p = Path(csv_path)
    return {
        "memory": p.with_name(f"{p.stem}-memory.csv"),
        "summary": p.with_name(f"{p.stem}-summary.csv"),
        "meta": meta_path(p),
        "memory_meta": meta_path(p.with_name(f"{p.stem}-memory.csv")),
    }


def format_cache_summary(summary: CacheGrowthSummary, steps: int) -> str:
    """Fixed-width text of a cache-growth summary (what `cache` prints and the report reuses)."""
    lines = [f"{'T':>6} {'dynamic P50 ms':>15} {'prealloc P50 ms':>16} {'ratio':>7}"]
    for c in summary.checkpoints:
        lines.append(
            f"{int(c['sequence_length']):>6} {c['dynamic_p50_ms']:>15.4f} "
            f"{c['preallocated_p50_ms']:>16.4f} {c['ratio']:>7.2f}"
        )
    lines.append("")
    lines.append(
        f"{'cache':<13} {'slope us/pos':>12} {'intercept ms':>13} {'R^2':>6} {'R^2 raw':>8} {'N-step P50 ms':>14}"
    )
    for kind in CACHE_KINDS:
        f = summary.fits[kind]
        lines.append(
            f"{kind:<13} {f.slope_ms_per_position * 1000:>12.4f} {f.intercept_ms:>13.4f} {f.r2:>6.3f} "
            f"{f.r2_raw:>8.3f} {summary.totals[kind]['p50_ms']:>14.1f}"
        )
    lines.append(f"N-step total time ratio (dynamic / preallocated, N={steps}): {summary.total_ratio:.2f}x")
    visible, dominates = summary.copy_visible_from, summary.copy_dominates_from
    lines.append(
        "Dynamic slower by >= 10% from T = "
        + (str(visible) if visible is not None else "not within N")
        + "; copy dominates (>= 2x) from T = "
        + (str(dominates) if dominates is not None else "not within N")
        + (
            f" (fitted lines cross 2x at T ~ {summary.copy_dominates_fitted:.0f})"
            if summary.copy_dominates_fitted is not None
            else ""
        )
    )
    for kind, m in summary.memory.items():
        lines.append(
            f"{kind}: append allocates {_fmt_bytes(m['append_bytes_first_step'])} at T=1, "
            f"{_fmt_bytes(m['append_bytes_last_step'])} at T={int(m['final_sequence_length'])} "
            f"({m['append_bytes_per_position']:.1f} B/position traced peak; new buffers "
            f"{m['new_buffer_bytes_per_position']:.1f} B/position); nbytes "
            f"{_fmt_bytes(m['final_cache_nbytes'])} vs theoretical {_fmt_bytes(m['final_theoretical_bytes'])}"
            f" for T={int(m['final_sequence_length'])}; largest step peak {_fmt_bytes(m['max_step_peak_bytes'])}"
        )
    return "\n".join(lines)


def _summary_rows(summary: CacheGrowthSummary) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for kind in CACHE_KINDS:
        f, t = summary.fits[kind], summary.totals[kind]
        rows.append(
            {
                "cache": kind,
                "slope_ms_per_position": f.slope_ms_per_position,
                "intercept_ms": f.intercept_ms,
                "r2": f.r2,
                "r2_raw": f.r2_raw,
                "total_p50_ms": t["p50_ms"],
                "total_ratio_dynamic_over_preallocated": summary.total_ratio,
            }
        )
    return rows


def _check_cache_outputs(csv_path: str, plot_path: str | None) -> dict[str, Path]:
    """Check every file `cache` may write (the CSV, the files beside it, the plot); returns the side
    paths. Raises ValueError naming the flag and the path."""
    check_optional_output("--csv", csv_path, (".csv",))
    check_optional_output("--plot", plot_path, (".png",))
    side = cache_side_paths(csv_path)
    for path in side.values():
        check_output_path(path, f"--csv {csv_path!r}: the file beside it")
    return side


def run_cache(args: argparse.Namespace) -> int:
    """Run the cache-growth experiment and write its files; returns the exit code.

    Writes the raw CSV and `<stem>-memory.csv` (rewritten atomically after the memory pass and every
    timed pass, and on Ctrl-C, an oracle failure or an error), each with a `.meta.json` whose `status`
    says how far the run got (`running`, `complete`, `interrupted`, `oracle-failed`, `failed`), then
    `<stem>-summary.csv` and the `--plot` PNG. Every step measured is kept, those of a pass cut
    part-way included (`partial_pass` in the metadata; its cache and repeat have fewer than N rows).
    The final save ignores Ctrl-C (a second one, as `uv run` forwards, must not cut it short). Exit
    codes: 0 done, 1 oracle failure or runtime error (out of memory, a file that cannot be written),
    130 Ctrl-C; each prints one line on stderr, starting with `attention-kv-caceh:`.
    Raises ValueError for invalid flags, or a run too large for this machine's memory, before any
    file is touched.
    """
    config = cache_config_from_args(args)
    csv_path = str(args.csv)
    plot_path: str | None = optional_arg(args, "plot")
    side = _check_cache_outputs(csv_path, plot_path)
    check_cache_memory(config)
    card = kv_size_card(config)

    print(
        f"cache growth: N={config.steps} steps, B={config.batch_size}, H={config.num_heads}, "
        f"H_kv={config.num_kv_heads}, D={config.head_dim}, {config.dtype}"
        + (f", model {config.model}" if config.model else "")
        + f"; {config.warmup} warm-up + {config.repeats} timed passes per cache, seed {config.seed}"
    )
    print(
        f"KV bytes per token (one layer): {card['kv_bytes_per_token_one_layer']} B; per sequence at "
        f"T={config.steps}: {_fmt_bytes(card['kv_bytes_per_sequence_one_layer'])}; batch: "
        f"{_fmt_bytes(card['kv_bytes_batch_one_layer'])}"
    )
    if config.model:
        print(
            f"{config.model}, all {card['model_layers']} layers: {_fmt_bytes(card['kv_bytes_per_token_all_layers'])}"
            f" per token at {config.dtype} ({_fmt_bytes(card['kv_bytes_per_token_all_layers_float16'])} at "
            f"float16), {_fmt_bytes(card['kv_bytes_per_sequence_all_layers'])} per sequence at T={config.steps}"
        )
    warn_if_blas_unpinned()

    try:
        environment = capture_environment()
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted before the run started: nothing written", file=sys.stderr)
        return 130
    meta: dict[str, Any] = {
        "status": "running",
        "environment": environment,
        "config": {"experiment": "cache", **dataclasses.asdict(config)},
        "kv_sizes": card,
        "files": {k: str(v) for k, v in side.items() if k != "meta"},
    }
    samples: list[CacheStepSample] = []
    memory: list[CacheMemoryRow] = []
    step_fields = tuple(CacheStepSample.__dataclass_fields__)
    memory_fields = tuple(CacheMemoryRow.__dataclass_fields__)

    def save(status: str, error: str | None = None) -> None:
        """Rewrite both raw CSVs (complete, possibly header-only) and their metadata."""
        meta["status"] = status
        meta["timed_samples"] = len(samples)
        meta["memory_rows"] = len(memory)
        cut = partial_passes(samples, memory)
        meta["partial_pass"] = bool(cut)
        if cut:
            meta["partial_passes"] = cut
        if error is not None:
            meta["error"] = error
        write_csv_atomic(side["memory"], (dataclasses.asdict(m) for m in memory), memory_fields)
        write_csv_atomic(csv_path, (dataclasses.asdict(s) for s in samples), step_fields)
        write_json_atomic(side["meta"], meta)
        write_json_atomic(side["memory_meta"], {**meta, "files": {"timed": csv_path}})

    def kept() -> str:
        cut = partial_passes(samples, memory)
        return (
            f"kept {len(samples)} timed samples in {csv_path} and {len(memory)} memory rows in "
            f"{side['memory']}" + (f" (cut part-way: {', '.join(cut)})" if cut else "")
        )

    bar = tqdm(
        total=total_steps(config),
        unit="step",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        desc="cache growth",
    )
    # The handlers only note what happened: the files are written after the except clause has let go
    # of the traceback, and with it of the run's arrays (a MemoryError would otherwise strike again),
    # with Ctrl-C ignored (under `uv run` a Ctrl-C reaches python twice: the second must not cut the
    # final save short and leave the metadata at "running").
    failure: tuple[str, str | None] | None = None
    try:
        run_cache_growth(
            config,
            samples=samples,
            memory=memory,
            progress=bar.update,
            on_pass=lambda: save("running"),
        )
    except OracleMismatch as exc:
        failure = ("oracle-failed", str(exc))
    except KeyboardInterrupt:
        failure = ("interrupted", None)
    except MemoryError:
        failure = ("failed", "out of memory")
    except Exception as exc:
        failure = ("failed", f"{type(exc).__name__}: {exc}")
    with ignoring_sigint():
        bar.close()
        if failure is None:
            save("complete")
        else:
            status, error = failure
            save(status, error)
            if status == "oracle-failed":
                print(
                    f"{PROG}: error: oracle check failed, nothing timed ({kept()}): {error}", file=sys.stderr
                )
                return 1
            if status == "interrupted":
                print(f"{PROG}: interrupted: {kept()}", file=sys.stderr)
                return 130
            hint = (
                "; lower --steps, --batch-size, --num-heads, --head-dim or --repeats"
                if error == "out of memory"
                else ""
            )
            print(f"{PROG}: error: the run failed ({kept()}): {error}{hint}", file=sys.stderr)
            return 1
    try:
        summary = summarize_cache_growth(samples, memory)
        write_csv_atomic(side["summary"], _summary_rows(summary), tuple(_summary_rows(summary)[0]))
        print(format_cache_summary(summary, config.steps))
        print(
            f"wrote {csv_path} ({len(samples)} rows), {side['memory']} ({len(memory)} rows), "
            f"{side['summary']}, {side['meta']}, {side['memory_meta']}"
        )
        if plot_path is not None:
            from attention_kv_caceh.plots import plot_cache_growth

            plot_cache_growth(samples, memory, plot_path)
            print(f"wrote {plot_path}")
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted after the run: {kept()}; the summary or plot is missing", file=sys.stderr)
        return 130
    return 0
