"""`attention-kv-caceh serve`: the engine behind an OpenAI-compatible HTTP server (vLLM's `vllm serve`).

    attention-kv-caceh serve --model DIR [--port 8000] [--max-num-seqs 8] [--api-key-env VAR] ...

Loads the checkpoint folder into the engine, then serves `/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/health`, `/tokenize`, `/detokenize` and `/metrics` (engine/server.py) with uvicorn. Prints
one line `serving NAME at http://HOST:PORT` on stdout once the socket listens (with `--port 0`, the port the
system chose; an IPv6 host in brackets, `http://[::1]:8000`). The default host is 127.0.0.1 (loopback):
a non-loopback `--host` (0.0.0.0, a LAN address, a host name) is allowed, but without `--api-key-env` it
prints a one-line warning on stderr, since anyone who reaches the port can then use the server. Ctrl-C or SIGTERM drains: no new connection is accepted, running requests get up to
`--drain-timeout` seconds to finish, the rest are aborted, and the command exits 0. A second Ctrl-C or
SIGTERM during the drain is ignored (`uv run` and `timeout` deliver the group's SIGTERM twice); the drain
ends by itself within --drain-timeout. Also runnable as
`python -m attention_kv_caceh.cli.serve ...` (what the harness's launcher starts).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import os
import signal
import socket
import sys
import threading
from collections.abc import Generator
from pathlib import Path
from types import FrameType

import uvicorn

from attention_kv_caceh.cli.common import (
    PROG,
    CommandFailed,
    UsageError,
    nonnegative_float,
    nonnegative_int,
    positive_int,
)
from attention_kv_caceh.cli.engine_args import engine_config_kwargs, plan_engine

HELP = "serve the engine over HTTP with vLLM's OpenAI-compatible endpoints and metrics"

_DTYPES = ("float32", "float64")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of `serve`."""
    parser.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="checkpoint folder (config.json, ...) (default: none, required)",
    )
    parser.add_argument(
        "--served-model-name", metavar="NAME", help="model name clients send (default: the folder's name)"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; a non-loopback one without --api-key-env prints a warning",
    )
    parser.add_argument("--port", type=port_number, default=8000, help="port in 0..65535 (0: any free port)")
    add_engine_arguments(parser.add_argument_group("engine"))
    server = parser.add_argument_group("server")
    server.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="require `Authorization: Bearer <key>` with the key read from this environment variable "
        "(default: no key)",
    )
    server.add_argument(
        "--max-queue",
        type=nonnegative_int,
        metavar="N",
        help="answer 503 when more than N requests would wait (default: no limit)",
    )
    server.add_argument(
        "--max-logprobs",
        type=nonnegative_int,
        default=20,
        metavar="K",
        help="most `logprobs` / `top_logprobs` a request may ask for (vLLM's flag; above it: 400)",
    )
    server.add_argument(
        "--drain-timeout",
        type=nonnegative_float,
        default=30.0,
        metavar="S",
        help="seconds running requests get to finish at Ctrl-C / SIGTERM",
    )


# (flag, default) of every engine flag; `harness --backend engine` passes the ones it was given to `serve`.
ENGINE_DEFAULTS: dict[str, object] = {
    "--max-num-seqs": 8,
    "--max-num-batched-tokens": 512,
    "--block-size": 16,
    "--kv-cache-memory": None,
    "--num-kv-blocks": None,
    "--max-model-len": None,
    "--dtype": "float32",
    "--no-prefix-caching": False,
}


