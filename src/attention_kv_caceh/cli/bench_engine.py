"""`attention-kv-caceh bench-engine`: output tokens/s and decode step time of the engine at several max_num_seqs.

Runs `benchmarks.engine.run_engine_benchmark` (random token-id prompts, ignore_eos, all requests
submitted at once, as vLLM's offline throughput benchmark does; greedy unless --temperature is above 0,
then every request samples with its own generator seeded with --seed) and prints one row per max_num_seqs:
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
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attention_kv_caceh.cli.common import (
    CommandFailed,
    UsageError,
    check_outputs,
    nonnegative_float,
    positive_int,
    seed_int,
    warn_if_blas_unpinned,
)
from attention_kv_caceh.cli.engine_args import (
    MODEL_HELP,
    MODEL_METAVAR,
    add_engine_arguments,
    load_model_config,
    model_source,
)

if TYPE_CHECKING:
    from attention_kv_caceh.engine.model_config import ModelConfig

__all__ = ["HELP", "add_arguments", "format_rows", "run"]

HELP = (
    "engine throughput: output tokens/s and decode step time at several max_num_seqs, vs a read probe; "
    "the last stdout line is JSON for scripts ({max_num_seqs, output_tokens_per_s})"
)


def _at_least_two(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 (one prefill token and one decode step), got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench-engine`: --model, --max-num-seqs, --prompt-len, --output-len, --gemm, --temperature,
    --seed, --json,
    and the engine flags --max-num-batched-tokens, --block-size, --dtype."""
    parser.add_argument("--model", required=True, metavar=MODEL_METAVAR, help=MODEL_HELP)
    parser.add_argument(
        "--max-num-seqs",
        type=positive_int,
        nargs="+",
        default=[1, 4, 16, 32],
        metavar="N",
        help="one run per value, each with N requests at once",
    )
    parser.add_argument("--prompt-len", type=positive_int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=_at_least_two, default=128, help="output tokens per request")
    add_engine_arguments(
        parser.add_argument_group("engine (the KV pool is sized to the requests; prefix caching off)"),
        only=("max_num_batched_tokens", "block_size", "dtype", "quantization", "speculative_config"),
    )
    parser.add_argument(
        "--workload",
        choices=("random", "copy"),
        default="random",
        help="with --speculative-config: random token ids, or copy-heavy prompts (repeat a passage with "
        "one change)",
    )
    parser.add_argument(
        "--pairs",
        type=positive_int,
        default=1,
        metavar="N",
        help="with --speculative-config: alternating runs without and with drafts per max_num_seqs (medians)",
    )
    parser.add_argument(
        "--gemm",
        choices=("auto", "packed", "numpy"),
        default="auto",
        help="linear layers: auto (packed where the CPU has AVX-512, AVX2 or NEON and activations are "
        "float32, else numpy), packed (the compiled kernel of that instruction set; to run the AVX2 "
        "one on an AVX-512 CPU, set NUMBA_CPU_NAME=znver3 NUMBA_CPU_FEATURES= ), or numpy (x @ W.T)",
    )
    parser.add_argument(
        "--temperature",
        metavar="T",
        type=nonnegative_float,
        default=0.0,
        help="sampling temperature of every request; 0 is greedy (a serve request without temperature "
        "samples at 1.0)",
    )
    parser.add_argument(
        "--seed",
        type=seed_int,
        default=0,
        help="seed of the random prompts and of every request's sampling generator",
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="PATH.json",
        help="rows and environment as JSON (default: not written)",
    )


