"""Command-line front ends of the experiments: `cache`, `views` and `report`.

Each subcommand is a pair `add_*_arguments(parser)` / `run_*(args) -> int`, collected in `SUBCOMMANDS`
so the main command (`attention-kv-caceh`) can mount them next to its default batch-size scan. This is
the only module here that prints. Bad input raises ValueError naming the value, before any file is
created or truncated; `main` (for running this module on its own) turns it into one line and exit 2.

    uv run python -m attention_kv_caceh.experiments.cli views --csv results/views.csv
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from attention_kv_caceh.experiments.cache_growth import (
    CacheGrowthConfig,
    kv_size_card,
    run_cache_growth,
    total_steps,
)
from attention_kv_caceh.experiments.cache_growth_stats import (
    CACHE_KINDS,
    CacheGrowthSummary,
    CacheMemoryRow,
    CacheStepSample,
    summarize_cache_growth,
)
from attention_kv_caceh.experiments.views import VIEW_TABLE_COLUMNS, run_views, views_markdown
from attention_kv_caceh.files import (
    atomic_write_text,
    check_output_path,
    meta_path,
    write_csv_atomic,
    write_json_atomic,
)
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.presets import MODEL_PRESETS, get_preset
from attention_kv_caceh.timing import blas_threads_pinned, capture_environment

__all__ = [
    "SUBCOMMANDS",
    "add_cache_arguments",
    "add_report_arguments",
    "add_views_arguments",
    "build_parser",
    "cache_config_from_args",
    "cache_side_paths",
    "format_cache_summary",
    "main",
    "run_cache",
    "run_report",
    "run_views_command",
]


def _check_output_path(flag: str, path: str | None, suffixes: tuple[str, ...]) -> None:
    if path is not None:
        check_output_path(path, flag, suffixes)


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


# ---------------------------------------------------------------------------------------------- cache

CACHE_DEFAULTS = CacheGrowthConfig()


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `cache`: output paths, the shape (or a `--model` preset), dtype and the timing knobs."""
    d = CACHE_DEFAULTS
    parser.add_argument(
        "--csv",
        default="results/cache.csv",
        metavar="PATH.csv",
        help="raw per-step CSV (default: %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=d.steps, metavar="N", help="decode steps (default: %(default)s)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=d.batch_size, metavar="B", help="(default: %(default)s)"
    )
    parser.add_argument(
        "--num-heads",
        type=int,
        default=None,
        metavar="H",
        help=f"query heads (default: {d.num_heads}, or the model's)",
    )
    parser.add_argument(
        "--num-kv-heads",
        type=int,
        default=None,
        metavar="H_KV",
        help=f"KV heads (default: {d.num_kv_heads}, or the model's)",
    )
    parser.add_argument(
        "--head-dim",
        type=int,
        default=None,
        metavar="D",
        help=f"head dim (default: {d.head_dim}, or the model's)",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="PRESET",
        help=f"take H, H_kv and D from a preset ({', '.join(MODEL_PRESETS)}); explicit flags win",
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
        "--seed", type=int, default=d.seed, metavar="N", help="seed of the inputs (default: %(default)s)"
    )
    parser.add_argument(
        "--plot", default=None, metavar="PATH.png", help="PNG: per-step time and bytes per step against T"
    )


def cache_config_from_args(args: argparse.Namespace) -> CacheGrowthConfig:
    """Build the validated config; a `--model` preset fills H, H_kv and D unless given explicitly.

    Raises ValueError for an unknown preset or any invalid value (see CacheGrowthConfig).
    """
    d = CACHE_DEFAULTS
    heads, kv_heads, head_dim, model = d.num_heads, d.num_kv_heads, d.head_dim, ""
    if args.model:
        preset = get_preset(args.model)
        heads, kv_heads, head_dim, model = (
            preset.num_heads,
            preset.num_kv_heads,
            preset.head_dim,
            preset.name,
        )
    return CacheGrowthConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        num_heads=heads if args.num_heads is None else args.num_heads,
        num_kv_heads=kv_heads if args.num_kv_heads is None else args.num_kv_heads,
        head_dim=head_dim if args.head_dim is None else args.head_dim,
        dtype=args.dtype,
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
        model=model,
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


