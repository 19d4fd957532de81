"""Start-up and shutdown of a server process for the comparison scripts (`compare_vllm.py`,
`compare_vllm_structured.py`): a free loopback port, a readiness poll, and a stop that ends the server's whole
process group (it is started in a session of its own: an API server, an engine core and its workers).
Imported by the scripts beside it (run as `python scripts/NAME.py`, so this folder is on sys.path).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request

__all__ = ["free_port", "stop", "wait_ready"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float) -> None:
    """Poll GET url until 200; raise RuntimeError if the server exits or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} during startup")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"server not ready after {timeout_s:g} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group (it has its own session: the API server, the engine core and
    its workers), SIGKILL what is left of the group after 30 s."""
    deadline = time.monotonic() + 30
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        while time.monotonic() < deadline:
            proc.poll()  # reap the API server so that the group can empty
            try:
                os.killpg(proc.pid, 0)  # anyone left in the group?
            except ProcessLookupError:
                return
            time.sleep(0.5)
        deadline = time.monotonic() + 10
    proc.poll()
