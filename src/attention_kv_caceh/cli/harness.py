"""`attention-kv-caceh harness`: the streaming serving harness (TTFT, ITL, TPOT, E2EL per request).

`add_arguments` declares the flags; `run` validates every argument (UsageError naming the bad value)
before any output file is created, runs the load, prints a setup line and a fixed-width summary table,
and writes the per-request JSONL (line by line as requests finish) with its `<jsonl>.meta.json` (config
and environment), the summary JSON and the timeline. `--backend engine` starts the project's own `serve` for the run (cli/harness_engine.py).
Ctrl-C (or SIGTERM) keeps every finished request in
the JSONL and still prints and saves a summary of them (no timeline). Runtime failures (server
unreachable, smoke test failed, failed requests, an output that cannot be written) print one line
`attention-kv-caceh: error: ...` on stderr and return 1; only files actually written are listed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from attention_kv_caceh.cli import harness_engine, harness_options, harness_repeats
from attention_kv_caceh.cli.common import UsageError, check_outputs, output_file
from attention_kv_caceh.cli.harness_engine import ENGINE_BACKEND
from attention_kv_caceh.cli.harness_output import (
    JsonlSink,
    error,
    format_summary,
    report_and_save,
)
from attention_kv_caceh.files import ignoring_sigint, meta_path
from attention_kv_caceh.harness.load import LengthRange, SmokeTestError
from attention_kv_caceh.harness.metrics import parse_goodput
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.run import (
    BACKENDS,
    MAX_REQUESTS,
    MAX_TOKENS,
    ContextLengthError,
    HarnessConfig,
    ModelDiscoveryError,
    RunResult,
    run_harness,
)
from attention_kv_caceh.harness.sampling import SamplingOptions
from attention_kv_caceh.harness.server_metrics import DEFAULT_INTERVAL_S
from attention_kv_caceh.harness.workloads import WORKLOADS, Workload

__all__ = [
    "HELP",
    "add_arguments",
    "add_sampling_arguments",
    "config_from_args",
    "format_summary",
    "run",
    "warn_server_temperature",
]

DEFAULT_PROMPT_LEN, DEFAULT_OUTPUT_LEN = "32", "16"  # --prompt-len, --output-len (None: not given)

HELP = (
    "streaming serving harness: TTFT, ITL, TPOT, E2EL per request "
    "(simulated, OpenAI-compatible, or the project's own engine)"
)


def add_arguments(parser: argparse.ArgumentParser, *, sweep: bool = False) -> None:
    """Declare the harness's flags on `parser` (kebab-case; each help text shows its default, so any
    formatter_class works). With `sweep`, `--concurrency` and `--request-rate` take several values (a
    grid, cli/sweep.py) and the one-run outputs (--jsonl, --summary-json, --plot) are left out."""
    g = parser.add_argument_group("backend")
    g.add_argument(
        "--backend",
        choices=(*BACKENDS, ENGINE_BACKEND),
        default="simulated",
        help=f"where requests go; {ENGINE_BACKEND}: start `serve --model MODEL` on a free loopback port "
        "for the run and use openai-completions against it (default: %(default)s)",
    )
    g.add_argument(
        "--base-url",
        default=None,
        help="OpenAI-compatible server root (default: http://127.0.0.1:8000)",
    )
    g.add_argument(
        "--model",
        default="",
        help=f"model name (default: the first model listed by GET /v1/models); with --backend "
        f"{ENGINE_BACKEND}: the checkpoint to serve, as serve's --model takes it (required)",
    )
    g.add_argument(
        "--api-key-env",
        default="OPENAI_API_KEY",
        help="name of the environment variable holding the API key (unset: no key sent) (default: %(default)s)",
    )
    g.add_argument(
        "--timeout", type=float, default=600.0, help="per-request timeout (s) (default: %(default)s)"
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask the server (vLLM) to ignore EOS so that every request yields its output length (default: off)",
    )
    g.add_argument(
        "--smoke-test",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send one request first and stop with a clear message if it fails (default: %(default)s)",
    )
    g = parser.add_argument_group("load")
    g.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help=f"measured requests, at most {MAX_REQUESTS}; a run whose requests would need more than half "
        "of the memory is refused (default: 16; with --trace, every row)",
    )
    grid = "+" if sweep else None
    g.add_argument(
        "--concurrency",
        type=int,
        nargs=grid,
        default=[4] if sweep else 4,
        help="client in-flight limit (the semaphore)"
        + ("; several values: a grid of points" if sweep else "")
        + " (default: %(default)s)",
    )
    g.add_argument(
        "--request-rate",
        type=float,
        nargs=grid,
        default=[math.inf] if sweep else math.inf,
        help="arrivals per second (inf: all at once; else Poisson/gamma)"
        + ("; several values: a grid of points" if sweep else "")
        + " (default: %(default)s)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of arrival gaps (1: Poisson; <1 burstier), as vLLM (default: %(default)s)",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="seed of lengths, prompts and arrivals (default: %(default)s)"
    )
    g.add_argument(
        "--prompt-len",
        default=None,
        help=f"prompt tokens: N, or LOW:HIGH drawn uniformly; at most {MAX_TOKENS}; with --workload "
        "shared-prefix: words after the prefix (one token each with a tokenizer); multi-turn: words of each "
        "new user message, sent after the whole history; with --trace the rows give the lengths, and it shapes only "
        "--warmup-requests (default: 32)",
    )
    g.add_argument(
        "--output-len",
        default=None,
        help=f"output tokens: N, or LOW:HIGH drawn uniformly; at most {MAX_TOKENS}; with --trace the rows give "
        "the lengths, and it shapes only --warmup-requests (default: 16)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="folder with the target's tokenizer.json (or a .gguf file or model name serve takes), to build "
        "prompts of exactly --prompt-len tokens "
        "(default: the server's POST /tokenize if it has one, else approximate lengths)",
    )
    g.add_argument(
        "--dataset",
        default=None,
        metavar="PATH.jsonl",
        help='real prompts, one {"prompt": ..., "output_len": ...} a line; the first --num-requests '
        "are sent (default: synthetic prompts)",
    )
    g.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="random",
        help="random: independent prompts; shared-prefix: one of --num-prefixes shared prefixes of "
        "--prefix-len words, then --prompt-len words of its own; multi-turn: conversations of --turns "
        "turns, each sending the whole history (with --dataset: its `conversation` lines replayed); copy: "
        "repeat a passage of at least --prompt-len words with one change (copy-heavy, where speculative "
        "decoding pays) (default: %(default)s)",
    )
    g.add_argument(
        "--num-prefixes", type=int, default=4, help="shared-prefix: how many prefixes (default: %(default)s)"
    )
    g.add_argument(
        "--prefix-len",
        type=int,
        default=256,
        help="shared-prefix: words (one token each with a tokenizer) per prefix (default: %(default)s)",
    )
    g.add_argument(
        "--turns",
        type=int,
        default=4,
        help="multi-turn: turns per conversation; --num-requests must be a multiple (default: %(default)s)",
    )
    g.add_argument(
        "--warmup-requests",
        type=int,
        default=0,
        help=f"unrecorded requests before the run (same concurrency limit), at most {MAX_REQUESTS} "
        "(default: %(default)s)",
    )
    harness_options.add_arguments(parser, sweep=sweep)
    add_sampling_arguments(parser)
    g = parser.add_argument_group("simulated backend")
    g.add_argument(
        "--server-slots", type=int, default=8, help="simulated server batch slots (default: %(default)s)"
    )
    g.add_argument(
        "--prefill-ms", type=float, default=50.0, help="simulated time to first token (default: %(default)s)"
    )
    g.add_argument(
        "--per-token-ms", type=float, default=10.0, help="simulated inter-token time (default: %(default)s)"
    )
    g = parser.add_argument_group("outputs")
    if not sweep:
        g.add_argument(
            "--jsonl",
            type=output_file(".jsonl"),
            default=None,
            help="per-request records, one JSON a line (default: not written)",
        )
        g.add_argument(
            "--summary-json",
            type=output_file(".json"),
            default=None,
            help="summary (vLLM key names) (default: not written)",
        )
        g.add_argument(
            "--plot", type=output_file(".png"), default=None, help="timeline PNG (default: not drawn)"
        )
    g.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000 (default: none, no goodput)",
    )
    g.add_argument(
        "--label",
        default=None,
        help="a name for this run, written into the summary (vLLM's --label) (default: none)",
    )
    g.add_argument(
        "--server-metrics-interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        help="seconds between polls of the server's /metrics (0: off), from a thread of its own, "
        "stretched so that polls cost the server < 1%% of its time (default: %(default)s)",
    )
    harness_engine.add_arguments(parser)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the sampling flags (vLLM's `bench serve` names; None when not given, and then not sent)."""
    g = parser.add_argument_group(
        "sampling (HTTP backends: each field is sent in every request body only when given; the server's "
        "defaults decide the rest, temperature 1.0 on vLLM and on serve)"
    )
    not_sent = "(default: not sent)"
    g.add_argument("--temperature", type=float, default=None, help=f"0 is greedy; >= 0 {not_sent}")
    g.add_argument("--top-p", type=float, default=None, help=f"nucleus mass in (0, 1] {not_sent}")
    g.add_argument(
        "--top-k", type=int, default=None, help=f"keep the k most probable; -1 or 0: off {not_sent}"
    )
    g.add_argument("--frequency-penalty", type=float, default=None, help=f"OpenAI's, in [-2, 2] {not_sent}")
    g.add_argument("--presence-penalty", type=float, default=None, help=f"OpenAI's, in [-2, 2] {not_sent}")
    g.add_argument("--repetition-penalty", type=float, default=None, help=f"vLLM's, > 0 (1: off) {not_sent}")


