"""`attention-kv-caceh harness`: the streaming serving harness (TTFT, ITL, TPOT, E2EL per request).

Flags (the fields of `harness.config.HarnessConfig`, `Workload`, `SamplingOptions`, `TraceSettings`,
`harness.run_files.HarnessOutputs`, and the engine's for `--backend engine`) -> config, every value
checked (UsageError naming the flag) before any output file is created -> `run_recorded` (or
`run_repeats`), which writes the per-request JSONL line by line as requests finish, its
`<jsonl>.meta.json`, the summary JSON and the timeline -> print a setup line and the summary table
(`harness.summary_text`). `--backend engine` starts the project's own `serve` for the run
(cli/harness_engine.py). Ctrl-C (or SIGTERM) keeps every finished request in the JSONL and still saves
and prints a summary of them. Runtime failures (server unreachable, smoke test failed, failed
requests, an output that cannot be written) print one line `attention-kv-caceh: error: ...` on stderr
and return 1; only files actually written are listed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attention_kv_caceh.cli import flags, harness_engine
from attention_kv_caceh.cli.common import PROG, UsageError, check_outputs
from attention_kv_caceh.files import meta_path
from attention_kv_caceh.harness.config import DEFAULT_NUM_REQUESTS, ENGINE_BACKEND, HarnessConfig
from attention_kv_caceh.harness.run_files import HarnessOutputs, repeat_path
from attention_kv_caceh.harness.run_text import failure_line, one_line
from attention_kv_caceh.harness.sampling import SamplingOptions
from attention_kv_caceh.harness.trace import TraceSettings, read_trace
from attention_kv_caceh.harness.workloads import Workload
from attention_kv_caceh.options import flag_of, option

__all__ = ["HELP", "add_arguments", "config_from_args", "error", "run", "warn_server_temperature"]

HELP = (
    "streaming serving harness: TTFT, ITL, TPOT, E2EL per request "
    "(simulated, OpenAI-compatible, or the project's own engine)"
)
_SAMPLING = (
    "sampling (HTTP backends: each field is sent in every request body only when given; the server's "
    "defaults decide the rest, temperature 1.0 on vLLM and on serve)"
)
_OWNERS = (Workload, SamplingOptions, TraceSettings)
EXIT = {"complete": 0, "failed": 1, "refused": 2, "interrupted": 130}


@dataclass(frozen=True)
class _Key:
    api_key_env: str = option(
        "OPENAI_API_KEY",
        help="name of the environment variable holding the API key (unset: no key sent)",
    )


def add_arguments(parser: argparse.ArgumentParser, *, sweep: bool = False) -> None:
    """Declare the harness's flags on `parser` in their groups. With `sweep`, `--concurrency` and
    `--request-rate` take several values (`SweepOptions`, cli/sweep.py) and the one-run outputs
    (--jsonl, --summary-json, --plot, --repeats) are left out."""
    from attention_kv_caceh.harness.sweep_run import SweepOptions

    unset = {"base_url": None, "num_requests": None, "prompt_len": None, "output_len": None}
    groups: list[tuple[str, list[tuple[type, tuple[str, ...]]]]] = [
        ("backend", [(HarnessConfig, ("backend", "base_url", "model")), (_Key, ()),
                     (HarnessConfig, ("timeout_s", "ignore_eos", "smoke_test"))]),
        ("load", [(HarnessConfig, ("num_requests",)),
                  (SweepOptions if sweep else HarnessConfig, ("concurrency", "request_rate")),
                  (HarnessConfig, ("burstiness", "seed", "prompt_len", "output_len", "tokenizer", "dataset")),
                  (Workload, ()), (HarnessConfig, ("warmup_requests",))]),
        ("trace replay (docs/serving.md#trace-replay)", [(TraceSettings, ())]),
        ("probes and client processes", [(HarnessConfig, ("probe_rate", "workers")),
                                         *([] if sweep else [(HarnessOutputs, ("repeats",))])]),
        (_SAMPLING, [(SamplingOptions, ())]),
        ("simulated backend", [(HarnessConfig, ("server_slots", "prefill_ms", "per_token_ms"))]),
        ("outputs", [*([] if sweep else [(HarnessOutputs, ("jsonl", "summary_json", "plot"))]),
                     (HarnessConfig, ("goodput", "label", "server_metrics_interval_s"))]),
    ]  # fmt: skip
    for title, parts in groups:
        group = parser.add_argument_group(title)
        for cls, only in parts:
            prefix = "trace_" if cls is TraceSettings else ""
            defaults = {"format": None} if cls is TraceSettings else unset
            flags.add_options(group, cls, only=only or None, defaults=defaults, dest_prefix=prefix)
    harness_engine.add_arguments(parser)


def warn_server_temperature(config: HarnessConfig) -> None:
    """One line on stderr, as vLLM's `bench serve` prints, when an HTTP run gives no --temperature."""
    if config.backend != "simulated" and config.sampling.temperature is None:
        print(
            "warning: no --temperature given: the server's default decides (1.0 on vLLM and serve, a random "
            "draw per token); pass --temperature 0 for greedy",
            file=sys.stderr,
        )


