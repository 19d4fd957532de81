"""`attention-kv-caceh cache`: N decode steps over a Dynamic and a Preallocated KV cache.

Flags, the config, the up-front checks (shape, memory, every output path and the files beside the raw
CSV), the setup lines, the prediction (predicted slopes from the bytes each step moves per cached
position and the read probe, `experiments.prediction`; written to the metadata and printed before
anything is timed), the run with its saves, the summary, and the prediction against the fitted slopes.
`experiments/cache_growth.py` stays a library that returns rows; the summary text and rows come from
`experiments/cache_growth_stats.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from attention_kv_caceh.cli.common import (
    PROG,
    UsageError,
    add_shape_arguments,
    check_outputs,
    check_side_files,
    int_at_least,
    nonnegative_int,
    output_file,
    positive_int,
    shape_from_args,
    warn_if_blas_unpinned,
)
from attention_kv_caceh.experiments.cache_growth import (
    CacheGrowthConfig,
    estimate_run_bytes,
    kv_size_card,
    run_cache_growth,
    total_steps,
)
from attention_kv_caceh.experiments.cache_growth_stats import (
    SUMMARY_FIELDS,
    CacheMemoryRow,
    CacheStepSample,
    format_cache_summary,
    partial_passes,
    summarize_cache_growth,
    summary_rows,
)
from attention_kv_caceh.experiments.calibration import read_probe
from attention_kv_caceh.experiments.prediction import (
    CachePrediction,
    cache_bytes_per_position,
    cache_prediction_card,
    cache_probe_bytes,
    evaluate_cache,
    make_cache_prediction,
    outcome_json,
    outcome_text,
)
from attention_kv_caceh.files import (
    atomic_write_text,
    ignoring_sigint,
    markdown_path,
    meta_path,
    write_csv_atomic,
    write_json_atomic,
)
from attention_kv_caceh.memory import MemoryBudgetError, check_memory, format_bytes
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.timing import capture_environment

__all__ = ["CACHE_DEFAULTS", "HELP", "add_arguments", "cache_config", "run"]

STEPS_WHY = "the summary fits a line over T"
HELP = "decode N steps over a Dynamic and a Preallocated KV cache: per-step time and memory"
CACHE_DEFAULTS = CacheGrowthConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `cache`: output paths, the shape (or a `--model` preset), dtype and the timing knobs.

    The shape flags a preset may fill, `--model` and `--plot` default to None and spell their default out.
    """
    d = CACHE_DEFAULTS
    parser.add_argument(
        "--csv",
        type=output_file(".csv"),
        default="results/cache.csv",
        metavar="PATH.csv",
        help="raw per-step CSV; <stem>-memory.csv, <stem>-summary.csv and their .meta.json go beside it",
    )
    parser.add_argument(
        "--steps",
        type=int_at_least(2, STEPS_WHY),
        default=d.steps,
        metavar="N",
        help="decode steps, at least 2",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=d.batch_size,
        metavar="B",
        help="sequences decoded together",
    )
    add_shape_arguments(parser, d)
    parser.add_argument("--dtype", choices=("float32", "float64"), default=d.dtype, help="element type")
    parser.add_argument(
        "--repeats", type=positive_int, default=d.repeats, metavar="N", help="timed passes per cache"
    )
    parser.add_argument(
        "--warmup", type=nonnegative_int, default=d.warmup, metavar="N", help="unrecorded passes per cache"
    )
    parser.add_argument(
        "--seed", type=nonnegative_int, default=d.seed, metavar="N", help="seed of the inputs, >= 0"
    )
    parser.add_argument(
        "--plot",
        type=output_file(".png"),
        default=None,
        metavar="PATH.png",
        help="PNG: per-step time and bytes per step against T (default: no plot)",
    )


def cache_config(args: argparse.Namespace) -> CacheGrowthConfig:
    """The validated config; the shape from `presets.resolve_shape` (explicit flags win).

    Raises UsageError when H is not a multiple of H_kv or for any value the config rejects (--steps
    below 2 is refused by its argparse type).
    """
    shape = shape_from_args(args, CACHE_DEFAULTS)
    try:
        return CacheGrowthConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            dtype=args.dtype,
            repeats=args.repeats,
            warmup=args.warmup,
            seed=args.seed,
            model=shape.model,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _check_memory(config: CacheGrowthConfig) -> None:
    """Refuse a run whose arrays and rows (`cache_growth.estimate_run_bytes`) would not fit."""
    try:
        check_memory(
            estimate_run_bytes(config),
            f"this run (N={config.steps}, B={config.batch_size}, H={config.num_heads}, "
            f"H_kv={config.num_kv_heads}, D={config.head_dim}, {config.dtype}, {config.repeats} repeats)",
            "--steps, --batch-size, --num-heads, --num-kv-heads, --head-dim or --repeats",
        )
    except MemoryBudgetError as exc:
        raise UsageError(str(exc)) from None


