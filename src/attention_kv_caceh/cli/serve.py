"""`attention-kv-caceh serve`: the engine behind an OpenAI-compatible HTTP server (vLLM's `vllm serve`).

    attention-kv-caceh serve --model MODEL [--port 8000] [--max-num-seqs 8] [--api-key-env VAR] ...

Starts the engine core in a process of its own (engine/core.py: it loads the checkpoint and runs the
step loop; `ps -o pid,comm` shows it as EngineCore) and serves, from this process, `/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/health`, `/tokenize`, `/detokenize` and `/metrics` (the OpenAI server's `build_app`) with uvicorn. Prints
one line `serving NAME at http://HOST:PORT` on stdout once the socket listens (with `--port 0`, the port the
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
import asyncio
import contextlib
import gc
import ipaddress
import os
import signal
import socket
import sys
import threading
from collections.abc import Generator
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from attention_kv_caceh.cli.common import PROG, CommandFailed, UsageError
from attention_kv_caceh.cli.engine_args import add_engine_arguments, engine_config_kwargs, plan_engine
from attention_kv_caceh.cli.flags import add_options, config_from_args
from attention_kv_caceh.serve_args import ServeConfig

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


def is_loopback(host: str) -> bool:
    """True for "localhost" and the loopback addresses (127.0.0.0/8, ::1); False for any other host."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def url_of(host: str, port: int) -> str:
    """`http://HOST:PORT`, an IPv6 address in brackets (RFC 3986's IP-literal)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _api_key(var: str | None) -> str | None:
    if var is None:
        return None
    key = os.environ.get(var, "")
    if not key:
        raise UsageError(f"--api-key-env {var}: the environment variable is not set or empty")
    return key


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only when the listening
    # socket says TCP explicitly; with Nagle on, each streamed chunk on a reused connection waited for
    # the client's delayed ACK (about 40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    return sock


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
    in_flight = serve.bytes_in_flight
    if in_flight < serve.max_request_bytes:
        raise UsageError(
            f"--max-request-bytes-in-flight {in_flight}: below --max-request-bytes "
            f"{serve.max_request_bytes}, a body of the largest size could never be served"
        )
    plan = plan_engine(serve.model, engine_config_kwargs(args))  # generate's checks: exit 2, no weights read
    spec = plan.engine_config.speculative_config
    model_path = plan.source.path  # the folder or GGUF file --model names
    cpu = _core_cpu(serve.engine_core_cpu)
    name = plan.source.name if serve.served_model_name is None else serve.served_model_name
    sock = _listen(serve.host, serve.port)
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
            max_request_bytes_in_flight=in_flight,
            max_logprobs=serve.max_logprobs,
            max_seqs_per_request=serve.max_seqs_per_request,
            kv_capacity_tokens=plan.num_blocks * plan.engine_config.block_size,
            cache_config={
                "block_size": str(plan.engine_config.block_size),
                "num_gpu_blocks": str(plan.num_blocks),
                "enable_prefix_caching": str(plan.engine_config.enable_prefix_caching),
            },
            num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
        )
        # vLLM's freeze_gc_heap: what startup built (modules, the app, the tokenizer) lives as long as the
        # server, so the collector's oldest generation need not traverse it; a full collection stops
        # every stream on the event loop for as long as it traverses (unfrozen when serving ends)
        gc.collect()
        gc.freeze()
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        port = sock.getsockname()[1]
        if not is_loopback(serve.host) and api_key is None:
            print(
                f"{PROG} serve: warning: listening on {serve.host}, not a loopback address, without "
                "--api-key-env: anyone who can reach this machine can use the server",
                file=sys.stderr,
                flush=True,
            )
        server = _DrainingServer(config, llm, serve.drain_timeout)
        with server.draining_on_signals():  # before the announcement: a SIGTERM right after it drains
            print(f"serving {name} at {url_of(serve.host, port)}", flush=True)
            asyncio.run(server.serve(sockets=[sock]))
    finally:
        gc.unfreeze()  # a caller in the same process (a test) is not left with a frozen heap
        sock.close()
        if llm is not None:
            llm.client.close()  # idempotent: the core is already stopped after a drain
    return 0


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


class _DrainingServer(uvicorn.Server):
    """uvicorn's Server that drains the engine before it closes the connections.

    Ctrl-C / SIGTERM: stop accepting, drain AsyncLLM (running requests get `drain_timeout_s`, the rest end
    with a finish_reason "abort" chunk and `[DONE]`), then uvicorn's own shutdown closes the connections
    that are now complete (no stream is cancelled mid-write). Its signal handlers return instead of
    re-raising the signal after the shutdown (which would end the process by the signal, not exit 0).
    """

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.llm = llm
        self.drain_timeout_s = drain_timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        await self.llm.shutdown(self.drain_timeout_s)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None]:
        yield  # `draining_on_signals` installed the handlers before the URL was announced

    @contextlib.contextmanager
    def draining_on_signals(self) -> Generator[None]:
        """Ctrl-C / SIGTERM start the drain (uvicorn's should_exit) while the block runs."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only
            return

        def handle(signum: int, frame: FrameType | None) -> None:
            # A second signal during the drain is ignored: `uv run` and `timeout` forward a SIGTERM the
            # process group already got, and uvicorn's force exit would skip the drain. The drain is
            # bounded by --drain-timeout anyway.
            self.should_exit = True

        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, handle) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    """`python -m attention_kv_caceh.cli.serve`: parse, run, map errors to exit codes (2 usage, 1 failure)."""
    parser = argparse.ArgumentParser(prog="attention-kv-caceh serve", description=HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UsageError as exc:
        print(f"attention-kv-caceh serve: error: {exc}", file=sys.stderr)
        return 2
    except (CommandFailed, OSError) as exc:
        print(f"attention-kv-caceh serve: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
