"""`attention-kv-caceh cache`: N decode steps over a Dynamic and a Preallocated KV cache.

Flags (`CacheGrowthConfig`, `ShapeOptions` and `CacheOptions` fields) -> config -> the up-front checks
(memory, every output path and the files beside the raw CSV) -> the setup lines -> the run into a
`RunRecorder` (`experiments.cache_run`: the prediction, predicted slopes from the bytes each step moves
per cached position and the read probe, written to the metadata and printed before anything is timed;
then the oracle, the memory pass and the timed passes) -> the summary and the prediction against the
fitted slopes (`report.cache_text`, `report.outcome`).
"""

from __future__ import annotations

import argparse
import sys
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
from attention_kv_caceh.experiments.cache_growth import (
    CacheGrowthConfig,
    estimate_run_bytes,
    kv_size_card,
    total_steps,
)
from attention_kv_caceh.experiments.cache_growth_stats import SUMMARY_FIELDS, summarize_cache_growth
from attention_kv_caceh.experiments.cache_prediction import evaluate_cache, predict_slopes
from attention_kv_caceh.experiments.cache_run import (
    MEMORY_FIELDS,
    STEP_FIELDS,
    CacheRun,
    cache_side_paths,
    record_cache_growth,
)
from attention_kv_caceh.experiments.shape import ShapeOptions
from attention_kv_caceh.files import atomic_write_text
from attention_kv_caceh.memory import MemoryBudgetError, check_memory
from attention_kv_caceh.options import check_options, option
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.recorder import RunRecorder
from attention_kv_caceh.report.cache_text import (
    cache_live_markdown,
    format_cache_summary,
    kept_text,
    setup_lines,
)
from attention_kv_caceh.report.outcome import cache_prediction_card, outcome_json, outcome_text
from attention_kv_caceh.timing import capture_environment

__all__ = ["CACHE_DEFAULTS", "HELP", "CacheOptions", "add_arguments", "cache_config", "run"]

HELP = "decode N steps over a Dynamic and a Preallocated KV cache: per-step time and memory"
CACHE_DEFAULTS = CacheGrowthConfig()


