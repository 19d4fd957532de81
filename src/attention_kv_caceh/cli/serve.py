"""`attention-kv-caceh serve`: the engine behind an OpenAI-compatible HTTP server (vLLM's `vllm serve`).

    attention-kv-caceh serve --model MODEL [--port 8000] [--max-num-seqs 8] [--api-key-env VAR] ...

Starts the engine core in a process of its own (engine/core.py: it loads the checkpoint and runs the
step loop; `ps -o pid,comm` shows it as EngineCore) and serves, from this process, `/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/health`, `/tokenize`, `/detokenize` and `/metrics` (the OpenAI server's `build_app`) with uvicorn. Prints
the KV pool (`KV cache: N KV blocks of B tokens (P positions, X MiB)`) and the engine core's threads on
stderr, then one line `serving NAME at http://HOST:PORT` on stdout once the socket listens (with `--port 0`, the port the
system chose; an IPv6 host in brackets, `http://[::1]:8000`). The default host is 127.0.0.1 (loopback):
a non-loopback `--host` (0.0.0.0, a LAN address, a host name) is allowed, but without `--api-key-env` it
prints a one-line warning on stderr, since anyone who reaches the port can then use the server. Ctrl-C or SIGTERM drains: no new connection is accepted, running requests get up to
`--drain-timeout` seconds to finish, the rest are aborted, and the command exits 0. A second Ctrl-C or
SIGTERM during the drain is ignored (`uv run` and `timeout` deliver the group's SIGTERM twice); the drain
ends by itself within --drain-timeout: streams still running then end with a finish_reason "abort" chunk
and `[DONE]`. The engine core stops with the server, and exits by itself when this process dies (even by
SIGKILL). A dead engine core makes /health answer 503 and new requests 503. Also runnable as
`python -m attention_kv_caceh.cli.serve ...` (what the harness's launcher starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import TYPE_CHECKING

from attention_kv_caceh.cli.common import PROG, CommandFailed, UsageError, warn_if_threads_busy
from attention_kv_caceh.cli.engine_args import add_engine_arguments, engine_config_kwargs, plan_engine
from attention_kv_caceh.cli.flags import add_options, config_from_args
from attention_kv_caceh.cpu_load import FOLLOWS_LOAD
from attention_kv_caceh.cpus import CpuSet, default_threads, numba_pool_size, threads_note
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.entrypoints.launcher import is_loopback, listen, serve_http, url_of
from attention_kv_caceh.entrypoints.openai.cli_args import ServeConfig
from attention_kv_caceh.report.generate import kv_pool_text

if TYPE_CHECKING:
    from attention_kv_caceh.engine.async_llm import AsyncLLM

HELP = "serve the engine over HTTP with vLLM's OpenAI-compatible endpoints and metrics"

_LISTEN = ("model", "served_model_name", "host", "port")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of `serve`: ServeConfig's fields and the engine's (EngineConfig's)."""
    add_options(parser, ServeConfig, only=_LISTEN)
    engine = parser.add_argument_group("engine")
    add_engine_arguments(engine)
    add_options(engine, ServeConfig, only=("engine_core_cpu",))
    add_options(parser.add_argument_group("server"), ServeConfig, exclude=(*_LISTEN, "engine_core_cpu"))


def _api_key(var: str | None) -> str | None:
    if var is None:
        return None
    key = os.environ.get(var, "")
    if not key:
        raise UsageError(f"--api-key-env {var}: the environment variable is not set or empty")
    return key