def error(message: object) -> None:
    """Print a runtime error as the one line `attention-kv-caceh: error: ...` on stderr."""
    print(f"{PROG}: error: {one_line(message, 1000)}", file=sys.stderr)


def _trace(args: argparse.Namespace) -> TraceSettings | None:
    """The TraceSettings of the flags, or None without --trace. A trace flag without --trace, or a
    length flag with it (the rows give the lengths; one shapes only --warmup-requests, so it is taken
    when there are some), is a UsageError naming it."""
    if args.trace_path is None:
        for name in ("format", "block_size", "speedup"):
            if getattr(args, f"trace_{name}") not in (None, 1.0):
                raise UsageError(f"{flag_of(TraceSettings, name)} needs --trace FILE")
        return None
    for name in () if args.warmup_requests else ("prompt_len", "output_len"):
        if getattr(args, name) is not None:
            raise UsageError(
                f"{flag_of(HarnessConfig, name)} {getattr(args, name)}: the trace's rows give every request's "
                "lengths (it would shape only --warmup-requests, and there are none)"
            )
    fmt = args.trace_format or "mooncake"
    return flags.config_from_args(TraceSettings, args, dest_prefix="trace_", format=fmt)


def config_from_args(args: argparse.Namespace, **values: Any) -> HarnessConfig:
    """Build and validate the HarnessConfig (`values` win over the flags). Raises UsageError naming
    the flag of the offending value."""
    engine = args.backend == ENGINE_BACKEND
    base_url = harness_engine.check_usage(args)  # the engine's own URL replaces it once it serves
    trace = _trace(args)
    try:
        count = args.num_requests
        if count is None:  # 0 is given, and refused by HarnessConfig
            count = len(read_trace(trace)) if trace is not None else DEFAULT_NUM_REQUESTS
    except ValueError as exc:
        raise flags.usage_error(TraceSettings, exc) from None
    given = argparse.Namespace(**{k: v for k, v in vars(args).items() if v is not None})
    config = flags.config_from_args(
        HarnessConfig,
        given,
        *_OWNERS,
        backend="openai-completions" if engine else args.backend,
        base_url=base_url,
        model="" if engine else args.model,
        api_key=os.environ.get(args.api_key_env) or None,
        num_requests=count,
        tokenizer=args.tokenizer or (args.model if engine else None),
        workload=flags.config_from_args(Workload, args),
        sampling=flags.config_from_args(SamplingOptions, args),
        trace=trace,
        **values,
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
        ("--trace", args.trace_path),
    ]


