"""Serving an app on a socket until Ctrl-C / SIGTERM, draining the engine first.

Corresponds to vLLM's `vllm/entrypoints/launcher.py` (`serve_http`): uvicorn runs the FastAPI app on a
socket bound before the engine loads, and a signal starts a graceful shutdown. Here the shutdown first
drains AsyncLLM (running requests get `drain_timeout_s`, the rest end with a finish_reason "abort"
chunk and `[DONE]`), then uvicorn closes the connections, none of them cancelled mid-write.

Left out, against vLLM: TLS, the watchdog task that stops the server when the engine core dies (here a
dead core makes /health answer 503 and the process keeps serving it), SO_REUSEPORT for several API
processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import signal
import socket
import threading
from collections.abc import Callable, Generator
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:
    from attention_kv_caceh.engine.async_llm import AsyncLLM

__all__ = ["DrainingServer", "is_loopback", "listen", "serve_http", "url_of"]


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


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and listening (port 0: one the system chooses).

    Raises OSError when it cannot bind (a port in use, an address not on this machine).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only when the listening
    # socket says TCP explicitly; with Nagle on, each streamed chunk on a reused connection waited for
    # the client's delayed ACK (about 40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock


def serve_http(
    app: Any, llm: AsyncLLM, sock: socket.socket, drain_timeout_s: float, announce: Callable[[int], None]
) -> None:
    """Serve `app` on the listening `sock` until Ctrl-C / SIGTERM, then drain `llm` and return.

    `announce(port)` runs once the signal handlers are in place (a SIGTERM right after it drains).
    What startup built is frozen out of the collector while serving (vLLM's `freeze_gc_heap`: a full
    collection stops every stream on the event loop for as long as it traverses) and unfrozen after.
    """
    gc.collect()
    gc.freeze()
    try:
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        server = DrainingServer(config, llm, drain_timeout_s)
        with server.draining_on_signals():
            announce(sock.getsockname()[1])
            asyncio.run(server.serve(sockets=[sock]))
    finally:
        gc.unfreeze()  # a caller in the same process (a test) is not left with a frozen heap


class DrainingServer(uvicorn.Server):
    """uvicorn's Server that drains the engine before it closes the connections.

    Ctrl-C / SIGTERM: stop accepting, drain AsyncLLM, then uvicorn's own shutdown closes the connections
    that are now complete. Its signal handlers return instead of re-raising the signal after the
    shutdown (which would end the process by the signal, not exit 0).
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
            # bounded by the drain timeout anyway.
            self.should_exit = True

        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, handle) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
