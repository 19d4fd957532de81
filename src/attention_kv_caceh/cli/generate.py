"""`attention-kv-caceh generate`: run prompts through the engine together and show every step.

All prompts are added to one `LLMEngine` up front (request ids "0", "1", ... in input order), then
`step()` runs until none is left (`offline.OfflineRun`): continuous batching, chunked prefill, prefix
caching and preemption, each visible in the per-step table (`report.generate.StepTable`; its columns are
`STEP_TABLE_HELP`). Each prompt's continuation is printed after the table; `--output` writes them as JSONL
(one line per prompt, input order, written atomically at the end), `--trace` writes one JSONL line per
engine step (each StepStats, flushed as the step ends).

Checks, in order: flags and output paths (exit 2, nothing read); then `engine_args.plan_engine`, the
checks `serve` makes too: --model names a checkpoint, its config and tokenizer are read, a
--max-model-len above the checkpoint's or a KV cache of no block or over the memory budget is refused
(exit 2, no weights loaded); a --max-tokens above max_model_len is refused (the server's 400 for the
same max_tokens); the prompts are tokenized and a prompt longer than max_model_len, or whose
prompt + --max-tokens can never fit the KV pool, is refused (exit 2, no weights loaded); a checkpoint the
engine cannot load is one line naming the file and key (exit 1). The first line printed says how long
loading took and, of that, the warm-up (`model_executor/warmup.py`: a dummy forward pass that compiles, or loads
from Numba's disk cache, every kernel a step calls, so no step time holds a compile) with how many
kernel signatures it compiled and how many it loaded from the cache. Ctrl-C: one line, exit 130, the
prompts that finished are written to --output and the trace holds every step that ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from attention_kv_caceh.cli.common import PROG, CommandFailed, UsageError, check_outputs, warn_if_threads_busy
from attention_kv_caceh.cli.engine_args import (
    add_engine_arguments,
    check_prompts_fit,
    engine_config_kwargs,
    plan_engine,
)
from attention_kv_caceh.cli.flags import add_options, config_from_args
from attention_kv_caceh.cpu_load import FOLLOWS_LOAD
from attention_kv_caceh.cpus import threads_note
from attention_kv_caceh.entrypoints.llm import GenerateConfig, OfflineRun, SamplingOptions
from attention_kv_caceh.report import generate as text
from attention_kv_caceh.report.generate import STEP_TABLE_HELP

if TYPE_CHECKING:
    from attention_kv_caceh.engine.tokenizer import Tokenizer

__all__ = ["HELP", "add_arguments", "read_prompts", "run"]

HELP = "generate continuations of prompts with the engine, printing each step's batch (continuous batching)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `generate`: model, prompts, sampling, engine limits, KV cache size, outputs."""
    parser.epilog = STEP_TABLE_HELP
    add_options(parser, GenerateConfig, exclude=("output", "trace"))
    add_options(parser.add_argument_group("sampling (vLLM's SamplingParams)"), SamplingOptions)
    add_engine_arguments(parser.add_argument_group("engine (vLLM's names)"))
    add_options(parser.add_argument_group("outputs"), GenerateConfig, only=("output", "trace"))


