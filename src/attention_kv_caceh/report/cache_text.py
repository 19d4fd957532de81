"""The `cache` experiment's words: the lines before the run, the summary it prints, what a run cut
short kept, and the Markdown it rewrites beside its raw CSV (`predictions.cache_run_markdown`, the
section `report` renders from the raw files)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attention_kv_caceh.experiments.cache_growth import CacheGrowthConfig
from attention_kv_caceh.experiments.cache_growth_stats import (
    CACHE_KINDS,
    CacheGrowthSummary,
    CacheMemoryRow,
    CacheStepSample,
    partial_passes,
)
from attention_kv_caceh.experiments.cache_prediction import CacheOutcome
from attention_kv_caceh.memory import format_bytes
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.report.outcome import outcome_text
from attention_kv_caceh.report.predictions import cache_run_markdown
from attention_kv_caceh.tables import text_table

__all__ = [
    "cache_live_markdown",
    "format_cache_summary",
    "kept_text",
    "result_text",
    "setup_lines",
    "stop_line",
]


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
    samples: Sequence[CacheStepSample],
    memory: Sequence[CacheMemoryRow],
    csv_path: str | Path,
    memory_path: Path,
) -> str:
    """What a cut-short run kept on disk: its row counts and files, and the passes cut part-way."""
    cut = partial_passes(samples, memory)
    return (
        f"kept {len(samples)} timed samples in {csv_path} and {len(memory)} memory rows in "
        f"{memory_path}" + (f" (cut part-way: {', '.join(cut)})" if cut else "")
    )


def format_cache_summary(summary: CacheGrowthSummary, steps: int) -> str:
    """Fixed-width text of a cache-growth summary (what `cache` prints)."""
    checkpoints = [
        [
            str(int(c["sequence_length"])),
            f"{c['dynamic_p50_ms']:.4f}",
            f"{c['preallocated_p50_ms']:.4f}",
            f"{c['ratio']:.2f}",
        ]
        for c in summary.checkpoints
    ]
    fits = [
        [
            kind,
            f"{f.slope_ms_per_position * 1000:.4f}",
            f"{f.intercept_ms:.4f}",
            f"{f.r2:.3f}",
            f"{f.r2_raw:.3f}",
            f"{summary.totals[kind]['p50_ms']:.1f}",
        ]
        for kind, f in ((k, summary.fits[k]) for k in CACHE_KINDS)
    ]
    lines = [
        text_table(["T", "dynamic P50 ms", "prealloc P50 ms", "ratio"], checkpoints),
        "",
        text_table(["cache", "slope us/pos", "intercept ms", "R^2", "R^2 raw", "N-step P50 ms"], fits),
    ]
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
            f"{kind}: append allocates {format_bytes(m['append_bytes_first_step'])} at T=1, "
            f"{format_bytes(m['append_bytes_last_step'])} at T={int(m['final_sequence_length'])} "
            f"({m['append_bytes_per_position']:.1f} B/position traced peak; new buffers "
            f"{m['new_buffer_bytes_per_position']:.1f} B/position); nbytes "
            f"{format_bytes(m['final_cache_nbytes'])} vs theoretical {format_bytes(m['final_theoretical_bytes'])}"
            f" for T={int(m['final_sequence_length'])}; largest step peak {format_bytes(m['max_step_peak_bytes'])}"
        )
    return "\n".join(lines)


def cache_live_markdown(
    csv_path: str | Path,
    samples: list[CacheStepSample],
    memory: list[CacheMemoryRow],
    meta: Mapping[str, Any],
) -> str:
    """The run's Markdown (`report.predictions.cache_run_markdown`, as `report` renders it from the
    raw files) with a status line once it is complete; before, the status alone."""
    name = Path(csv_path).name
    if meta["status"] != "complete":
        return f"### KV-cache growth: `{name}`\n\nStatus: {meta['status']}; no summary yet.\n"
    text = cache_run_markdown(name, samples, memory, meta, [])
    return text.replace("\n\n", "\n\nStatus: complete.\n\n", 1)


def result_text(
    summary: CacheGrowthSummary,
    outcome: CacheOutcome,
    steps: int,
    samples: Sequence[CacheStepSample],
    memory: Sequence[CacheMemoryRow],
    side: Mapping[str, Path],
) -> str:
    """What `cache` prints after a complete run: the summary, the predicted slopes against the fitted
    ones, and the files it wrote (`side`: `cache_run.cache_side_paths` of the raw CSV)."""
    csv = side["meta"].with_name(side["meta"].name.removesuffix(".meta.json"))
    return (
        f"{format_cache_summary(summary, steps)}\n\n{outcome_text(outcome)}\n\n"
        f"wrote {csv} ({len(samples)} rows), {side['memory']} ({len(memory)} rows), "
        f"{side['summary']}, {side['meta']}, {side['memory_meta']}, {side['markdown']}"
    )


def stop_line(prog: str, exc: BaseException, kept: str) -> str:
    """The one stderr line of a run that stopped before it was complete (`kept`: `kept_text`)."""
    if isinstance(exc, KeyboardInterrupt):
        return f"{prog}: interrupted: {kept}"
    if isinstance(exc, OracleMismatch):
        return f"{prog}: error: oracle check failed, nothing timed ({kept}): {exc}"
    if isinstance(exc, MemoryError):
        hint = "lower --steps, --batch-size, --num-heads, --head-dim or --repeats"
        return f"{prog}: error: the run failed ({kept}): out of memory; {hint}"
    return f"{prog}: error: the run failed ({kept}): {type(exc).__name__}: {exc}"
