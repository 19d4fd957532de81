"""The text `bench-engine` prints: its tables, the load line, the header and the JSON line for scripts.

The rows are `benchmarks.engine.EngineBenchRow` (without speculation) or `benchmarks.spec_decode.
SpecBenchRow` (with), as dicts; the JSON line's keys are read by scripts (docs/files.md): keep its shape.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attention_kv_caceh.benchmarks.bench_engine import BenchEngineConfig

__all__ = [
    "format_load",
    "format_rows",
    "format_spec_rows",
    "header_line",
    "summary",
    "summary_json",
    "threads_line",
]


def header_line(config: BenchEngineConfig, longest: int | None = None) -> str:
    """The first line: the benchmark, its requests (`longest`: the longest prompt of the comparison with
    speculation), max_num_seqs, dtype, sampling and seed, and the speculative config and pairs."""
    c, spec = config, config.speculative_config
    if spec is None:
        what = (
            f"engine benchmark: {c.model}, {c.prompt_len} prompt + {c.output_len} output tokens per request"
        )
    else:
        what = (
            f"speculative decoding benchmark: {c.model}, {c.workload} workload ({longest} prompt tokens at "
            f"most) + {c.output_len} output tokens per request"
        )
    line = (
        f"{what}, max_num_seqs {c.sizes}, {c.dtype}"
        + (f" with {c.quantization} weights" if c.quantization else "")
        + (f", {c.activations or 'int8'} activations against the blocks" if c.quantization else "")
        + ", "
        + ("greedy (temperature 0)" if c.temperature == 0 else f"temperature {c.temperature}")
        + f", seed {c.seed}"
    )
    return line if spec is None else f"{line}; {spec.to_json()}; {c.pairs} pair(s) without / with drafts"


def summary(sizes: list[int], rows: list[dict[str, Any]], speculative: bool) -> dict[str, list[Any]]:
    """The last stdout line's object: `{"max_num_seqs", "output_tokens_per_s"}`, and with speculation
    the values without it, TPOT and acceptance (NaN as null, so the line is strict JSON)."""
    if not speculative:
        return {"max_num_seqs": sizes, "output_tokens_per_s": [r["output_tokens_per_s"] for r in rows]}
    return summary_json(
        {
            "max_num_seqs": sizes,
            "output_tokens_per_s": [r["output_tokens_per_s_on"] for r in rows],
            "output_tokens_per_s_without_speculation": [r["output_tokens_per_s_off"] for r in rows],
            "tpot_ms": [r["tpot_ms_on"] for r in rows],
            "tpot_ms_without_speculation": [r["tpot_ms_off"] for r in rows],
            "acceptance_rate": [r["acceptance_rate"] for r in rows],
            "acceptance_length": [r["acceptance_length"] for r in rows],
        }
    )


def format_rows(rows: list[dict[str, Any]]) -> str:
    """Fixed-width table of `EngineBenchRow`s (as dicts); the batching gain on the last line. `threads`
    is the row's mean_threads: the threads its timed decode steps computed on, on average."""
    header = (
        f"{'max_num_seqs':>12}{'threads':>8}{'out tok/s':>11}{'decode tok/s':>13}{'step p50 ms':>12}{'step p95 ms':>12}"
        f"{'cpu p50 ms':>11}{'MB/step':>9}{'weight MB':>10}{'GB/s':>7}{'probe GB/s':>11}{'ratio':>7}"
        f"{'linear %':>9}{'attn %':>7}{'GFLOP/s':>9}{'FMA GFLOP/s':>12}{'ratio':>7}  {'kernel'}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['max_num_seqs']:>12}{r.get('mean_threads', r.get('threads', 1)):>8.2f}{r['output_tokens_per_s']:>11.1f}{r['decode_tokens_per_s']:>13.1f}"
            f"{r['decode_step_ms_p50']:>12.2f}{r['decode_step_ms_p95']:>12.2f}{r['decode_step_cpu_ms_p50']:>11.2f}"
            f"{r['bytes_per_decode_step'] / 1e6:>9.1f}{r['weight_bytes_per_decode_step'] / 1e6:>10.1f}"
            f"{r['decode_gb_per_s']:>7.2f}"
            f"{r['probe_gb_per_s']:>11.2f}{r['probe_ratio']:>7.2f}"
            f"{100 * r['linear_share']:>9.0f}{100 * r['attention_share']:>7.0f}{r['linear_gflop_per_s']:>9.1f}{r['fma_gflop_per_s']:>12.1f}"
            f"{r['fma_ratio']:>7.2f}  {r['gemm_kernel']}"
        )
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        gain = last["output_tokens_per_s"] / first["output_tokens_per_s"]
        lines.append(
            f"batching gain: {gain:.2f}x output tokens/s at max_num_seqs {last['max_num_seqs']} "
            f"over {first['max_num_seqs']}"
        )
    return "\n".join(lines)