@dataclass(frozen=True)
class CacheOptions:
    """Where `cache` writes: the raw CSV (the files beside it follow its name) and the plot."""

    csv: Path = option(  # noqa: RUF009  (option() returns a dataclasses.field)
        Path("results/cache.csv"),
        help="raw per-step CSV; <stem>-memory.csv, <stem>-summary.csv and their .meta.json go beside it",
        metavar="PATH.csv",
        parse=output_file(".csv"),
    )
    plot: Path | None = option(  # noqa: RUF009
        None,
        help="PNG: per-step time and bytes per step against T",
        metavar="PATH.png",
        parse=output_file(".png"),
        default_text="no plot",
    )

    def __post_init__(self) -> None:
        check_options(self)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `cache`: the fields of CacheOptions, CacheGrowthConfig and ShapeOptions."""
    d = CACHE_DEFAULTS
    add_options(parser, CacheOptions, only=("csv",))
    add_options(parser, CacheGrowthConfig, only=("steps", "batch_size"))
    add_options(parser, ShapeOptions, default_texts=ShapeOptions.default_texts(d.num_heads, d.head_dim))
    add_options(parser, CacheGrowthConfig, exclude=("steps", "batch_size"))
    add_options(parser, CacheOptions, exclude=("csv",))


def cache_config(args: argparse.Namespace) -> CacheGrowthConfig:
    """The validated config; the shape from `presets.resolve_shape` (explicit flags win). Raises
    UsageError naming the flag for a value the config rejects (--steps below 2: its flag's parse)."""
    d = CACHE_DEFAULTS
    shape = config_from_args(ShapeOptions, args).resolve(d.num_heads, d.head_dim)
    return config_from_args(CacheGrowthConfig, args, ShapeOptions, **asdict(shape))


def run(args: argparse.Namespace) -> int:
    """Run the cache-growth experiment and write its files; returns the exit code.

    Writes the raw CSV and `<stem>-memory.csv` (rewritten atomically after the memory pass and every
    timed pass, and on Ctrl-C, an oracle failure or an error), each with a `.meta.json` whose `status`
    says how far the run got (`running`, `complete`, `interrupted`, `oracle-failed`, `failed`), then
    `<stem>-summary.csv` and the `--plot` PNG. Every step measured is kept, those of a pass cut
    part-way included (`partial_pass` in the metadata). The final save ignores Ctrl-C. Exit codes: 0
    done, 1 oracle failure or runtime error (out of memory, a file that cannot be written), 130 Ctrl-C;
    each prints one line on stderr, starting with `attention-kv-caceh:`. Raises UsageError for invalid
    flags, an output that cannot be written, or a run too large for this machine's memory, before any
    file is touched.
    """
    config, options = cache_config(args), config_from_args(CacheOptions, args)
    side = check_cache_outputs(options.csv, options.plot)
    try:
        check_memory(
            estimate_run_bytes(config),
            f"this run (N={config.steps}, B={config.batch_size}, H={config.num_heads}, "
            f"H_kv={config.num_kv_heads}, D={config.head_dim}, {config.dtype}, {config.repeats} repeats)",
            "--steps, --batch-size, --num-heads, --num-kv-heads, --head-dim or --repeats",
        )
    except MemoryBudgetError as exc:
        raise UsageError(str(exc)) from None
    card = kv_size_card(config)
    print("\n".join(setup_lines(config, card)))
    warn_if_blas_unpinned()
    try:
        environment = capture_environment()
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted before the run started: nothing written", file=sys.stderr)
        return 130
    state = CacheRun(config, options.csv)

    def side_files(recorder: RunRecorder) -> None:
        state.write_side_files(recorder)
        atomic_write_text(
            side["markdown"], cache_live_markdown(state.csv_path, state.samples, state.memory, recorder.meta)
        )

    from tqdm import tqdm

    bar = tqdm(
        total=total_steps(config),
        unit="step",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        desc="cache growth",
    )
    try:
        with RunRecorder(
            "cache-growth",
            options.csv,
            STEP_FIELDS,
            config=state.meta_config(),
            environment=environment,
            extra={"kv_sizes": card, "files": {k: str(v) for k, v in side.items() if k != "meta"}},
            before_save=state.before_save,
            side_files=side_files,
        ) as recorder:
            prediction = predict_slopes(config)
            recorder.meta["prediction"] = prediction.to_json()
            recorder.save()  # on disk before the first timed step
            bar.clear()
            print(cache_prediction_card(prediction) + "\n", flush=True)  # a pipe shows it before the timing
            record_cache_growth(state, recorder, bar.update)
            bar.close()
            summary = summarize_cache_growth(state.samples, state.memory)
            outcome = evaluate_cache(prediction, summary)
            recorder.meta["prediction_outcome"] = outcome_json(outcome.verdicts)
            recorder.finish("complete")
    except (KeyboardInterrupt, Exception) as exc:
        bar.close()
        print(
            _stopped(exc, kept_text(state.samples, state.memory, options.csv, side["memory"])),
            file=sys.stderr,
        )
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    try:
        print(f"{format_cache_summary(summary, config.steps)}\n\n{outcome_text(outcome)}\n")
        print(
            f"wrote {options.csv} ({len(state.samples)} rows), {side['memory']} ({len(state.memory)} rows), "
            f"{side['summary']}, {side['meta']}, {side['memory_meta']}, {side['markdown']}"
        )
        if options.plot is not None:
            from attention_kv_caceh.report.plots import plot_cache_growth

            plot_cache_growth(state.samples, state.memory, options.plot)
            print(f"wrote {options.plot}")
    except KeyboardInterrupt:
        kept = kept_text(state.samples, state.memory, options.csv, side["memory"])
        print(f"{PROG}: interrupted after the run: {kept}; the summary or plot is missing", file=sys.stderr)
        return 130
    return 0


def _stopped(exc: BaseException, kept: str) -> str:
    """The one stderr line of a run that stopped before it was complete."""
    if isinstance(exc, KeyboardInterrupt):
        return f"{PROG}: interrupted: {kept}"
    if isinstance(exc, OracleMismatch):
        return f"{PROG}: error: oracle check failed, nothing timed ({kept}): {exc}"
    if isinstance(exc, MemoryError):
        hint = "lower --steps, --batch-size, --num-heads, --head-dim or --repeats"
        return f"{PROG}: error: the run failed ({kept}): out of memory; {hint}"
    return f"{PROG}: error: the run failed ({kept}): {type(exc).__name__}: {exc}"


def check_cache_outputs(csv_path: Path, plot_path: Path | None) -> dict[str, Path]:
    """Check every file `cache` may write (the CSV, the files beside it, the plot); returns the side
    paths. Raises UsageError naming the flag and the path (`common.check_markdown_file` for a
    `<stem>.md` beside the CSV that no lab command wrote)."""
    side = cache_side_paths(csv_path)
    beside = f"--csv {str(csv_path)!r}: the file beside it"
    check_outputs(
        [("--csv", csv_path, (".csv",)), ("--plot", plot_path, (".png",))]
        + [(beside, path, ()) for path in side.values()]
    )
    check_side_files(
        "--csv",
        {
            side["memory"]: MEMORY_FIELDS,
            side["summary"]: SUMMARY_FIELDS,
            side["meta"]: (),
            side["memory_meta"]: (),
            side["markdown"]: (),
        },
    )
    check_markdown_file("--csv", csv_path)
    return side
