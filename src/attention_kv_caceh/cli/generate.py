"""`attention-kv-caceh generate`: run prompts through the engine together and show every step.

All prompts are added to one `LLMEngine` up front (request ids "0", "1", ... in input order), then
`step()` runs until none is left: continuous batching, chunked prefill, prefix caching and preemption,
each visible in the per-step table (`StepTable`, below; its columns are `STEP_TABLE_HELP`). Each prompt's continuation is printed after
the table; `--output` writes them as JSONL (one line per prompt, input order, written atomically at the
end), `--trace` writes one JSONL line per engine step (each StepStats, flushed as the step ends).

Checks, in order: flags and output paths (exit 2, nothing read); then `engine_args.plan_engine`, the
checks `serve` makes too: --model names a checkpoint, its config and tokenizer are read, a
--max-model-len above the checkpoint's or a KV cache of no block or over the memory budget is refused
(exit 2, no weights loaded); the prompts are tokenized and a prompt longer than max_model_len, or whose
prompt + --max-tokens can never fit the KV pool, is refused (exit 2, no weights loaded); a checkpoint the
engine cannot load is one line naming the file and key (exit 1). The first line printed says how long
loading took and, of that, the warm-up (`engine/warmup.py`: a dummy forward pass that compiles, or loads
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
from typing import TYPE_CHECKING, Any, TextIO

from attention_kv_caceh.cli.common import (
    PROG,
    CommandFailed,
    UsageError,
    check_outputs,
    nonnegative_float,
    nonnegative_int,
    positive_int,
    seed_int,
)
from attention_kv_caceh.cli.engine_args import (
    MODEL_HELP,
    MODEL_METAVAR,
    add_engine_arguments,
    check_prompts_fit,
    engine_config_kwargs,
    plan_engine,
)

if TYPE_CHECKING:
    from attention_kv_caceh.engine.llm_engine import LLMEngine
    from attention_kv_caceh.engine.request import SamplingParams
    from attention_kv_caceh.engine.tokenizer import Tokenizer

__all__ = [
    "ALWAYS_ROWS",
    "EVERY",
    "HELP",
    "STEP_TABLE_HELP",
    "StepTable",
    "add_arguments",
    "read_prompts",
    "run",
]

HELP = "generate continuations of prompts with the engine, printing each step's batch (continuous batching)"


def _top_p(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    value = nonnegative_float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `generate`: model, prompts, sampling, engine limits, KV cache size, outputs."""
    parser.epilog = STEP_TABLE_HELP
    parser.add_argument(
        "--model",
        required=True,
        metavar=MODEL_METAVAR,
        help=MODEL_HELP,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--prompt",
        nargs="+",
        action="extend",
        metavar="TEXT",
        help="prompt texts, one or more (default: none; this or --prompts-file)",
    )
    source.add_argument(
        "--prompts-file",
        metavar="FILE",
        help="UTF-8 text file, one prompt per line, blank lines skipped (default: none; this or --prompt)",
    )
    s = parser.add_argument_group("sampling (vLLM's SamplingParams)")
    s.add_argument(
        "--max-tokens",
        metavar="N",
        type=positive_int,
        required=True,
        help="most output tokens per prompt (default: none, required)",
    )
    s.add_argument(
        "--temperature", metavar="T", type=nonnegative_float, default=0.0, help="0 is greedy (default: 0)"
    )
    s.add_argument("--top-p", metavar="P", type=_top_p, default=1.0, help="nucleus sampling mass in (0, 1]")
    s.add_argument(
        "--top-k",
        metavar="N",
        type=nonnegative_int,
        default=0,
        help="keep the k most probable tokens; 0 disables (default: 0)",
    )
    s.add_argument(
        "--seed",
        metavar="N",
        type=seed_int,
        default=None,
        help="seed of every request's own generator, so equal prompts sample equally (default: fresh entropy)",
    )
    s.add_argument(
        "--ignore-eos", action="store_true", help="keep generating after eos (default: stop at eos)"
    )
    add_engine_arguments(parser.add_argument_group("engine (vLLM's names)"))
    o = parser.add_argument_group("outputs")
    o.add_argument(
        "--output",
        metavar="OUT.jsonl",
        help="one JSON line per prompt: index, prompt, prompt_token_ids, token_ids, text, finish_reason "
        "(default: not written)",
    )
    o.add_argument(
        "--trace",
        metavar="STEPS.jsonl",
        help="one JSON line per engine step (StepStats plus finished_request_ids) (default: not written)",
    )


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts from --prompt or --prompts-file; UsageError for an unreadable file, no prompt, an
    empty one, or a --prompt that is not valid UTF-8."""
    if args.prompts_file is not None:
        try:
            text = Path(args.prompts_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--prompts-file {args.prompts_file!r}: cannot read it ({exc})") from None
        prompts = [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise UsageError(f"--prompts-file {args.prompts_file!r} holds no prompt (one per line)")
        return prompts
    prompts = list(args.prompt)
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


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the flags; UsageError for a value they refuse."""
    from attention_kv_caceh.engine.request import SamplingParams

    try:
        return SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Generate and print; see the module docstring for the checks and exit codes."""
    check_outputs(
        [("--output", args.output, (".jsonl",)), ("--trace", args.trace, (".jsonl",))],
        [("--model", args.model), ("--prompts-file", args.prompts_file)],
    )
    prompts = read_prompts(args)
    params = _sampling_params(args)
    plan = plan_engine(args.model, engine_config_kwargs(args))
    prompt_ids = [plan.tokenizer.encode(p) for p in prompts]
    check_prompts_fit(plan, prompt_ids, params)

    from attention_kv_caceh.engine.llm_engine import LLMEngine
    from attention_kv_caceh.engine.warmup import numba_compile_counts

    t0 = time.perf_counter()
    before = numba_compile_counts()
    try:
        engine = LLMEngine.from_pretrained(str(plan.source.path), plan.engine_config)
    except ValueError as exc:  # CheckpointError (naming the file and key) is a ValueError
        raise CommandFailed(str(exc)) from None
    after = numba_compile_counts()
    load_s = time.perf_counter() - t0
    load_note = f"{load_s:.2f} s" + _warm_up_note(engine, after[0] - before[0], after[1] - before[1])
    try:
        for i, ids in enumerate(prompt_ids):
            engine.add_request(str(i), ids, params)
    except ValueError as exc:
        raise CommandFailed(f"the engine refused a prompt (request id = prompt index): {exc}") from None
    return _run_steps(args, engine, plan.tokenizer, prompts, prompt_ids, load_note)


def _warm_up_note(engine: LLMEngine, compiled: int, loaded: int) -> str:
    """What the load spent warming up: `(of which S s warm-up: C kernel signatures compiled, L loaded
    from Numba's disk cache)`; the seconds are the model's kernel preparation and the runner's warm-up
    forward passes (`Model.gemm_compile_s`, `ModelRunner.warmup_s`), the counts `numba_compile_counts`
    taken around the load."""
    from attention_kv_caceh.engine.model_runner import ModelRunner

    runner = engine.model_runner
    if not isinstance(runner, ModelRunner):
        return ""
    seconds = runner.model.gemm_compile_s + runner.warmup_s
    if compiled == loaded == 0:
        return f" (of which {seconds:.2f} s warm-up, every kernel already compiled in this process)"
    return (
        f" (of which {seconds:.2f} s warm-up: {compiled} kernel signature{'s' * (compiled != 1)} compiled, "
        f"{loaded} loaded from Numba's disk cache)"
    )


def _run_steps(
    args: argparse.Namespace,
    engine: LLMEngine,
    tokenizer: Tokenizer,
    prompts: list[str],
    prompt_ids: list[list[int]],
    load_note: str,
) -> int:
    """step() until done, printing the table and writing the trace; then the continuations and --output."""
    from attention_kv_caceh.engine.model_runner import ModelRunner
    from attention_kv_caceh.files import JsonlWriter, ignoring_sigint

    num_blocks = engine.scheduler.kv_cache_manager.num_blocks
    print(
        f"{len(prompts)} prompts ({sum(map(len, prompt_ids))} tokens), max_tokens {args.max_tokens}; "
        f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
        f"{num_blocks} KV blocks of {args.block_size} tokens, max_model_len {engine.scheduler.max_model_len}, "
        f"prefix caching {'off' if args.no_prefix_caching else 'on'}, {args.dtype}, "
        f"speculative decoding {_spec_text(engine)}; loaded in {load_note}"
    )
    runner = engine.model_runner
    if isinstance(runner, ModelRunner):
        print(runner.model.gemm_note)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    finish: dict[str, str | None] = {}
    spec = engine.config.speculative_config
    table = StepTable(sys.stdout, speculative=spec is not None)
    trace = None
    interrupted = False
    # Summed as the steps come: engine.step_stats keeps only the newest steps.
    totals = {"num_prefill_tokens": 0, "num_decode_tokens": 0, "num_preemptions": 0, "prefix_cache_hits": 0}
    spec_steps: list[Any] = []  # each step's SpecDecodingStats (None without drafts)
    t0 = time.perf_counter()
    try:
        if args.trace is not None:
            trace = JsonlWriter(args.trace, fsync=False)  # flushed per step; fsync would slow the loop
        table.header()
        while engine.has_unfinished_requests():
            before = engine.num_steps  # step_stats is bounded: its length stops growing
            step_outputs = engine.step()
            if engine.num_steps == before:
                raise CommandFailed("the engine scheduled nothing while requests were waiting (a bug)")
            done: list[str] = []
            for out in step_outputs:
                outputs[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    finish[out.request_id] = out.finish_reason
                    done.append(out.request_id)
            stats = engine.step_stats[-1]
            for key in totals:
                totals[key] += getattr(stats, key)
            spec_steps.append(stats.spec_decoding)
            if trace is not None:
                trace.write({**dataclasses.asdict(stats), "finished_request_ids": done})
            table.row(stats, done, last=not engine.has_unfinished_requests())
    except KeyboardInterrupt:
        interrupted = True
    except OSError as exc:
        raise CommandFailed(f"could not write --trace {args.trace}: {exc}") from None
    finally:
        if trace is not None:
            trace.close()
    elapsed = time.perf_counter() - t0

    with ignoring_sigint():
        records: list[dict[str, Any]] = [
            {
                "index": i,
                "prompt": prompts[i],
                "prompt_token_ids": prompt_ids[i],
                "token_ids": outputs[str(i)],
                "text": tokenizer.decode(outputs[str(i)]),
                "finish_reason": finish[str(i)],
            }
            for i in range(len(prompts))
            if str(i) in finish
        ]
        table.footer()
        for r in records:
            print(
                f"[{r['index']}] {r['prompt']!r} -> {r['text']!r} ({len(r['token_ids'])} tokens, {r['finish_reason']})"
            )
        generated = sum(len(r["token_ids"]) for r in records)
        print(
            f"{engine.num_steps} steps, {totals['num_prefill_tokens']} prefill + "
            f"{totals['num_decode_tokens']} decode tokens computed, "
            f"{totals['num_preemptions']} preemptions, "
            f"{totals['prefix_cache_hits']} prefix-cache hit tokens; {generated} tokens "
            f"generated in {elapsed:.2f} s wall, printing and trace included "
            f"({generated / max(elapsed, 1e-9):.1f} tokens/s)"
        )
        if spec is not None:
            print(_acceptance_line(spec_steps, spec.num_speculative_tokens))
        if args.output is not None:
            from attention_kv_caceh.files import atomic_write_text, strict_json_value

            text = "".join(
                json.dumps(strict_json_value(r), ensure_ascii=False, allow_nan=False) + "\n" for r in records
            )
            try:
                atomic_write_text(args.output, text)
            except OSError as exc:
                raise CommandFailed(f"could not write --output {args.output}: {exc}") from None
    if interrupted:
        kept = f", written to {args.output}" if args.output is not None else ""
        print(
            f"{PROG}: interrupted; {len(records)} of {len(prompts)} prompts finished{kept}", file=sys.stderr
        )
        return 130
    return 0


def _spec_text(engine: LLMEngine) -> str:
    spec = engine.config.speculative_config
    if spec is None:
        return "off"
    return f"ngram K={spec.num_speculative_tokens} (prompt_lookup {spec.prompt_lookup_min}..{spec.prompt_lookup_max})"


def _acceptance_line(steps: list[Any], num_spec_tokens: int) -> str:
    """vLLM's acceptance figures over the run's steps (`spec_decode.metrics.acceptance_summary`)."""
    from attention_kv_caceh.engine.spec_decode.metrics import acceptance_summary

    s = acceptance_summary(steps, num_spec_tokens)
    if not s.num_drafts:
        return "speculative decoding: no draft was proposed (no n-gram of the prompt recurred)"
    per_pos = ", ".join(f"{r:.2f}" for r in s.per_position_acceptance_rates)
    return (
        f"speculative decoding: {s.num_drafts} drafts, {s.num_draft_tokens} draft tokens, "
        f"{s.num_accepted_tokens} accepted: acceptance rate {100 * s.acceptance_rate:.1f} %, "
        f"mean acceptance length {s.acceptance_length:.2f}, per position {per_pos}"
    )


# ------------------------------------------------------------------------------ the per-step table

STEP_TABLE_HELP = """The per-step table `generate` prints: one row per engine step, as the step ends.