def threads_line(note: str, given: bool) -> str:
    """The line above a table: `cpus.threads_note`'s, and for the default count that it follows the load."""
    if given:
        return note
    from attention_kv_caceh.cpu_load import FOLLOWS_LOAD

    return f"{note}; {FOLLOWS_LOAD} (`threads` column: the steps' mean)"


def format_load(environment: dict[str, Any], path: Path, open_s: float) -> str:
    """One line: how long opening the checkpoint (`open_s`: its config; a GGUF file's metadata and tensor
    table) and loading its weights took, the resident memory before and after the load, the weights'
    bytes in memory (engine dtype) and on disk (the GGUF file, or the folder's safetensors files)."""
    from attention_kv_caceh.memory import format_bytes

    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    on_disk = sum(f.stat().st_size for f in files)
    before, after = environment.get("rss_before_load_bytes"), environment.get("rss_after_load_bytes")
    rss = "-" if before is None or after is None else f"{format_bytes(before)} -> {format_bytes(after)}"
    return (
        f"checkpoint opened in {open_s:.2f} s, weights loaded in {environment['load_s']:.2f} s (read, "
        f"dequantize, pack); resident memory {rss}; "
        f"weights read per decode step {format_bytes(environment['weight_bytes'])} as "
        f"{environment.get('weight_format', environment['dtype'])} "
        f"({format_bytes(on_disk)} on disk)"
    )


def format_spec_rows(rows: list[dict[str, Any]]) -> str:
    """Fixed-width table of `SpecBenchRow`s (as dicts), one line of per-position acceptance after each."""
    header = (
        f"{'max_num_seqs':>12}{'prompt':>7}{'tok/s off':>10}{'tok/s on':>9}{'ratio':>6}{'cpu':>6}"
        f"{'TPOT off ms':>12}{'TPOT on ms':>11}{'ratio':>6}{'decode ms':>10}{'verify ms':>10}{'rows':>6}"
        f"{'cost':>6}{'drafts %':>9}{'accept %':>9}{'accept len':>11}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['max_num_seqs']:>12}{r['mean_prompt_len']:>7.0f}{r['output_tokens_per_s_off']:>10.1f}"
            f"{r['output_tokens_per_s_on']:>9.1f}{r['tok_s_ratio']:>6.2f}{r['cpu_tok_s_ratio']:>6.2f}"
            f"{r['tpot_ms_off']:>12.2f}"
            f"{r['tpot_ms_on']:>11.2f}{r['tpot_ratio']:>6.2f}{r['decode_step_ms_p50']:>10.2f}"
            f"{r['verify_step_ms_p50']:>10.2f}{r['verify_rows_mean']:>6.1f}{r['verify_cost']:>6.2f}"
            f"{100 * r['draft_step_share']:>9.0f}{100 * r['acceptance_rate']:>9.1f}{r['acceptance_length']:>11.2f}"
        )
        per_pos = ", ".join(f"{p:.2f}" for p in r["per_position_acceptance_rates"])
        lines.append(
            f"{'':>12}  {r['num_drafts']} drafts, {r['num_draft_tokens']} draft tokens, "
            f"{r['num_accepted_tokens']} accepted; per position {per_pos}"
        )
    return "\n".join(lines)


def summary_json(summary: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """`summary` with NaN (no draft, no acceptance) as null, so the line is strict JSON."""
    return {
        k: [None if isinstance(v, float) and math.isnan(v) else v for v in vs] for k, vs in summary.items()
    }
