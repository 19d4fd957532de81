"""Start the project's own server (`serve`) in a child process for the harness's `--backend engine`.

`serve_process(model_dir, engine_flags)` runs `python -m attention_kv_caceh.cli.serve --model DIR --host
127.0.0.1 --port 0 [engine flags]` (its own process: its own cores and GIL, so the engine's steps do not
share an interpreter with the load generator), reads the `serving NAME at URL` line it prints once the
checkpoint is loaded and the socket listens, waits for `GET /health` to answer 200, and yields a
ServerProcess (its base URL `http://127.0.0.1:PORT`, no `/v1`; its pid; its argv). On exit it sends SIGTERM (the server drains and exits 0), then
SIGKILL if the child is still alive after `stop_timeout_s`. If the harness itself is killed (SIGKILL, a
crash), the child gets SIGTERM from the kernel (`die_with_parent`, Linux), so no server is orphaned. The child's stderr goes to the parent's unless
redirected. `engine_step_summary(base_url)` reads the server's `GET /debug/step_stats` (the engine's own
StepStats) before the stop: the exact peaks of num_running / num_waiting and the engine's step times.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from attention_kv_caceh.harness.summary import stats_with_vllm_names

__all__ = [
    "ServerProcess",
    "ServerStartError",
    "die_with_parent",
    "engine_step_summary",
    "serve_command",
    "serve_process",
]

MAX_STEP_STATS = 100_000  # the most the server returns; a run with more steps is summarised over its last


@dataclass(frozen=True)
class ServerProcess:
    """A running `serve` child: `base_url` (`http://127.0.0.1:PORT`, no `/v1`), `pid`, `command` (argv)."""

    base_url: str
    pid: int
    command: tuple[str, ...]


class ServerStartError(RuntimeError):
    """The server child exited or did not become healthy in time.

    Attributes:
        returncode: the child's exit code when it exited (2: serve refused its arguments and said why
            in one line on stderr), else None.
    """

    def __init__(self, message: str, returncode: int | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode


def serve_command(model_dir: str | Path, engine_flags: Sequence[str] = ()) -> list[str]:
    """The argv that starts `serve` on a free loopback port with `engine_flags` (e.g. `--max-num-seqs 4`)."""
    return [
        sys.executable,
        "-m",
        "attention_kv_caceh.cli.serve",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *engine_flags,
    ]


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that makes a child process get SIGTERM when this process dies, even by SIGKILL
    (Linux `prctl(PR_SET_PDEATHSIG)`; the child's SIGTERM handler then stops it as usual). None where
    prctl is not available (not Linux): there a killed parent's child must be stopped by hand.

    The signal follows the *thread* that started the child: call Popen from the main thread. If this
    process died between the fork and the prctl, the child stops itself at once."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the forked child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent is already gone: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    """Forward the child's stdout lines (so its pipe never fills), then None at its end."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def _announced_url(proc: subprocess.Popen[str], lines: queue.Queue[str | None], deadline: float) -> str:
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            raise ServerStartError("the server did not announce its address in time") from None
        if line is None:
            code = proc.wait()
            raise ServerStartError(f"the server exited with code {code} before serving", code)
        if line.startswith("serving ") and " at " in line:
            return line.rsplit(" at ", 1)[1].strip()


def _wait_healthy(base_url: str, proc: subprocess.Popen[str], deadline: float) -> None:
    """GET /health until it answers 200 (the app's startup runs after the socket listens)."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ServerStartError(f"{base_url}/health did not answer 200 in time")
        if proc.poll() is not None:
            code = proc.returncode
            raise ServerStartError(f"the server exited with code {code} before /health answered", code)
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=remaining) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(min(0.05, max(remaining, 0.0)))  # a 503 while the engine starts: ask again shortly


@contextlib.contextmanager
def serve_process(
    model_dir: str | Path,
    engine_flags: Sequence[str] = (),
    *,
    startup_timeout_s: float = 300.0,
    stop_timeout_s: float = 30.0,
    stderr: int | IO[str] | None = None,
) -> Generator[ServerProcess]:
    """Run `serve` for `model_dir` in a child process; yields it once /health answers 200.

    Raises ServerStartError when the child exits before serving or is not healthy within
    `startup_timeout_s` (loading a checkpoint can take a while). The child gets SIGTERM on exit, then
    SIGKILL after `stop_timeout_s`. `stderr`: where the child's stderr goes (None: the parent's).
    """
    command = serve_command(model_dir, engine_flags)
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=stderr, text=True, preexec_fn=die_with_parent()
    )
    assert proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + startup_timeout_s
        base_url = _announced_url(proc, lines, deadline)
        _wait_healthy(base_url, proc, deadline)
        yield ServerProcess(base_url, proc.pid, tuple(command))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=5)
        proc.stdout.close()


def engine_step_summary(base_url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Summarise the engine's StepStats read from `GET {base_url}/debug/step_stats` (every step since the
    server started, smoke test and warm-up included; the last MAX_STEP_STATS of a longer life).

    Returns `num_steps`, `max_num_running`, `max_num_waiting`, `num_preemptions`, and vLLM-style stats
    (`median_..._ms`, `p99_..._ms`, ...) of `step_time_ms` over every step and over decode-only steps
    (no prefill token: the step time an inter-token latency is made of), and of the decode-only steps'
    `step_cpu_ms` (`decode_step_cpu_time`: the core thread's own CPU time, which waiting for a CPU or
    the GIL does not change; absent from a server whose StepStats lack it). Raises OSError / ValueError
    when the endpoint cannot be read or parsed.
    """
    url = f"{base_url}/debug/step_stats?last={MAX_STEP_STATS}"
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        steps: list[dict[str, Any]] = json.loads(resp.read())["data"]
    decode_steps = [s for s in steps if int(s["num_prefill_tokens"]) == 0]
    decode = [float(s["step_time_ms"]) for s in decode_steps]
    decode_cpu = [float(s["step_cpu_ms"]) for s in decode_steps if "step_cpu_ms" in s]
    return {
        "num_steps": len(steps),
        "max_num_running": max((int(s["num_running"]) for s in steps), default=0),
        "max_num_waiting": max((int(s["num_waiting"]) for s in steps), default=0),
        "num_preemptions": sum(int(s["num_preemptions"]) for s in steps),
        **stats_with_vllm_names("step_time", [float(s["step_time_ms"]) for s in steps]),
        **stats_with_vllm_names("decode_step_time", decode),
        **(stats_with_vllm_names("decode_step_cpu_time", decode_cpu) if decode_cpu else {}),
    }