def run_cache(args: argparse.Namespace) -> int:
    """Run the cache-growth experiment and write its files; returns the exit code (1 on an oracle failure).

    Writes the raw CSV (rewritten atomically after every timed pass, and on Ctrl-C or a crash before
    re-raising), `<stem>-memory.csv`, `<stem>-summary.csv`, `<csv>.meta.json` and the `--plot` PNG.
    Raises ValueError for invalid flags before any file is touched.
    """
    config = cache_config_from_args(args)
    csv_path = str(args.csv)
    plot_path: str | None = args.plot
    _check_output_path("--csv", csv_path, (".csv",))
    _check_output_path("--plot", plot_path, (".png",))
    side = cache_side_paths(csv_path)
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
    if not blas_threads_pinned():
        print(
            "warning: BLAS threads were not pinned before start (set OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1)",
            file=sys.stderr,
        )

    environment = capture_environment()
    meta: dict[str, Any] = {
        "environment": environment,
        "config": {"experiment": "cache", **dataclasses.asdict(config)},
        "kv_sizes": card,
        "files": {k: str(v) for k, v in side.items() if k != "meta"},
    }
    write_json_atomic(side["meta"], meta)
    samples: list[CacheStepSample] = []
    memory: list[CacheMemoryRow] = []
    step_fields = tuple(CacheStepSample.__dataclass_fields__)
    memory_fields = tuple(CacheMemoryRow.__dataclass_fields__)

    def save() -> None:
        if memory:
            write_csv_atomic(side["memory"], (dataclasses.asdict(m) for m in memory), memory_fields)
        write_csv_atomic(csv_path, (dataclasses.asdict(s) for s in samples), step_fields)

    bar = tqdm(
        total=total_steps(config),
        unit="step",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        desc="cache growth",
    )
    try:
        run_cache_growth(config, samples=samples, memory=memory, progress=bar.update, on_pass=save)
    except OracleMismatch as exc:
        bar.close()
        print(f"oracle check failed, nothing timed: {exc}", file=sys.stderr)
        return 1
    except BaseException:
        bar.close()
        if samples or memory:  # nothing taken yet: leave any earlier run's files alone
            save()
        print(f"interrupted: kept {len(samples)} timed samples in {csv_path}", file=sys.stderr)
        raise
    bar.close()
    save()
    write_json_atomic(side["memory_meta"], {**meta, "files": {"timed": csv_path}})
    summary = summarize_cache_growth(samples, memory)
    write_csv_atomic(side["summary"], _summary_rows(summary), tuple(_summary_rows(summary)[0]))
    print(format_cache_summary(summary, config.steps))
    print(f"wrote {csv_path} ({len(samples)} rows), {side['memory']}, {side['summary']}, {side['meta']}")
    if plot_path is not None:
        from attention_kv_caceh.plots import plot_cache_growth

        plot_cache_growth(samples, memory, plot_path)
        print(f"wrote {plot_path}")
    return 0


# ---------------------------------------------------------------------------------------------- views


def add_views_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `views`: `--csv PATH.csv`, `--md PATH.md` (both optional; the table is printed anyway)."""
    parser.add_argument(
        "--csv", default=None, metavar="PATH.csv", help="write the table as CSV (plus <csv>.meta.json)"
    )
    parser.add_argument("--md", default=None, metavar="PATH.md", help="write the table as Markdown")


def run_views_command(args: argparse.Namespace) -> int:
    """Run the six view/copy experiments, print the Markdown table, write the files asked for.

    Raises ValueError for an output path with the wrong suffix.
    """
    csv_path: str | None = args.csv
    md_path: str | None = args.md
    _check_output_path("--csv", csv_path, (".csv",))
    _check_output_path("--md", md_path, (".md", ".markdown"))
    rows = run_views()
    table = views_markdown(rows)
    if csv_path is not None:
        write_csv_atomic(csv_path, (dataclasses.asdict(r) for r in rows), VIEW_TABLE_COLUMNS)
        write_json_atomic(
            meta_path(csv_path),
            {"environment": capture_environment(), "config": {"experiment": "views"}},
        )
    if md_path is not None:
        atomic_write_text(md_path, table)
    print(table, end="")
    held = sum(r.prediction_held for r in rows)
    print(f"\n{held} of {len(rows)} predictions held.")
    return 0


# --------------------------------------------------------------------------------------------- report


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `report`: `--results FOLDER` (raw files to read), `--out PATH.md` (plots go beside it)."""
    parser.add_argument(
        "--results",
        default="results",
        metavar="FOLDER",
        help="raw CSV / JSONL files and their .meta.json (default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        default="results/REPORT.md",
        metavar="PATH.md",
        help="the Markdown report; PNG plots go beside it (default: %(default)s)",
    )


def run_report(args: argparse.Namespace) -> int:
    """Write the report of a results folder; file problems are listed in it and on stderr (exit 0).

    Raises ValueError when --results is not a folder or --out does not end in .md (nothing written).
    """
    from attention_kv_caceh.experiments.report import build_report

    out_path = str(args.out)
    _check_output_path("--out", out_path, (".md",))
    result = build_report(args.results, out_path)
    atomic_write_text(out_path, result.markdown)
    print(f"wrote {out_path} from {len(result.sources)} raw file(s): {', '.join(result.sources) or 'none'}")
    for plot in result.plots:
        print(f"wrote {plot}")
    for problem in result.problems:
        print(f"problem: {problem.path}: {problem.problem}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------- main

Runner = Callable[[argparse.Namespace], int]

SUBCOMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Runner, str]] = {
    "cache": (
        add_cache_arguments,
        run_cache,
        "decode N steps over a Dynamic and a Preallocated KV cache: per-step time and memory",
    ),
    "report": (
        add_report_arguments,
        run_report,
        "recompute every statistic from the raw files of a folder and write a Markdown report",
    ),
    "views": (
        add_views_arguments,
        run_views_command,
        "the view/copy table of the notes (exercise 9.1)",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser with one subparser per entry of SUBCOMMANDS."""
    parser = argparse.ArgumentParser(
        prog="python -m attention_kv_caceh.experiments.cli",
        description="Experiments of the attention-kv-caceh lab.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_arguments, runner, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
        )
        add_arguments(p)
        p.set_defaults(_run=runner)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the subcommand; a ValueError becomes one line on stderr and exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    runner: Any = args._run
    try:
        return int(runner(args))
    except ValueError as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