def run(args: argparse.Namespace) -> int:
    """Start the engine core, serve until Ctrl-C / SIGTERM; returns 0 after the drain.

    Raises UsageError (bad folder, unset --api-key-env variable, the engine checks of
    `engine_args.plan_engine` that generate makes too, a port in use, an --engine-core-cpu this process
    may not use) before loading anything, CommandFailed when the engine core cannot load the checkpoint.
    """
    from attention_kv_caceh.engine.async_llm import AsyncLLM
    from attention_kv_caceh.engine.core_client import EngineDeadError
    from attention_kv_caceh.engine.malloc import fix_mmap_threshold
    from attention_kv_caceh.entrypoints.chat_utils import load_chat_template
    from attention_kv_caceh.entrypoints.openai.api_server import build_app

    # before any worker thread allocates: a big prompt's buffers then go back to the OS when freed
    # (engine/malloc.py says why glibc's dynamic threshold kept them resident)
    fix_mmap_threshold()
    serve = config_from_args(ServeConfig, args)
    api_key = _api_key(serve.api_key_env)
    plan = plan_engine(serve.model, engine_config_kwargs(args))  # generate's checks: exit 2, no weights read
    spec = plan.engine_config.speculative_config
    model_path = plan.source.path  # the folder or GGUF file --model names
    cpu = _core_cpu(serve.engine_core_cpu)
    plan = dataclasses.replace(plan, engine_config=_core_threads(plan.engine_config, cpu))
    if not plan.engine_config.follow_load and plan.engine_config.threads is not None:
        warn_if_threads_busy("serve", (plan.engine_config.threads,))  # a count given is kept
    name = plan.source.name if serve.served_model_name is None else serve.served_model_name
    try:
        sock = listen(serve.host, serve.port)
    except OSError as exc:
        raise UsageError(f"cannot listen on {serve.host}:{serve.port}: {exc.strerror or exc}") from None
    llm: AsyncLLM | None = None
    try:
        try:
            chat_template = load_chat_template(model_path)
            llm = AsyncLLM.from_checkpoint(
                str(model_path), plan.engine_config, plan.tokenizer, plan.max_model_len, cpu=cpu
            )
        except (ValueError, OSError, EngineDeadError) as exc:
            raise CommandFailed(f"cannot load {serve.model}: {exc}") from None
        if cpu is not None:
            others = os.sched_getaffinity(0) - {cpu}
            if others:
                os.sched_setaffinity(0, others)
        app = build_app(
            llm,
            plan.tokenizer,
            name,
            plan.max_model_len,
            api_key=api_key,
            max_queue=serve.max_queue,
            chat_template=chat_template,
            drain_timeout_s=serve.drain_timeout,
            max_request_bytes=serve.max_request_bytes,
            max_request_bytes_in_flight=serve.bytes_in_flight,
            max_logprobs=serve.max_logprobs,
            max_seqs_per_request=serve.max_seqs_per_request,
            cache_config={
                "block_size": str(plan.engine_config.block_size),
                "num_gpu_blocks": str(plan.num_blocks),
                "enable_prefix_caching": str(plan.engine_config.enable_prefix_caching),
            },
            num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
            enable_auto_tool_choice=serve.enable_auto_tool_choice,
            tool_call_parser=serve.tool_call_parser,
        )
        if not is_loopback(serve.host) and api_key is None:
            print(
                f"{PROG} serve: warning: listening on {serve.host}, not a loopback address, without "
                "--api-key-env: anyone who can reach this machine can use the server",
                file=sys.stderr,
                flush=True,
            )

        def announce(port: int) -> None:
            pool = kv_pool_text(plan.num_blocks, plan.engine_config.block_size, plan.bytes_per_block)
            print(f"KV cache: {pool}", file=sys.stderr, flush=True)
            note = threads_note(threads, None if cpu is None else CpuSet((cpu,), None))
            if plan.engine_config.follow_load:
                note += f"; {FOLLOWS_LOAD}"
            print(note, file=sys.stderr, flush=True)
            print(f"serving {name} at {url_of(serve.host, port)}", flush=True)

        threads = plan.engine_config.resolved_threads()

        serve_http(app, llm, sock, serve.drain_timeout, announce)
    finally:
        sock.close()
        if llm is not None:
            llm.client.close()  # idempotent: the core is already stopped after a drain
    return 0


def _core_threads(config: EngineConfig, cpu: int | None) -> EngineConfig:
    """The engine config with its threads fixed here: --threads, or the default of a server (one CPU
    left to this process on four or more; 1 with --engine-core-cpu), which follows the load
    (`EngineConfig.follow_load`). UsageError for --threads above 1
    with --engine-core-cpu (the core then has one CPU)."""
    if cpu is not None:
        if config.threads not in (None, 1):
            raise UsageError(f"--threads {config.threads}: --engine-core-cpu {cpu} gives the core one CPU")
        return dataclasses.replace(config, threads=1)
    if config.threads is not None:
        return config
    threads = min(default_threads(serving=True), numba_pool_size())
    return dataclasses.replace(config, threads=threads, follow_load=True)


def _core_cpu(cpu: int | None) -> int | None:
    """--engine-core-cpu checked against the CPUs this process may use (UsageError otherwise)."""
    if cpu is None:
        return None
    if not hasattr(os, "sched_getaffinity"):
        raise UsageError("--engine-core-cpu: this platform cannot pin processes to CPUs")
    allowed = sorted(os.sched_getaffinity(0))
    if cpu not in allowed:
        raise UsageError(f"--engine-core-cpu {cpu}: not one of the CPUs this process may use {allowed}")
    return cpu


def main(argv: list[str] | None = None) -> int:
    """`python -m attention_kv_caceh.cli.serve ARGS`: the same as `attention-kv-caceh serve ARGS` (one
    parser, the one mapping of errors to exit codes in `cli.main`)."""
    from attention_kv_caceh.cli import main as cli_main

    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