def _check_outputs(args: argparse.Namespace, outputs: HarnessOutputs) -> None:
    """Every file the run may write (with --repeats N, each repeat's), checked up front (none may be
    an input); raises UsageError naming the flag."""

    def each(path: Path | None) -> list[Path]:
        if path is None:
            return []
        return [path] + [repeat_path(path, i) for i in range(outputs.repeats) if outputs.repeats > 1]

    jsonls = [(p, what) for p in each(outputs.jsonl) for what in (p, meta_path(p))]
    check_outputs(
        [("--jsonl", what, (".jsonl",) if what == p else ()) for p, what in jsonls]
        + [("--summary-json", outputs.summary_json, (".json",))]
        + [("--plot", p, (".png",)) for p in each(outputs.plot)],
        input_paths(args),
    )


def run(args: argparse.Namespace) -> int:
    """Run the harness from parsed `args`; print the table; write files. Returns the exit code:
    0 ok; 1 a runtime failure (server unreachable or not started, smoke test failed, a request failed,
    an output could not be written), reported as one line on stderr; 2 requests beyond the context the
    server's GET /v1/models names (before any request); 130 interrupted. Raises UsageError for bad input
    (before any file is created or any server started), a --prompt-len / --output-len beyond the
    --backend engine checkpoint's context included."""
    config = config_from_args(args)
    outputs = flags.config_from_args(HarnessOutputs, args)
    _check_outputs(args, outputs)
    warn_server_temperature(config)
    return harness_engine.run_maybe_with_engine(
        args, "harness", config, lambda cfg, describe: _run(args, cfg, outputs, describe), error
    )


def _run(
    args: argparse.Namespace,
    config: HarnessConfig,
    outputs: HarnessOutputs,
    describe_server: Callable[[], dict[str, Any]] | None,
) -> int:
    """The run against `config`'s backend; `describe_server()`: the engine server's description for the
    outputs, asked for after the run while the server still runs."""
    from tqdm import tqdm

    from attention_kv_caceh.harness.load import SmokeTestError
    from attention_kv_caceh.harness.repeat_run import run_repeats
    from attention_kv_caceh.harness.run import ContextLengthError, ModelDiscoveryError
    from attention_kv_caceh.harness.run_files import run_recorded
    from attention_kv_caceh.harness.run_text import format_engine_steps, setup_line
    from attention_kv_caceh.harness.summary_text import format_summary

    print(setup_line(args.backend, config, outputs.repeats), flush=True)
    if outputs.repeats > 1:
        done = run_repeats(config, outputs, describe_server, lambda line: print(line, flush=True), error)
        if done.ending == "interrupted":
            print(f"{PROG}: interrupted; {len(done.results)} finished repeats kept", file=sys.stderr)
        return EXIT[done.ending] or (0 if done.results else 1)
    progress = tqdm(
        total=config.num_requests, unit="req", file=sys.stderr, delay=3.0, disable=not sys.stderr.isatty()
    )
    try:
        out = run_recorded(
            config,
            outputs,
            on_record=lambda _: (progress.update(1), None)[1],
            describe_server=describe_server,
        )
    except (SmokeTestError, ModelDiscoveryError) as exc:
        error(exc)
        return 1
    except ContextLengthError as exc:  # bad input, known once the server named its context
        error(exc)
        return 2
    finally:
        progress.close()
    if out.sink.error is not None:
        error(
            f"could not write --jsonl {outputs.jsonl}: {out.sink.error}; run stopped "
            f"({out.sink.count} of {len(out.finished)} finished requests written)"
        )
        return 1
    if out.interrupted:
        kept = f" in {outputs.jsonl}" if out.sink.opened else ""
        print(f"{PROG}: interrupted; {len(out.finished)} finished requests kept{kept}", file=sys.stderr)
    if out.summary is None:
        return 130
    print(format_summary(out.summary))
    if out.server is not None:
        print(format_engine_steps(out.server))
    if out.written:
        print("wrote: " + ", ".join(out.written))
    if out.save_error is not None:
        error(f"could not write an output file: {out.save_error}")
        return 1
    failures = None if out.result is None else failure_line(out.result.records)
    if failures is not None:
        error(failures)
    return 130 if out.result is None else 1 if failures else 0