def format_rows(rows: list[dict[str, Any]]) -> str:
    """Fixed-width table of `EngineBenchRow`s (as dicts); the batching gain on the last line."""
    header = (
        f"{'max_num_seqs':>12}{'out tok/s':>11}{'decode tok/s':>13}{'step p50 ms':>12}{'step p95 ms':>12}"
        f"{'cpu p50 ms':>11}{'MB/step':>9}{'weight MB':>10}{'GB/s':>7}{'probe GB/s':>11}{'ratio':>7}"
        f"{'linear %':>9}{'attn %':>7}{'GFLOP/s':>9}{'FMA GFLOP/s':>12}{'ratio':>7}  {'kernel'}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['max_num_seqs']:>12}{r['output_tokens_per_s']:>11.1f}{r['decode_tokens_per_s']:>13.1f}"
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


def run(args: argparse.Namespace) -> int:
    """Check flags and outputs (UsageError, a --model naming no checkpoint or one whose config or
    tokenizer the engine cannot read included), before printing anything; run the benchmark, print the table; CommandFailed on a checkpoint whose weights
    cannot be read, a failed oracle or an unwritable --json."""
    source = model_source(args.model)
    check_outputs([("--json", args.json, (".json",))], [("--model", str(source.path))])

    from attention_kv_caceh.benchmarks.engine import run_engine_benchmark
    from attention_kv_caceh.engine.checkpoint import CheckpointError
    from attention_kv_caceh.engine.model import resolve_gemm_path
    from attention_kv_caceh.engine.tokenizer import Tokenizer

    opened = time.perf_counter()
    try:
        _, config = load_model_config(source.path)  # parses a GGUF file once; Model.load reuses it
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    open_s = time.perf_counter() - opened
    try:  # the requests stream text as a server's do: a tokenizer is checked before any weight is read
        tokenizer = Tokenizer.load(source.path)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    model = source.path
    if args.max_num_batched_tokens < max(args.max_num_seqs):
        raise UsageError(
            f"--max-num-batched-tokens {args.max_num_batched_tokens} must be >= every --max-num-seqs "
            f"(largest {max(args.max_num_seqs)}) so every running request can decode in one step"
        )
    from attention_kv_caceh.engine.config import EngineConfig

    try:
        resolve_gemm_path(args.gemm, args.dtype, args.quantization)
        EngineConfig(dtype=args.dtype, quantization=args.quantization)
    except ValueError as exc:
        raise UsageError(
            f"--gemm {args.gemm} --dtype {args.dtype} --quantization {args.quantization}: {exc}"
        ) from None
    if args.quantization == "gguf" and source.format != "gguf":
        raise UsageError(
            f"--quantization gguf keeps a GGUF file's blocks; --model {args.model} is not a GGUF file"
        )
    if args.prompt_len + args.output_len > config.max_position_embeddings:
        raise UsageError(
            f"--prompt-len {args.prompt_len} + --output-len {args.output_len} exceed the model's "
            f"max_position_embeddings {config.max_position_embeddings}"
        )
    if args.speculative_config is None and (args.workload != "random" or args.pairs != 1):
        flag = "--workload" if args.workload != "random" else "--pairs"
        raise UsageError(f"{flag} needs --speculative-config (it shapes the comparison with speculation)")
    warn_if_blas_unpinned()
    if args.speculative_config is not None:
        return _run_speculative(args, model, config)
    from attention_kv_caceh.files import write_json_atomic
    from attention_kv_caceh.oracle import OracleMismatch

    sizes = sorted(set(args.max_num_seqs))
    print(
        f"engine benchmark: {args.model}, {args.prompt_len} prompt + {args.output_len} output tokens "
        f"per request, max_num_seqs {sizes}, {args.dtype}"
        + (f" with {args.quantization} weights" if args.quantization else "")
        + ", "
        + ("greedy (temperature 0)" if args.temperature == 0 else f"temperature {args.temperature}")
        + f", seed {args.seed}",
        flush=True,
    )
    print(resolve_gemm_path(args.gemm, args.dtype, args.quantization)[1], flush=True)
    try:
        result = run_engine_benchmark(
            model,
            sizes,
            args.prompt_len,
            args.output_len,
            args.dtype,
            args.seed,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            tokenizer=tokenizer,
            gemm=args.gemm,
            temperature=args.temperature,
            quantization=args.quantization,
        )
    except (CheckpointError, OracleMismatch) as exc:
        raise CommandFailed(str(exc)) from None
    rows = [asdict(row) for row in result.rows]
    print(format_load(result.environment, source.path, open_s))
    print(format_rows(rows))
    if args.json:
        try:
            write_json_atomic(args.json, {"environment": result.environment, "rows": rows})
        except OSError as exc:
            raise CommandFailed(f"could not write --json {args.json}: {exc}") from None
    print(
        json.dumps({"max_num_seqs": sizes, "output_tokens_per_s": [r["output_tokens_per_s"] for r in rows]})
    )
    return 0


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


def _run_speculative(args: argparse.Namespace, model: Path, config: ModelConfig) -> int:
    """The comparison with and without speculation (module docstring)."""
    import numpy as np

    from attention_kv_caceh.benchmarks.spec_decode import run_spec_benchmark
    from attention_kv_caceh.engine.checkpoint import CheckpointError
    from attention_kv_caceh.engine.model import resolve_gemm_path
    from attention_kv_caceh.engine.tokenizer import Tokenizer
    from attention_kv_caceh.files import write_json_atomic
    from attention_kv_caceh.harness.copy_workload import copy_prompts
    from attention_kv_caceh.oracle import OracleMismatch

    spec = args.speculative_config
    sizes = sorted(set(args.max_num_seqs))
    if args.workload == "copy":
        tokenizer = Tokenizer.load(model)
        prompts = [tokenizer.encode(text) for text in copy_prompts(max(sizes), args.seed, args.prompt_len)]
    else:
        rng = np.random.default_rng(args.seed)
        prompts = rng.integers(0, config.vocab_size, size=(max(sizes), args.prompt_len)).tolist()
    longest = max(len(p) for p in prompts)
    if longest + args.output_len + spec.num_speculative_tokens + 1 > config.max_position_embeddings:
        raise UsageError(
            f"prompts of up to {longest} tokens + --output-len {args.output_len} + K "
            f"{spec.num_speculative_tokens} exceed the model's max_position_embeddings {config.max_position_embeddings}"
        )
    try:  # the benchmark's engines hold exactly the longest request (`run_spec_benchmark`)
        spec.check_fits(longest + args.output_len + spec.num_speculative_tokens + 1)
    except ValueError as exc:
        raise UsageError(f"--speculative-config: {exc}") from None
    sampling = "greedy (temperature 0)" if args.temperature == 0 else f"temperature {args.temperature}"
    print(
        f"speculative decoding benchmark: {args.model}, {args.workload} workload ({longest} prompt tokens "
        f"at most) + {args.output_len} output tokens per request, max_num_seqs {sizes}, {args.dtype}"
        + (f" with {args.quantization} weights" if args.quantization else "")
        + f", {sampling}, seed {args.seed}; {spec.to_json()}; {args.pairs} pair(s) without / with drafts",
        flush=True,
    )
    print(resolve_gemm_path(args.gemm, args.dtype, args.quantization)[1], flush=True)
    try:
        rows, environment = run_spec_benchmark(
            model,
            spec,
            prompts,
            sizes,
            args.output_len,
            args.dtype,
            workload=args.workload,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            pairs=args.pairs,
            gemm=args.gemm,
            temperature=args.temperature,
            seed=args.seed,
            quantization=args.quantization,
        )
    except (CheckpointError, OracleMismatch) as exc:
        raise CommandFailed(str(exc)) from None
    dicts = [asdict(row) for row in rows]
    print(format_spec_rows(dicts))
    if args.json:
        try:
            write_json_atomic(args.json, {"environment": environment, "rows": dicts})
        except OSError as exc:
            raise CommandFailed(f"could not write --json {args.json}: {exc}") from None
    summary = {
        "max_num_seqs": sizes,
        "output_tokens_per_s": [r["output_tokens_per_s_on"] for r in dicts],
        "output_tokens_per_s_without_speculation": [r["output_tokens_per_s_off"] for r in dicts],
        "tpot_ms": [r["tpot_ms_on"] for r in dicts],
        "tpot_ms_without_speculation": [r["tpot_ms_off"] for r in dicts],
        "acceptance_rate": [r["acceptance_rate"] for r in dicts],
        "acceptance_length": [r["acceptance_length"] for r in dicts],
    }
    print(json.dumps(summary_json(summary)))
    return 0


def summary_json(summary: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """`summary` with NaN (no draft, no acceptance) as null, so the line is strict JSON."""
    return {
        k: [None if isinstance(v, float) and math.isnan(v) else v for v in vs] for k, vs in summary.items()
    }
