"""`harness --backend engine`: the project's own `serve` in a child process, for the length of one run.

    attention-kv-caceh harness --backend engine --model MODEL [--max-num-seqs 4 ...] [load and output flags]

The harness checks the flags (UsageError, exit 2, before anything starts), starts `serve --model MODEL --host
127.0.0.1 --port 0 [the engine flags given]` with `harness.engine_server.serve_process`, waits for
`/health`, runs the usual openai-completions path against it with the checkpoint's own tokenizer (so
prompt lengths are exact), records the server's command and engine settings under "server" in the
summary JSON and the JSONL's .meta.json, and stops the child on the way out: at the end, on an error, on
Ctrl-C or SIGTERM (both reach the harness as KeyboardInterrupt; see cli/__init__.py).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from attention_kv_caceh.cli.common import OneLineParser, UsageError
from attention_kv_caceh.cli.engine_args import (
    add_engine_arguments,
    engine_config_kwargs,
    engine_flags_given,
    load_model_config,
    model_source,
)
from attention_kv_caceh.cli.serve import add_arguments as add_serve_arguments
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.harness.config import ENGINE_BACKEND, HarnessConfig
from attention_kv_caceh.harness.discovery import context_problem
from attention_kv_caceh.harness.engine_server import ServerProcess, engine_step_summary

__all__ = [
    "ENGINE_BACKEND",
    "add_arguments",
    "check_context",
    "check_usage",
    "engine_flags",
    "run_against_engine",
    "run_maybe_with_engine",
    "server_description",
]

_DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the engine flags (passed on to `serve`; None when not given)."""
    group = parser.add_argument_group(
        "engine backend (--backend engine: serve --model MODEL runs in a child process for the run)"
    )
    add_engine_arguments(group, defaults=False)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags that were given, as `serve` argv (e.g. ["--max-num-seqs", "4"])."""
    return engine_flags_given(args)


def check_usage(args: argparse.Namespace) -> str:
    """Check the backend/flag combination; returns the base URL the run should use until a server's is
    known. Raises UsageError: --backend engine without --model, with a --model that names no checkpoint
    (`model_executor.model_source.resolve_model`) or a folder lacking tokenizer.json when no --tokenizer is given,
    or with --base-url; an engine flag with another backend."""
    given = engine_flags(args)
    if args.backend != ENGINE_BACKEND:
        if given:
            raise UsageError(f"{given[0]} is an engine flag: it needs --backend {ENGINE_BACKEND}")
        return args.base_url or _DEFAULT_BASE_URL
    if not args.model:
        raise UsageError(
            f"--backend {ENGINE_BACKEND} needs --model MODEL (a model name such as smollm2, a .gguf file, "
            "or a checkpoint folder, see make-model)"
        )
    source = model_source(args.model)  # UsageError naming the value when it names no checkpoint
    if args.base_url is not None:
        raise UsageError(
            f"--base-url {args.base_url}: --backend {ENGINE_BACKEND} starts its own server "
            "(use --backend openai-completions to reach a running one)"
        )
    if args.tokenizer is None and source.format == "hf" and not (source.path / "tokenizer.json").is_file():
        # the checkpoint's tokenizer serves and builds the prompts: name the flag that was given
        raise UsageError(f"--model {args.model}: no tokenizer.json in that folder")
    return _DEFAULT_BASE_URL


def check_context(args: argparse.Namespace, config: HarnessConfig) -> None:
    """UsageError when `config`'s synthetic requests cannot fit the model's context: a --prompt-len of
    max_model_len tokens or more (the server refuses it, HTTP 400), or --prompt-len + --output-len above
    it (the server caps max_tokens to the context left, so the outputs would be shorter than asked).
    max_model_len is --max-model-len when given, else the checkpoint's `max_position_embeddings`. A
    config the engine cannot read is a UsageError too, before `serve` starts; dataset prompts are
    counted later, by the run (`harness.run.check_context`)."""
    try:
        _, checkpoint = load_model_config(model_source(args.model).path)
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError
        message = str(exc)  # a CheckpointError names the file
        raise UsageError(
            f"--model: {message}" if args.model in message else f"--model {args.model}: {message}"
        ) from None
    limit: int = args.max_model_len or checkpoint.max_position_embeddings
    source = "--max-model-len" if args.max_model_len else "the checkpoint's max_position_embeddings"
    message = context_problem(config, limit, f"max_model_len {limit} ({source})")
    if message is not None:
        raise UsageError(message)


def server_description(server: ServerProcess, args: argparse.Namespace) -> dict[str, Any]:
    """What the summary records of the server: its argv, the engine flags given, every EngineConfig
    field those flags set (serve's defaults filled in), and `engine_steps`, the summary of the engine's
    own StepStats (`engine_step_summary`; `{"error": ...}` when they cannot be read). Call it after the
    run, while the server still runs."""
    parser = OneLineParser(prog="serve", add_help=False)
    add_serve_arguments(parser)
    flags = engine_flags(args)
    given = engine_config_kwargs(parser.parse_args(["--model", str(args.model), *flags]))
    settings = dataclasses.asdict(EngineConfig(**given))  # pyright: ignore[reportArgumentType]
    try:
        steps: dict[str, Any] = engine_step_summary(server.base_url, timeout_s=10.0)
    except (OSError, ValueError, KeyError) as exc:
        steps = {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "command": list(server.command),
        "flags": flags,
        "engine_config": settings,
        "base_url": server.base_url,
        "engine_steps": steps,
    }


def run_against_engine(
    args: argparse.Namespace, command: str, run: Callable[[str, Callable[[], dict[str, Any]]], int]
) -> int:
    """`--backend engine`: start `serve` on `args.model` with the engine flags given, call
    `run(base_url, describe)` while it is healthy (`describe()`: the server's description for the outputs,
    to be asked for while it still runs), then stop it; returns run's exit code. `command` prefixes the two
    lines printed. Raises harness.engine_server.ServerStartError when serve does not become healthy."""
    from attention_kv_caceh.harness.engine_server import serve_process

    flags = engine_flags(args)
    print(f"{command}: starting serve --model {args.model} {' '.join(flags)}".rstrip(), flush=True)
    with serve_process(args.model, flags) as server:
        print(f"{command}: serve (pid {server.pid}) is healthy at {server.base_url}", flush=True)
        return run(server.base_url, lambda: server_description(server, args))


def run_maybe_with_engine(
    args: argparse.Namespace,
    command: str,
    config: HarnessConfig,
    run: Callable[[HarnessConfig, Callable[[], dict[str, Any]] | None], int],
    error: Callable[[str], None],
) -> int:
    """`run(config, None)`, or with `--backend engine` `run(config at the server's URL, describe)`
    while `serve` runs (`run_against_engine`); a serve that does not become healthy is one `error`
    line and exit 1 (2 when serve refused the model or a flag: its own line is above)."""
    if args.backend != ENGINE_BACKEND:
        return run(config, None)
    from attention_kv_caceh.harness.engine_server import ServerStartError

    try:
        return run_against_engine(
            args, command, lambda url, describe: run(dataclasses.replace(config, base_url=url), describe)
        )
    except ServerStartError as exc:
        error(f"serve --model {args.model}: {exc}")
        return 2 if exc.returncode == 2 else 1
