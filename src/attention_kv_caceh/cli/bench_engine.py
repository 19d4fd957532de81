"""`attention-kv-caceh bench-engine`: output tokens/s and decode step time of the engine at several max_num_seqs.

Runs `benchmarks.engine.run_engine_benchmark` (through `benchmarks.bench_engine.bench_engine`) (random token-id prompts, ignore_eos, all requests
submitted at once, as vLLM's offline throughput benchmark does; greedy unless --temperature is above 0,
then every request samples with its own generator seeded with --seed) and prints one row per max_num_seqs
(with `--threads 1 2 ...`: one table per thread count, then the thread table of
`benchmarks.thread_table`: tokens/s, step P50 and the bytes a step reads against the read probe on as
many threads; the JSON line then holds threads too):
output tokens/s, the decode step's P50/P95 (wall) and P50 of the CPU time (what a shared machine's
other processes do not change), the bytes one decode step reads (every weight once plus
the KV cache of every running request) and that rate against the same run's read probe, then the
linear layers: their share of the step (replayed alone), their FLOP/s and that against the same run's
FMA probe, and the kernel they ran (the line above the table names the path and the instruction set). The last line is the
batching gain: output tokens/s at the largest max_num_seqs over the smallest. Then one more line,
a JSON object for scripts (they read it; keep its shape): `{"max_num_seqs": [...],
"output_tokens_per_s": [...]}`, one value per row in the table's order. Before anything is timed,
request 0 run alone must give the same tokens as in the batch (its first min(4, --output-len)
tokens; exit 1 otherwise).

With `--speculative-config`, the run compares speculative decoding instead
(`benchmarks.spec_decode.run_spec_benchmark`): per max_num_seqs, the same requests without and with
n-gram drafts (`--pairs` alternating pairs, medians), one row each: output tokens/s and TPOT of both and
their ratios (and the ratio of output tokens per CPU second of the engine steps, which a shared
machine's load moves less), the decode step without drafts and the step that verifies them (rows, time, their ratio:
the cost of verification), then vLLM's acceptance rate and mean acceptance length; a line per row gives
the per-position acceptance rates. `--workload copy` takes copy-heavy prompts
(`harness.copy_workload`, "repeat this passage with one change") instead of random token ids: a
passage of at least --prompt-len words and the instruction around it. The tokens with drafts must equal those without (exit 1
otherwise). The JSON line then also holds the values without speculation, TPOT and acceptance.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from attention_kv_caceh.benchmarks.bench_engine import BenchEngineConfig
from attention_kv_caceh.cli.common import (
    CommandFailed,
    UsageError,
    check_outputs,
    warn_if_blas_unpinned,
    warn_if_threads_busy,
)
from attention_kv_caceh.cli.engine_args import (
    add_engine_arguments,
    model_source,
    open_checkpoint,
)
from attention_kv_caceh.cli.flags import add_options, config_from_args
from attention_kv_caceh.cpus import threads_note
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.report import engine_bench as text

__all__ = ["HELP", "add_arguments", "run"]

HELP = (
    "engine throughput: output tokens/s and decode step time at several max_num_seqs, vs a read probe; "
    "the last stdout line is JSON for scripts ({max_num_seqs, output_tokens_per_s})"
)

_ENGINE = (
    "max_num_batched_tokens",
    "block_size",
    "dtype",
    "quantization",
    "activations",
    "speculative_config",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench-engine`: BenchEngineConfig's fields and the engine flags it takes (`_ENGINE`)."""
    add_options(parser, BenchEngineConfig, only=("model", "max_num_seqs", "prompt_len", "output_len"))
    group = parser.add_argument_group("engine (the KV pool is sized to the requests; prefix caching off)")
    add_engine_arguments(group, only=_ENGINE)
    add_options(
        parser,
        BenchEngineConfig,
        only=("workload", "pairs", "gemm", "temperature", "seed", "json", "threads"),
    )


