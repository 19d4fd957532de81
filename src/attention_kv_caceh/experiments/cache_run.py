"""The `cache` experiment as one recorded run: the raw per-step CSV through a `recorder.RunRecorder`,
and beside it the memory rows, their metadata and the summary, rewritten with every save.

    run = CacheRun(config, csv_path)
    with RunRecorder("cache-growth", csv_path, STEP_FIELDS, ..., before_save=run.before_save,
                     side_files=run.write_side_files) as recorder:
        recorder.meta["prediction"] = predict_slopes(config).to_json()
        recorder.save()
        record_cache_growth(run, recorder, progress)

`record_cache_growth` runs `cache_growth.run_cache_growth` (oracle, memory pass, warm-up, timed
passes), adding each recorded pass's rows to the recorder when the pass ends, and the rows of a pass
cut part-way (Ctrl-C, an error) before the recorder's final save. The statuses are those of the
files guide: an oracle mismatch is `oracle-failed` and any other error (running out of memory
included: `error: out of memory`) is `failed`, with the error recorded. Nothing here prints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from attention_kv_caceh.experiments import cache_growth
from attention_kv_caceh.experiments.cache_growth import CacheGrowthConfig
from attention_kv_caceh.experiments.cache_growth_stats import (
    SUMMARY_FIELDS,
    CacheMemoryRow,
    CacheStepSample,
    partial_passes,
    summarize_cache_growth,
    summary_rows,
)
from attention_kv_caceh.files import (
    markdown_path,
    meta_path,
    output_path,
    write_csv_atomic,
    write_json_atomic,
)
from attention_kv_caceh.options import check_options, option
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.recorder import RunRecorder

__all__ = [
    "MEMORY_FIELDS",
    "STEP_FIELDS",
    "CacheOptions",
    "CacheRun",
    "cache_side_paths",
    "record_cache_growth",
]

STEP_FIELDS: tuple[str, ...] = tuple(CacheStepSample.__dataclass_fields__)
MEMORY_FIELDS: tuple[str, ...] = tuple(CacheMemoryRow.__dataclass_fields__)


def cache_side_paths(csv_path: str | Path) -> dict[str, Path]:
    """Files a `cache` run writes beside its raw CSV: memory rows, summary, metadata, Markdown."""
    p = Path(csv_path)
    return {
        "memory": p.with_name(f"{p.stem}-memory.csv"),
        "summary": p.with_name(f"{p.stem}-summary.csv"),
        "meta": meta_path(p),
        "memory_meta": meta_path(p.with_name(f"{p.stem}-memory.csv")),
        "markdown": markdown_path(p),
    }


@dataclass(frozen=True)
class CacheOptions:
    """Where `cache` writes: the raw CSV (the files beside it follow its name) and the plot."""

    csv: Path = option(
        Path("results/cache.csv"),
        help="raw per-step CSV; <stem>-memory.csv, <stem>-summary.csv and their .meta.json go beside it",
        metavar="PATH.csv",
        parse=output_path(".csv"),
    )
    plot: Path | None = option(
        None,
        help="PNG: per-step time and bytes per step against T",
        metavar="PATH.png",
        parse=output_path(".png"),
        default_text="no plot",
    )

    def __post_init__(self) -> None:
        check_options(self)


@dataclass
class CacheRun:
    """One run's rows as they are measured: `samples` (timed steps) and `memory` (the memory pass);
    `added`: how many samples the recorder holds already."""

    config: CacheGrowthConfig
    csv_path: Path
    samples: list[CacheStepSample] = field(default_factory=lambda: list[CacheStepSample]())
    memory: list[CacheMemoryRow] = field(default_factory=lambda: list[CacheMemoryRow]())
    added: int = 0

    @property
    def side(self) -> dict[str, Path]:
        return cache_side_paths(self.csv_path)

    def meta_config(self) -> dict[str, Any]:
        """The metadata's config: the experiment, every field, and the positions the oracle checks
        (`oracle_steps` is empty for the default)."""
        return {"experiment": "cache", **asdict(self.config), "oracle_steps": self.config.checked_steps}

    def recorder(
        self,
        environment: dict[str, Any],
        kv_sizes: dict[str, Any],
        side_files: Callable[[RunRecorder], None] | None = None,
    ) -> RunRecorder:
        """The run's recorder: the raw CSV (STEP_FIELDS) and its metadata, kind "cache-growth"; the
        memory CSV, its metadata and the summary are its side files (`write_side_files`)."""
        files = {k: str(v) for k, v in self.side.items() if k != "meta"}
        return RunRecorder(
            "cache-growth",
            self.csv_path,
            STEP_FIELDS,
            config=self.meta_config(),
            environment=environment,
            extra={"kv_sizes": kv_sizes, "files": files},
            before_save=self.before_save,
            side_files=side_files,
        )

    def before_save(self, recorder: RunRecorder) -> None:
        """Row counts and the passes cut part-way, as the metadata records them."""
        cut = partial_passes(self.samples, self.memory)
        recorder.meta.update(
            timed_samples=len(self.samples), memory_rows=len(self.memory), partial_pass=bool(cut)
        )
        if cut:
            recorder.meta["partial_passes"] = cut

    def write_side_files(self, recorder: RunRecorder) -> None:
        """The memory CSV and its metadata (the run's, naming the timed file), and the summary CSV:
        header-only until the run is complete, so an earlier run's summary never sits beside these."""
        side = self.side
        write_csv_atomic(side["memory"], (asdict(m) for m in self.memory), MEMORY_FIELDS)
        memory_meta = {**recorder.meta, "kind": "cache-memory", "files": {"timed": str(self.csv_path)}}
        write_json_atomic(side["memory_meta"], memory_meta)
        complete = recorder.status == "complete"
        rows = summary_rows(summarize_cache_growth(self.samples, self.memory)) if complete else []
        write_csv_atomic(side["summary"], rows, SUMMARY_FIELDS)

    def add_new(self, recorder: RunRecorder, *, save: bool = True) -> None:
        """Give the recorder the samples taken since the last call."""
        recorder.add((asdict(s) for s in self.samples[self.added :]), save=save)
        self.added = len(self.samples)


def record_cache_growth(
    run: CacheRun, recorder: RunRecorder, progress: Callable[[int], object] | None = None
) -> None:
    """Run the experiment (`cache_growth.run_cache_growth`) into `recorder`, saving after the memory
    pass and each timed pass. On an oracle mismatch or any other error the run is finished here with
    its status (module docstring), every row kept, and the exception goes on; a Ctrl-C is left to the
    recorder's `with` block (`interrupted`)."""
    try:
        cache_growth.run_cache_growth(
            run.config,
            samples=run.samples,
            memory=run.memory,
            progress=progress,
            on_pass=lambda: run.add_new(recorder),
        )
    except OracleMismatch as exc:
        run.add_new(recorder, save=False)
        recorder.finish("oracle-failed", error=str(exc))
        raise
    except MemoryError:
        run.add_new(recorder, save=False)
        recorder.finish("failed", error="out of memory")
        raise
    except BaseException:
        run.add_new(recorder, save=False)
        raise
    run.add_new(recorder, save=False)
