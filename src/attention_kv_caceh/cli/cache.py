"""`attention-kv-caceh cache`: N decode steps over a Dynamic and a Preallocated KV cache.

Flags (`CacheGrowthConfig`, `ShapeOptions`, `cache_run.CacheOptions`) -> config -> up-front checks
(memory, every output) -> the run into a `RunRecorder` (`cache_run`: the predicted slopes on disk and
printed before anything is timed; oracle, memory pass, timed passes) -> print (`report.cache_text`).
"""

from __future__ import annotations

import argparse
import sys

from attention_kv_caceh.cli.common import PROG, check_memory, check_raw_outputs, warn_if_blas_unpinned
from attention_kv_caceh.cli.flags import add_shaped_options, config_from_args, shaped_config
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
    CacheOptions,
    CacheRun,
    cache_side_paths,
    record_cache_growth,
)
from attention_kv_caceh.files import atomic_write_text
from attention_kv_caceh.recorder import RunRecorder
from attention_kv_caceh.report.cache_text import (
    cache_live_markdown,
    kept_text,
    result_text,
    setup_lines,
    stop_line,
)
from attention_kv_caceh.report.outcome import cache_prediction_card, outcome_json
from attention_kv_caceh.timing import capture_environment

__all__ = ["CACHE_DEFAULTS", "HELP", "add_arguments", "cache_config", "run"]

HELP = "decode N steps over a Dynamic and a Preallocated KV cache: per-step time and memory"
CACHE_DEFAULTS = CacheGrowthConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `cache`: the fields of CacheOptions, CacheGrowthConfig and ShapeOptions."""
    d = CACHE_DEFAULTS
    add_shaped_options(
        parser, CacheGrowthConfig, CacheOptions, ("steps", "batch_size"), d.num_heads, d.head_dim
    )


def cache_config(args: argparse.Namespace) -> CacheGrowthConfig:
    """The validated config (`flags.shaped_config`). Raises UsageError naming the flag for a value the
    config rejects (--steps below 2: its flag's parse)."""
    return shaped_config(CacheGrowthConfig, args, CACHE_DEFAULTS.num_heads, CACHE_DEFAULTS.head_dim)


def run(args: argparse.Namespace) -> int:
    """Run the cache-growth experiment and write its files (docs/files.md); returns the exit code: 0
    done, 1 oracle failure or runtime error, 130 Ctrl-C, each with one line on stderr. Raises
    UsageError for invalid flags, an output that cannot be written, or a run too large for this
    machine's memory, before any file is touched."""
    config, options = cache_config(args), config_from_args(CacheOptions, args)
    side = cache_side_paths(options.csv)
    headers = {"memory": MEMORY_FIELDS, "summary": SUMMARY_FIELDS}
    check_raw_outputs(
        options.csv,
        {path: headers.get(key, ()) for key, path in side.items()},
        ("--plot", options.plot, (".png",)),
    )
    check_memory(
        estimate_run_bytes(config),
        f"this run (N={config.steps}, B={config.batch_size}, H={config.num_heads}, "
        f"H_kv={config.num_kv_heads}, D={config.head_dim}, {config.dtype}, {config.repeats} repeats)",
        "--steps, --batch-size, --num-heads, --num-kv-heads, --head-dim or --repeats",
    )
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

    tty = sys.stderr.isatty()
    bar = tqdm(total=total_steps(config), unit="step", file=sys.stderr, disable=not tty, desc="cache growth")
    try:
        with state.recorder(environment, card, side_files) as recorder:
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
            stop_line(PROG, exc, kept_text(state.samples, state.memory, options.csv, side["memory"])),
            file=sys.stderr,
        )
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    kept = kept_text(state.samples, state.memory, options.csv, side["memory"])
    try:
        print(result_text(summary, outcome, config.steps, state.samples, state.memory, side))
        if options.plot is not None:
            from attention_kv_caceh.report.plots import plot_cache_growth

            plot_cache_growth(state.samples, state.memory, options.plot)
            print(f"wrote {options.plot}")
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted after the run: {kept}; the summary or plot is missing", file=sys.stderr)
        return 130
    return 0