def warn_server_temperature(config: HarnessConfig) -> None:
    """One line on stderr, as vLLM's `bench serve` prints, when an HTTP run gives no --temperature."""
    if config.backend != "simulated" and config.sampling.temperature is None:
        print(
            "warning: no --temperature given: the server's default decides (1.0 on vLLM and serve, a random "
            "draw per token); pass --temperature 0 for greedy",
            file=sys.stderr,
        )


def config_from_args(args: argparse.Namespace) -> HarnessConfig:
    """Build and validate the HarnessConfig. Raises UsageError naming the offending value."""
    try:
        return _config(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _config(args: argparse.Namespace) -> HarnessConfig:
    key_env: str = args.api_key_env
    engine = args.backend == ENGINE_BACKEND
    base_url = harness_engine.check_usage(args)  # the engine's own URL replaces it once it serves
    trace = harness_options.trace_settings(args)
    config = HarnessConfig(
        backend="openai-completions" if engine else args.backend,
        base_url=base_url,
        model="" if engine else args.model,
        api_key=os.environ.get(key_env) or None,
        num_requests=harness_options.num_requests(args, trace),
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        seed=args.seed,
        prompt_len=LengthRange.parse(
            DEFAULT_PROMPT_LEN if args.prompt_len is None else args.prompt_len, "--prompt-len"
        ),
        output_len=LengthRange.parse(
            DEFAULT_OUTPUT_LEN if args.output_len is None else args.output_len, "--output-len"
        ),
        warmup_requests=args.warmup_requests,
        server_slots=args.server_slots,
        prefill_ms=args.prefill_ms,
        per_token_ms=args.per_token_ms,
        goodput=parse_goodput(args.goodput),
        server_metrics_interval_s=args.server_metrics_interval,
        timeout_s=args.timeout,
        smoke_test=args.smoke_test,
        ignore_eos=args.ignore_eos,
        label=args.label,
        tokenizer=args.tokenizer or (args.model if engine else None),
        dataset=args.dataset,
        workload=Workload(args.workload, args.num_prefixes, args.prefix_len, args.turns),
        sampling=SamplingOptions(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            frequency_penalty=args.frequency_penalty,
            presence_penalty=args.presence_penalty,
            repetition_penalty=args.repetition_penalty,
        ),
        trace=trace,
        probe_rate=args.probe_rate,
        workers=args.workers,
    )
    if engine:
        harness_engine.check_context(args, config)
    _check_tokenizer(args, config)
    return config


def _check_tokenizer(args: argparse.Namespace, config: HarnessConfig) -> None:
    """Build the run's local tokenizer now, so an unreadable one is a UsageError before any server
    starts (the run then reuses it: `harness.prompts.local_tokenizer`). The simulated backend counts
    words and has no tokenizer: a --tokenizer for it is refused, not ignored, and so is an empty one."""
    if args.tokenizer is not None and not args.tokenizer.strip():
        raise UsageError(
            f"--tokenizer {args.tokenizer!r}: empty (give a folder, a tokenizer.json or a .gguf file)"
        )
    if config.backend == "simulated":
        if args.tokenizer is not None:
            raise UsageError(
                f"--tokenizer {args.tokenizer}: the simulated backend takes no tokenizer (its prompts are words)"
            )
        return
    if config.tokenizer is None:
        return
    from attention_kv_caceh.harness.prompts import local_tokenizer

    try:
        local_tokenizer(config.tokenizer)
    except ValueError as exc:  # CheckpointError (a GGUF file) is a ValueError and names the file
        flag = "--tokenizer" if args.tokenizer else "--model"
        message = str(exc)
        if not message.startswith("--"):
            message = (
                f"{flag}: {message}"
                if config.tokenizer in message
                else f"{flag} {config.tokenizer}: {message}"
            )
        raise UsageError(message) from None


def input_paths(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """Every file or folder a harness run reads, as (flag, path): no output may replace one of them."""
    engine = args.backend == ENGINE_BACKEND
    return [
        ("--dataset", args.dataset),
        ("--tokenizer", args.tokenizer),
        ("--model", args.model if engine else None),  # the checkpoint folder `serve` and the prompts read
        ("--trace", args.trace),
    ]


def _check_outputs(args: argparse.Namespace) -> None:
    """Every file the run may write, checked up front (none may be an input); raises UsageError naming
    the flag."""
    jsonl: Path | None = args.jsonl
    check_outputs(
        [
            ("--jsonl", jsonl, (".jsonl",)),
            ("--jsonl", None if jsonl is None else meta_path(jsonl), ()),  # its metadata beside it
            ("--summary-json", args.summary_json, (".json",)),
            ("--plot", args.plot, (".png",)),
        ],
        input_paths(args),
    )


async def _run_until_write_fails(
    config: HarnessConfig, sink: JsonlSink, on_record: Callable[[RequestRecord], None]
) -> RunResult | None:
    """`run_harness`, with every finished record passed to `on_record` and to `sink`; the run is
    stopped (None returned) when the sink fails to write. Ctrl-C still raises KeyboardInterrupt."""
    task: asyncio.Task[RunResult] | None = None

    def record_finished(record: RequestRecord) -> None:
        on_record(record)
        if not sink.write(record) and task is not None:
            task.cancel()

    task = asyncio.create_task(run_harness(config, on_record=record_finished))
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if sink.error is None or (current is not None and current.cancelling()):
            raise  # cancelled from outside (Ctrl-C)
        return None


def run(args: argparse.Namespace) -> int:
    """Run the harness from parsed `args`; print the table; write files. Returns the exit code:
    0 ok; 1 a runtime failure (server unreachable or not started, smoke test failed, a request failed,
    an output could not be written), reported as one line on stderr; 2 requests beyond the context the
    server's GET /v1/models names (before any request); 130 interrupted. Raises UsageError for bad input
    (before any file is created or any server started), a --prompt-len / --output-len beyond the
    --backend engine checkpoint's context included."""
    config = config_from_args(args)
    _check_outputs(args)
    harness_repeats.check_repeat_outputs(args, input_paths(args))
    warn_server_temperature(config)
    if args.backend != ENGINE_BACKEND:
        return _run(args, config, None)
    from attention_kv_caceh.harness.engine_server import ServerStartError

    try:
        return harness_engine.run_against_engine(
            args, "harness", lambda url, describe: _run(args, replace(config, base_url=url), describe)
        )
    except ServerStartError as exc:
        error(f"serve --model {args.model}: {exc}")
        return 2 if exc.returncode == 2 else 1  # 2: serve refused the model or a flag (its line above)


def _run(
    args: argparse.Namespace, config: HarnessConfig, describe_server: Callable[[], dict[str, Any]] | None
) -> int:
    """The run against `config`'s backend; `describe_server()`: the engine server's description for the
    outputs, asked for after the run while the server still runs."""
    print(
        f"harness: backend={args.backend} "
        + (f"base_url={config.base_url} " if config.backend != "simulated" else "")
        + (
            f"server_slots={config.server_slots} prefill_ms={config.prefill_ms} "
            f"per_token_ms={config.per_token_ms} "
            if config.backend == "simulated"
            else ""
        )
        + f"num_requests={config.num_requests} concurrency={config.concurrency} "
        + (
            f"request_rate={config.request_rate} prompt_len={config.prompt_len} output_len={config.output_len}"
            if config.trace is None
            else "(arrivals and lengths from the trace)"
        )
        + "".join(f" {k}={v}" for k, v in config.sampling.body_fields().items())
        + harness_options.setup_words(config, args.repeats),
        flush=True,
    )
    if args.repeats > 1:
        return harness_repeats.run_repeats(args, config, describe_server)
    finished: list[RequestRecord] = []
    sink = JsonlSink(args.jsonl)
    progress = tqdm(
        total=config.num_requests,
        unit="req",
        file=sys.stderr,
        delay=3.0,
        disable=not sys.stderr.isatty(),
    )

    def on_record(record: RequestRecord) -> None:
        if not record.probe:  # probes are written to the JSONL, never summarized with the load
            finished.append(record)
            progress.update(1)

    result: RunResult | None = None
    interrupted = False
    with contextlib.ExitStack() as after_interrupt:
        try:
            result = asyncio.run(_run_until_write_fails(config, sink, on_record))
        except (SmokeTestError, ModelDiscoveryError) as exc:
            progress.close()
            error(exc)
            return 1
        except ContextLengthError as exc:  # bad input, known once the server named its context
            progress.close()
            error(exc)
            return 2
        except KeyboardInterrupt:
            # A second Ctrl-C (a terminal sends one to `uv` too, which forwards it) must not cut short
            # the save of what the run finished: SIGINT is ignored from here to the end.
            after_interrupt.enter_context(ignoring_sigint())
            interrupted = True
        finally:
            progress.close()
            sink.close()
        return report_and_save(
            args, config, sink, finished, result, interrupted=interrupted, describe_server=describe_server
        )