def read_prompts(config: GenerateConfig) -> list[str]:
    """The prompts from --prompt or --prompts-file; UsageError for an unreadable file, no prompt, an
    empty one, or a --prompt that is not valid UTF-8."""
    if config.prompts_file is not None:
        try:
            text = Path(config.prompts_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--prompts-file {config.prompts_file!r}: cannot read it ({exc})") from None
        prompts = [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise UsageError(f"--prompts-file {config.prompts_file!r} holds no prompt (one per line)")
        return prompts
    prompts = list(config.prompt or ())
    for i, p in enumerate(prompts):
        if not p:
            raise UsageError(f"prompt {i} (--prompt, counted from 0) is empty")
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as exc:  # bytes the shell passed that are not UTF-8 (surrogate-escaped)
            raise UsageError(
                f"prompt {i} (--prompt, counted from 0) is not valid UTF-8 "
                f"(byte 0x{ord(p[exc.start]) & 0xFF:02x} at character {exc.start})"
            ) from None
    return prompts


def run(args: argparse.Namespace) -> int:
    """Generate and print; see the module docstring for the checks and exit codes."""
    config = config_from_args(
        GenerateConfig, args, prompt=None if args.prompt is None else tuple(args.prompt)
    )
    sampling = config_from_args(SamplingOptions, args)
    check_outputs(
        [("--output", config.output, (".jsonl",)), ("--trace", config.trace, (".jsonl",))],
        [("--model", config.model), ("--prompts-file", config.prompts_file)],
    )
    prompts = read_prompts(config)
    try:
        params = sampling.params()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    plan = plan_engine(config.model, engine_config_kwargs(args))
    if params.max_tokens > plan.max_model_len:  # a range check, as the server's 400 for max_tokens
        raise UsageError(
            f"--max-tokens {params.max_tokens}: more than max_model_len {plan.max_model_len} (one request "
            "holds at most max_model_len tokens, its prompt included)"
        )
    prompt_ids = [plan.tokenizer.encode(p) for p in prompts]
    check_prompts_fit(plan, prompt_ids, params)
    if plan.engine_config.threads is not None:
        warn_if_threads_busy("generate", (plan.engine_config.threads,))

    from attention_kv_caceh.engine.llm_engine import LLMEngine
    from attention_kv_caceh.engine.model_runner import ModelRunner
    from attention_kv_caceh.entrypoints.llm import load_seconds
    from attention_kv_caceh.model_executor.warmup import numba_compile_counts

    t0, before = time.perf_counter(), numba_compile_counts()
    try:
        engine = LLMEngine.from_pretrained(str(plan.source.path), plan.engine_config)
    except ValueError as exc:  # CheckpointError (naming the file and key) is a ValueError
        raise CommandFailed(str(exc)) from None
    after = numba_compile_counts()
    note = text.warm_up_note(load_seconds(engine), after[0] - before[0], after[1] - before[1])
    try:
        offline = OfflineRun(engine, prompt_ids, params)
    except ValueError as exc:
        raise CommandFailed(f"the engine refused a prompt (request id = prompt index): {exc}") from None
    scheduler = engine.scheduler
    load = f"{time.perf_counter() - t0:.2f} s{note}"
    print(text.start_line(engine.config, len(prompts), sum(map(len, prompt_ids)), params.max_tokens,
                          scheduler.kv_cache_manager.num_blocks, scheduler.max_model_len, load,
                          plan.bytes_per_block))  # fmt: skip
    if isinstance(engine.model_runner, ModelRunner):
        print(engine.model_runner.model.gemm_note)
        note = threads_note(engine.model_runner.threads)
        if engine.model_runner.governor is not None:
            note += f"; {FOLLOWS_LOAD}"
        print(note)
    return _run_steps(config, offline, prompts, prompt_ids, plan.tokenizer)


def _run_steps(
    config: GenerateConfig,
    offline: OfflineRun,
    prompts: list[str],
    prompt_ids: list[list[int]],
    tokenizer: Tokenizer,
) -> int:
    """step() until done, printing the table and writing the trace; then the continuations and --output."""
    from attention_kv_caceh.files import JsonlWriter, atomic_write_text, ignoring_sigint, strict_json_value

    engine = offline.engine
    spec = engine.config.speculative_config
    table = text.StepTable(sys.stdout, speculative=spec is not None)
    trace, interrupted, t0 = None, False, time.perf_counter()
    try:
        if config.trace is not None:
            trace = JsonlWriter(config.trace, fsync=False)  # flushed per step; fsync would slow the loop
        table.header()
        for stats, done in offline.steps():
            if trace is not None:
                trace.write({**dataclasses.asdict(stats), "finished_request_ids": done})
            table.row(stats, done, last=not engine.has_unfinished_requests())
    except KeyboardInterrupt:
        interrupted = True
    except RuntimeError as exc:
        raise CommandFailed(str(exc)) from None
    except OSError as exc:
        raise CommandFailed(f"could not write --trace {config.trace}: {exc}") from None
    finally:
        if trace is not None:
            trace.close()
    elapsed = time.perf_counter() - t0
    with ignoring_sigint():
        records = offline.records(prompts, prompt_ids, tokenizer)
        table.footer()
        for r in records:
            print(text.record_line(r))
        print(text.totals_line(engine.num_steps, offline.totals, offline.num_generated_tokens, elapsed))
        if spec is not None:
            print(text.acceptance_line(offline.spec_steps, spec.num_speculative_tokens))
        if config.output is not None:
            lines = (
                json.dumps(strict_json_value(r), ensure_ascii=False, allow_nan=False) + "\n" for r in records
            )
            try:
                atomic_write_text(config.output, "".join(lines))
            except OSError as exc:
                raise CommandFailed(f"could not write --output {config.output}: {exc}") from None
    if interrupted:
        kept = f", written to {config.output}" if config.output is not None else ""
        print(
            f"{PROG}: interrupted; {len(records)} of {len(prompts)} prompts finished{kept}", file=sys.stderr
        )
        return 130
    return 0