Columns (the numbers of `engine.llm_engine.StepStats`):
    step      step index (0, 1, ...)
    reqs      requests scheduled in the step (the batch's R)
    tokens    tokens computed in the step (the flattened batch's N), = prefill + decode
    prefill   tokens of prompt chunks (and of recomputation after a preemption)
    decode    tokens of requests computing their newest sampled token (1 each, plus its draft tokens
              with speculative decoding)
    draft/acc with --speculative-config only: draft tokens verified in the step / accepted
    run/wait  num_requests_running / num_requests_waiting after the step
    free      free KV blocks after the step (kv% = used / total blocks)
    preempt   requests preempted in the step (their blocks freed, recomputed later)
    hit/query prompt tokens found in / looked up in the prefix cache at the step's admissions
    ms        wall time of the step
    batch     request:tokens of every scheduled request, in batch order; `*` marks a request that
              finished in the step

Rows: each of the first 50 steps (ALWAYS_ROWS); after that, only the steps where something changes (a prefill
chunk or admission, a preemption, a finished request, a prefix-cache lookup, a different running or
waiting count), every 25th step (EVERY), and the last step. A line says how many unchanged decode steps
were left out between two rows; --trace of `generate` keeps every step.
"""

ALWAYS_ROWS = 50
"""Steps printed unconditionally at the start."""
EVERY = 25
"""After ALWAYS_ROWS, an unchanged step is still printed when its index is a multiple of this."""
_BATCH_WIDTH = 60

_HEADER = (
    f"{'step':>5} {'reqs':>4} {'tokens':>6} {'prefill':>7} {'decode':>6} {'run':>4} {'wait':>4} "
    f"{'free':>6} {'kv%':>5} {'preempt':>7} {'hit/query':>11} {'ms':>8}  batch (request:tokens, *finished)"
)


class StepTable:
    """Prints the header, then a row per StepStats under the row rule above, to `stream`; with
    `speculative`, a draft/acc column after decode."""

    def __init__(self, stream: TextIO, *, speculative: bool = False) -> None:
        self.stream = stream
        self.speculative = speculative
        self._header = _HEADER.replace(" run ", f" {'draft/acc':>9}  run ", 1) if speculative else _HEADER
        self.skipped = 0
        self.rows = 0
        self._previous: tuple[int, int] | None = None

    def header(self) -> None:
        """The column names and a rule."""
        print(self._header, file=self.stream)
        print("-" * len(self._header), file=self.stream)

    def _changed(self, stats: Any, finished: list[str]) -> bool:
        counts = (stats.num_running, stats.num_waiting)
        return bool(
            stats.num_prefill_tokens
            or stats.num_preemptions
            or finished
            or stats.prefix_cache_queries
            or counts != self._previous
        )

    def row(self, stats: Any, finished: list[str], *, last: bool = False) -> bool:
        """Print the row of one StepStats if the rule says so; return whether it was printed."""
        changed = self._changed(stats, finished)
        self._previous = (stats.num_running, stats.num_waiting)
        index = int(stats.step_index)
        if not (index < ALWAYS_ROWS or changed or index % EVERY == 0 or last):
            self.skipped += 1
            return False
        self._flush_skipped()
        done = set(finished)
        batch = " ".join(
            f"{rid}:{n}{'*' if rid in done else ''}" for rid, n in stats.num_scheduled_tokens.items()
        )
        if len(batch) > _BATCH_WIDTH:
            batch = batch[: _BATCH_WIDTH - 3] + "..."
        tokens = sum(stats.num_scheduled_tokens.values())
        hits = f"{stats.prefix_cache_hits}/{stats.prefix_cache_queries}"
        drafts = ""
        if self.speculative:
            sd = stats.spec_decoding
            drafts = f"{'0/0' if sd is None else f'{sd.num_draft_tokens}/{sd.num_accepted_tokens}':>9} "
        print(
            f"{index:>5} {len(stats.num_scheduled_tokens):>4} {tokens:>6} {stats.num_prefill_tokens:>7} "
            f"{stats.num_decode_tokens:>6} {drafts}{stats.num_running:>4} {stats.num_waiting:>4} "
            f"{stats.num_free_blocks:>6} {100 * stats.kv_cache_usage:>5.1f} {stats.num_preemptions:>7} "
            f"{hits:>11} {stats.step_time_ms:>8.2f}  {batch}",
            file=self.stream,
        )
        self.rows += 1
        return True

    def _flush_skipped(self) -> None:
        if self.skipped:
            print(f"{'':>5} ... {self.skipped} decode steps without change not shown", file=self.stream)
            self.skipped = 0

    def footer(self) -> None:
        """The count of steps left out at the end (an interrupted run), then a rule."""
        self._flush_skipped()
        print("-" * len(self._header), file=self.stream)
