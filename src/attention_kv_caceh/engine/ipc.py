"""The private channels between the front end and its engine core: socket files no other process can use.

vLLM v1 puts the core's ZMQ sockets in socket files (`ipc://<tmp>/<uuid>`) rather than on TCP. This module
goes two steps further, so that neither another user nor another process of the same user can read
requests off the core's input or inject outputs:

- the two socket files live in a folder made by `tempfile.mkdtemp` (mode 0700: only the owner may even
  look up a name in it), and they are removed as soon as the core has connected both, so nothing on disk
  names the channels afterwards (an abstract-namespace socket, `ipc://@name`, carries no permissions at
  all and is listed in /proc/net/unix);
- each bound socket asks a ZAP handler (ZMQ's authentication protocol, RFC 27) about every peer before it
  is admitted, and the handler admits only the core's process: over a Unix socket, libzmq reads the
  peer's pid from the kernel (SO_PEERCRED) and passes it as the address `...:uid:gid:pid`. Root, who may
  enter any folder, is refused there too; a refused peer never receives a message and its messages are
  never read.

Left out: CURVE encryption (nothing crosses the machine). Off Linux the kernel gives no peer pid, so the
folder's permissions are the only guard, and `PrivateChannels` logs a warning saying so.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import zmq

__all__ = ["PrivateChannels"]

logger = logging.getLogger(__name__)

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq sends ZAP requests (RFC 27), one per context
_DOMAINS = (b"input", b"output")


def _peer_pid(address: bytes) -> int | None:
    """The pid at the end of a Unix-socket peer's ZAP address (`localhost:uid:gid:pid`), or None."""
    parts = address.decode("ascii", "replace").split(":")
    if len(parts) < 4 or not parts[-1].isdigit():
        return None
    return int(parts[-1])


class PrivateChannels:
    """Two socket files in a private folder, and a ZAP handler that admits only one process's peers.

    Bind the front end's sockets with `bind(socket, name)` (name "input" or "output"), then say which
    process may connect with `admit(pid)`; `wait_connected(timeout_s)` returns once that process has
    connected both, and removes the socket files and their folder. `close()` stops the handler (before the
    context is terminated) and removes the folder if it is still there.

    Attributes:
        folder: the private folder (mode 0700) holding the socket files until both are connected.
        refused: how many peers the handler refused (a test reads it).
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="attention-kv-caceh-core-"))
        self.refused = 0
        self._pid: int | None = None
        self._admitted: set[bytes] = set()
        self._logged: set[tuple[bytes, bytes]] = set()
        self._lock = threading.Lock()
        self._both = threading.Event()
        self._checks_pid = sys.platform.startswith("linux")
        if not self._checks_pid:
            logger.warning(
                "the engine core's sockets are guarded by their folder's permissions only (%s): this "
                "system gives no peer pid to check",
                self.folder,
            )
        self._zap = ctx.socket(zmq.REP)
        self._zap.bind(_ZAP_ENDPOINT)
        self._thread = threading.Thread(target=self._serve_zap, name="core-zap", daemon=True)
        self._thread.start()

    def address(self, name: str) -> str:
        """The `ipc://` address of socket `name` in the private folder."""
        return f"ipc://{self.folder / name}"

    def bind(self, socket: zmq.Socket[bytes], name: str) -> str:
        """Bind `socket` as channel `name` ("input" or "output"), every peer checked by the handler."""
        if name.encode() not in _DOMAINS:
            raise ValueError(f"channel name must be one of {_DOMAINS}, got {name!r}")
        socket.setsockopt(zmq.ZAP_DOMAIN, name.encode())
        address = self.address(name)
        socket.bind(address)
        return address

    def admit(self, pid: int) -> None:
        """From now on admit peers of process `pid` (the engine core) and no other."""
        with self._lock:
            self._pid = pid

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait until the admitted process has connected both channels, then remove the socket files and
        their folder (the connections stay); False after `timeout_s`."""
        if not self._both.wait(timeout_s):
            return False
        self.remove_files()
        return True

    def remove_files(self) -> None:
        """Remove the socket files and their folder (idempotent)."""
        shutil.rmtree(self.folder, ignore_errors=True)

    def close(self) -> None:
        """Remove the folder; the handler thread ends when the context is terminated."""
        self.remove_files()

    # -- the ZAP handler (its own thread) --------------------------------------------------------------

    def _allowed(self, domain: bytes, address: bytes) -> bool:
        with self._lock:
            if domain not in _DOMAINS or self._pid is None:
                return False
            if self._checks_pid and _peer_pid(address) != self._pid:
                return False
            self._admitted.add(domain)
            if len(self._admitted) == len(_DOMAINS):
                self._both.set()
            return True

    def _serve_zap(self) -> None:
        try:
            while True:
                frames = self._zap.recv_multipart()
                version, request_id, domain, address = frames[0], frames[1], frames[2], frames[3]
                ok = self._allowed(domain, address)
                if not ok:
                    self.refused += 1
                    if (domain, address) not in self._logged:  # ZMQ retries every 100 ms: say it once
                        self._logged.add((domain, address))
                        logger.warning(
                            "refused a connection to the engine core's %s socket from %s (and its "
                            "retries, without a word)",
                            domain.decode("ascii", "replace"),
                            address.decode("ascii", "replace"),
                        )
                status, text = (b"200", b"OK") if ok else (b"400", b"not the engine core")
                self._zap.send_multipart([version, request_id, status, text, b"", b""])
        except zmq.ContextTerminated:
            pass
        finally:
            with contextlib.suppress(zmq.ZMQError):
                self._zap.close(linger=0)