def add_engine_arguments(group: argparse._ArgumentGroup, *, defaults: bool = True) -> None:  # pyright: ignore[reportPrivateUsage]
    """Declare the engine flags on `group`; `defaults=False` leaves every default None (so that a caller
    can tell which were given) and says in the help that serve's default applies."""

    def default(flag: str) -> object:
        return ENGINE_DEFAULTS[flag] if defaults else None

    def explain(flag: str, text: str) -> str:
        return text if defaults else f"{text} (default: serve's, {ENGINE_DEFAULTS[flag]})"

    group.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=default("--max-num-seqs"),
        help=explain("--max-num-seqs", "requests one step may run"),
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=default("--max-num-batched-tokens"),
        help=explain("--max-num-batched-tokens", "tokens one step may compute"),
    )
    group.add_argument(
        "--block-size",
        type=positive_int,
        default=default("--block-size"),
        help=explain("--block-size", "tokens per KV block"),
    )
    size = group.add_mutually_exclusive_group()
    size.add_argument(
        "--kv-cache-memory",
        type=positive_int,
        metavar="BYTES",
        help="bytes for K and V of all layers (default: 1/4 of the available memory, at most 4 GiB)",
    )
    size.add_argument(
        "--num-kv-blocks",
        type=positive_int,
        metavar="N",
        help="KV blocks in the pool (default: see --kv-cache-memory)",
    )
    group.add_argument(
        "--max-model-len", type=positive_int, help="most tokens per request (default: the checkpoint's)"
    )
    group.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=default("--dtype"),
        help=explain("--dtype", "weights, activations, KV cache"),
    )
    group.add_argument(
        "--no-prefix-caching",
        action="store_true",
        default=default("--no-prefix-caching"),
        help="turn prefix caching off (default: on)",
    )


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0..65535."""
    value = nonnegative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value


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
    """Load the engine and serve until Ctrl-C / SIGTERM; returns 0 after the drain.

    Raises UsageError (bad folder, unset --api-key-env variable, the engine checks of
    `engine_args.plan_engine` that generate makes too, a port in use) before loading anything,
    CommandFailed when the checkpoint cannot be loaded.
    """
    from attention_kv_caceh.engine.async_llm import AsyncLLM, load_engine
    from attention_kv_caceh.engine.chat_utils import load_chat_template
    from attention_kv_caceh.engine.server import build_app

    model_dir = Path(args.model)
    api_key = _api_key(args.api_key_env)
    plan = plan_engine(args.model, engine_config_kwargs(args))  # generate's checks: exit 2, no weights read
    name = args.served_model_name or model_dir.resolve().name
    sock = _listen(args.host, args.port)
    try:
        try:
            config = dataclasses.asdict(plan.engine_config)
            engine, tokenizer, max_model_len = load_engine(str(model_dir), config)
            chat_template = load_chat_template(model_dir)
        except (ValueError, OSError) as exc:
            raise CommandFailed(f"cannot load {args.model}: {exc}") from None
        llm = AsyncLLM(engine, tokenizer)
        app = build_app(
            llm,
            tokenizer,
            name,
            max_model_len,
            api_key=api_key,
            max_queue=args.max_queue,
            chat_template=chat_template,
            drain_timeout_s=args.drain_timeout,
            max_logprobs=args.max_logprobs,
            kv_capacity_tokens=engine.scheduler.kv_cache_manager.num_blocks * engine.config.block_size,
        )
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=max(args.drain_timeout, 0.1)
        )
        port = sock.getsockname()[1]
        if not is_loopback(args.host) and api_key is None:
            print(
                f"{PROG} serve: warning: listening on {args.host}, not a loopback address, without "
                "--api-key-env: anyone who can reach this machine can use the server",
                file=sys.stderr,
                flush=True,
            )
        server = _DrainingServer(config)
        with server.draining_on_signals():  # before the announcement: a SIGTERM right after it drains
            print(f"serving {name} at {url_of(args.host, port)}", flush=True)
            asyncio.run(server.serve(sockets=[sock]))
    finally:
        sock.close()
    return 0


class _DrainingServer(uvicorn.Server):
    """uvicorn's Server whose Ctrl-C / SIGTERM handlers drain and return: uvicorn's own re-raise the
    signal after the shutdown, which would end the process by the signal instead of with exit code 0."""

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
            # process group already got, and uvicorn's force exit would skip the lifespan shutdown and
            # leave it to be cancelled with a traceback. The drain is bounded by --drain-timeout anyway.
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