def predict_slopes(config: CacheGrowthConfig) -> CachePrediction:
    """The predicted slopes, measured and stamped before the run times anything.

    Bytes per cached position per cache (`cache_bytes_per_position`) over the read probe's bandwidth
    (`read_probe`: `np.dot` over the K/V bytes of a cache at T = N, 3 warm-up + 30 timed calls).
    """
    shape = (config.batch_size, config.num_kv_heads, config.head_dim, config.dtype)
    per = cache_bytes_per_position(*shape)
    nbytes = cache_probe_bytes(*shape, config.steps)
    return make_cache_prediction(per, nbytes, read_probe(nbytes, config.dtype))


def run(args: argparse.Namespace) -> int:
    """Run the cache-growth experiment and write its files; returns the exit code.

    Writes the raw CSV and `<stem>-memory.csv` (rewritten atomically after the memory pass and every
    timed pass, and on Ctrl-C, an oracle failure or an error), each with a `.meta.json` whose `status`
    says how far the run got (`running`, `complete`, `interrupted`, `oracle-failed`, `failed`), then
    `<stem>-summary.csv` and the `--plot` PNG. Every step measured is kept, those of a pass cut
    part-way included (`partial_pass` in the metadata; its cache and repeat have fewer than N rows).
    The final save ignores Ctrl-C (a second one, as `uv run` forwards, must not cut it short). Exit
    codes: 0 done, 1 oracle failure or runtime error (out of memory, a file that cannot be written),
    130 Ctrl-C; each prints one line on stderr, starting with `attention-kv-caceh:`.
    Raises UsageError for invalid flags, an output that cannot be written, or a run too large for this
    machine's memory, before any file is touched.
    """
    config = cache_config(args)
    csv_path = str(args.csv)
    plot_path: str | None = args.plot
    side = check_cache_outputs(csv_path, plot_path)
    _check_memory(config)
    card = kv_size_card(config)

    for line in setup_lines(config, card):
        print(line)
    warn_if_blas_unpinned()

    try:
        environment = capture_environment()
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted before the run started: nothing written", file=sys.stderr)
        return 130
    meta: dict[str, Any] = {
        "status": "running",
        "environment": environment,
        # oracle_steps: the positions the oracle checks (config.oracle_steps is empty for the default)
        "config": {"experiment": "cache", **dataclasses.asdict(config), "oracle_steps": config.checked_steps},
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
        # header-only until the run completes (then the fitted summary replaces it): a summary left
        # by an earlier run never sits beside this run's raw files
        write_csv_atomic(side["summary"], (), SUMMARY_FIELDS)
        write_meta()
        atomic_write_text(side["markdown"], _markdown(csv_path, samples, memory, meta))

    def write_meta() -> None:
        write_json_atomic(side["meta"], meta)
        write_json_atomic(side["memory_meta"], {**meta, "files": {"timed": csv_path}})

    def kept() -> str:
        return kept_text(samples, memory, csv_path, side["memory"])

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
    prediction: CachePrediction | None = None
    try:
        prediction = predict_slopes(config)
        meta["prediction"] = prediction.to_json()
        save("running")  # on disk before the first timed step
        bar.clear()
        # flushed: a pipe must show the card before the timing starts
        print(cache_prediction_card(prediction) + "\n", flush=True)
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
        write_csv_atomic(side["summary"], summary_rows(summary), SUMMARY_FIELDS)
        print(format_cache_summary(summary, config.steps))
        if prediction is not None:
            outcome = evaluate_cache(prediction, summary)
            meta["prediction_outcome"] = outcome_json(outcome.verdicts)
            with ignoring_sigint():
                write_meta()
            print()
            print(outcome_text(outcome))
            print()
        print(
            f"wrote {csv_path} ({len(samples)} rows), {side['memory']} ({len(memory)} rows), "
            f"{side['summary']}, {side['meta']}, {side['memory_meta']}, {side['markdown']}"
        )
        if plot_path is not None:
            from attention_kv_caceh.report.plots import plot_cache_growth

            plot_cache_growth(samples, memory, plot_path)
            print(f"wrote {plot_path}")
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted after the run: {kept()}; the summary or plot is missing", file=sys.stderr)
        return 130
    return 0


# ------------------------------------------------------------- the files beside the raw CSV, and text


def cache_side_paths(csv_path: str | Path) -> dict[str, Path]:
    """Files a `cache` run writes beside its raw CSV: memory rows, summary and metadata."""
    p = Path(csv_path)
    return {
        "memory": p.with_name(f"{p.stem}-memory.csv"),
        "summary": p.with_name(f"{p.stem}-summary.csv"),
        "meta": meta_path(p),
        "memory_meta": meta_path(p.with_name(f"{p.stem}-memory.csv")),
        "markdown": markdown_path(p),
    }


def check_cache_outputs(csv_path: str, plot_path: str | None) -> dict[str, Path]:
    """Check every file `cache` may write (the CSV, the files beside it, the plot); returns the side
    paths. Raises UsageError naming the flag and the path."""
    side = cache_side_paths(csv_path)
    beside = f"--csv {csv_path!r}: the file beside it"
    check_outputs(
        [("--csv", csv_path, (".csv",)), ("--plot", plot_path, (".png",))]
        + [(beside, path, ()) for path in side.values()]
    )
    check_side_files(
        "--csv",
        {
            side["memory"]: tuple(CacheMemoryRow.__dataclass_fields__),
            side["summary"]: SUMMARY_FIELDS,
            side["meta"]: (),
            side["memory_meta"]: (),
            side["markdown"]: (),
        },
    )
    return side


def setup_lines(config: CacheGrowthConfig, card: Mapping[str, Any]) -> list[str]:
    """The lines printed before the run: its parameters, then the KV sizes of `cache_growth.kv_size_card`
    (`card`), all layers of the `--model` preset included when one is named."""
    lines = [
        f"cache growth: N={config.steps} steps, B={config.batch_size}, H={config.num_heads}, "
        f"H_kv={config.num_kv_heads}, D={config.head_dim}, {config.dtype}"
        + (f", model {config.model}" if config.model else "")
        + f"; {config.warmup} warm-up + {config.repeats} timed passes per cache, seed {config.seed}",
        f"KV bytes per token (one layer): {card['kv_bytes_per_token_one_layer']} B; per sequence at "
        f"T={config.steps}: {format_bytes(card['kv_bytes_per_sequence_one_layer'])}; batch: "
        f"{format_bytes(card['kv_bytes_batch_one_layer'])}",
    ]
    if config.model:
        lines.append(
            f"{config.model}, all {card['model_layers']} layers: {format_bytes(card['kv_bytes_per_token_all_layers'])}"
            f" per token at {config.dtype} ({format_bytes(card['kv_bytes_per_token_all_layers_float16'])} at "
            f"float16), {format_bytes(card['kv_bytes_per_sequence_all_layers'])} per sequence at T={config.steps}"
        )
    return lines


def kept_text(
    samples: Sequence[CacheStepSample], memory: Sequence[CacheMemoryRow], csv_path: str, memory_path: Path
) -> str:
    """What a cut-short run kept on disk: its row counts and files, and the passes cut part-way."""
    cut = partial_passes(samples, memory)
    return (
        f"kept {len(samples)} timed samples in {csv_path} and {len(memory)} memory rows in "
        f"{memory_path}" + (f" (cut part-way: {', '.join(cut)})" if cut else "")
    )


def _markdown(
    csv_path: str, samples: list[CacheStepSample], memory: list[CacheMemoryRow], meta: dict[str, Any]
) -> str:
    """The run's Markdown (`report.predictions.cache_run_markdown`, as `report` renders it from the
    raw files) with a status line once it is complete; before, the status alone."""
    name = Path(csv_path).name
    if meta["status"] != "complete":
        return f"### KV-cache growth: `{name}`\n\nStatus: {meta['status']}; no summary yet.\n"
    from attention_kv_caceh.report.predictions import cache_run_markdown

    text = cache_run_markdown(name, samples, memory, meta, [])
    return text.replace("\n\n", "\n\nStatus: complete.\n\n", 1)