def run(args: argparse.Namespace) -> int:
    """Check flags and outputs (UsageError, a --model naming no checkpoint or one whose config or
    tokenizer the engine cannot read included) before printing anything; run the benchmark, print the
    table; CommandFailed on a checkpoint whose weights cannot be read, a failed oracle or an unwritable
    --json."""
    engine = {name: getattr(args, name) for name in _ENGINE}
    config = config_from_args(
        BenchEngineConfig,
        args,
        EngineConfig,
        max_num_seqs=tuple(args.max_num_seqs),
        threads=None if args.threads is None else tuple(args.threads),
        **engine,
    )
    source = model_source(config.model)
    check_outputs([("--json", config.json, (".json",))], [("--model", str(source.path))])

    from attention_kv_caceh.benchmarks.bench_engine import bench_engine, spec_prompts
    from attention_kv_caceh.files import write_json_atomic
    from attention_kv_caceh.kernels.dispatch import resolve_gemm_path
    from attention_kv_caceh.model_executor.checkpoint import CheckpointError
    from attention_kv_caceh.oracle import OracleMismatch

    # plan_engine's checks of the checkpoint (open_checkpoint); not plan_engine itself: the benchmark
    # sizes one KV pool per max_num_seqs to its requests (no --max-model-len, --num-kv-blocks or
    # --kv-cache-memory), so the pool and context checks below are its own
    model_config, tokenizer, open_s = open_checkpoint(source, config.quantization, config.model)
    try:
        note = resolve_gemm_path(config.gemm, config.dtype, config.quantization).note
        EngineConfig(dtype=config.dtype, quantization=config.quantization)
    except ValueError as exc:
        raise UsageError(
            f"--gemm {config.gemm} --dtype {config.dtype} --quantization {config.quantization}: {exc}"
        ) from None
    limit = model_config.max_position_embeddings
    if config.prompt_len + config.output_len > limit:
        raise UsageError(
            f"--prompt-len {config.prompt_len} + --output-len {config.output_len} exceed the model's "
            f"max_position_embeddings {limit}"
        )
    spec = config.speculative_config
    if spec is None and (config.workload != "random" or config.pairs != 1):
        flag = "--workload" if config.workload != "random" else "--pairs"
        raise UsageError(f"{flag} needs --speculative-config (it shapes the comparison with speculation)")
    warn_if_blas_unpinned()
    warn_if_threads_busy("bench-engine", config.threads or ())
    prompts, longest = None, None
    if spec is not None:
        prompts = spec_prompts(config, model_config, tokenizer)
        longest = max(len(p) for p in prompts)
        total = longest + config.output_len + spec.num_speculative_tokens + 1
        if total > limit:
            raise UsageError(
                f"prompts of up to {longest} tokens + --output-len {config.output_len} + K "
                f"{spec.num_speculative_tokens} exceed the model's max_position_embeddings {limit}"
            )
        try:  # the benchmark's engines hold exactly the longest request (`run_spec_benchmark`)
            spec.check_fits(total)
        except ValueError as exc:
            raise UsageError(f"--speculative-config: {exc}") from None
    print(text.header_line(config, longest), flush=True)
    print(note, flush=True)
    try:
        result = bench_engine(config, source.path, tokenizer, prompts)
    except (CheckpointError, OracleMismatch) as exc:
        raise CommandFailed(str(exc)) from None
    if spec is None:
        print(text.format_load(result.environment, source.path, open_s))
        for count in config.threads or (None,):
            rows = [r for r in result.rows if count is None or r["threads"] == count]
            print(text.threads_line(threads_note(rows[0]["threads"]), given=count is not None))
            print(text.format_rows(rows))
        if config.threads is not None:
            print(format_thread_table(result.rows))
    else:
        print(text.format_spec_rows(result.rows))
    if config.json:
        try:
            write_json_atomic(config.json, {"environment": result.environment, "rows": result.rows})
        except OSError as exc:
            raise CommandFailed(f"could not write --json {config.json}: {exc}") from None
    if config.threads is None:
        print(json.dumps(text.summary(config.sizes, result.rows, speculative=spec is not None)))
    else:
        summary = {
            key: [r[key] for r in result.rows] for key in ("threads", "max_num_seqs", "output_tokens_per_s")
        }
        print(json.dumps(summary))
    return 0


def format_thread_table(rows: list[dict[str, Any]]) -> str:
    """The thread table: per (threads, max_num_seqs), output tokens/s, the decode step's P50, the bytes
    it reads, their rate and the read probe's at that thread count, and the ratio."""
    from attention_kv_caceh.benchmarks.thread_table import thread_table_rows

    lines = [
        "thread table: the read probe on as many threads as the engine",
        f"{'threads':>7} {'seqs':>5} {'tok/s':>9} {'step P50 ms':>11} {'MB/step':>9} {'GB/s':>7} "
        f"{'probe GB/s':>10} {'vs probe':>8}",
    ]
    for r in thread_table_rows(rows):
        lines.append(
            f"{r['threads']:>7} {r['max_num_seqs']:>5} {r['output_tokens_per_s']:>9.1f} "
            f"{r['decode_step_ms_p50']:>11.2f} {r['bytes_per_decode_step'] / 1e6:>9.1f} "
            f"{r['decode_gb_per_s']:>7.2f} {r['probe_gb_per_s']:>10.2f} {r['probe_ratio']:>8.2f}"
        )
    return "\n".join(lines)
