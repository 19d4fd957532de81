"""What `attention-kv-caceh cache` writes and prints around its run: the files beside its raw CSV and
their up-front checks, the setup lines and the line naming what was kept.

Paths, checks and text only: nothing timed, written or printed here; `cli/cache.py` runs the
experiment and prints these lines (as `cli/scan_output.py` does for the scan).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attention_kv_caceh.cli.common import check_outputs, check_side_files
from attention_kv_caceh.experiments.cache_growth import CacheGrowthConfig
from attention_kv_caceh.experiments.cache_growth_stats import (
    SUMMARY_FIELDS,
    CacheMemoryRow,
    CacheStepSample,
    partial_passes,
)
from attention_kv_caceh.files import meta_path
from attention_kv_caceh.memory import format_bytes

__all__ = ["cache_side_paths", "check_cache_outputs", "kept_text", "setup_lines"]


def cache_side_paths(csv_path: str | Path) -> dict[str, Path]:
    """Files a `cache` run writes beside its raw CSV: memory rows, summary and metadata."""
    p = Path(csv_path)
    return {
        "memory": p.with_name(f"{p.stem}-memory.csv"),
        "summary": p.with_name(f"{p.stem}-summary.csv"),
        "meta": meta_path(p),
        "memory_meta": meta_path(p.with_name(f"{p.stem}-memory.csv")),
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
