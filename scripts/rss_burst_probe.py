"""Does the API process of `serve` give its memory back after a burst of big prompts?

What and why: a big prompt costs the API process far more than its body (the tokenizer's Encoding of a
1 MB text is about 150 MB), in the worker threads that tokenize. This probe starts a fresh `serve` on
127.0.0.1 (a free port) for `--model`, reads the API process's resident size (VmRSS) before any request,
sends `--burst` concurrent requests of `--size-bytes` each (a third text prompts and a third chat
messages, both past the context, so refused with 400 after tokenizing; a third streamed token-id
prompts of 1,500 ids that are served), samples the peak every 5 ms, and reads VmRSS every 0.5 s for
`--settle-s` seconds after the last answer; then a second burst on the same server. With `--variant
dynamic` the server runs with glibc's dynamic mmap threshold (engine/malloc.py's `fix_mmap_threshold`
replaced by a no-op), for an A/B against the default `fixed`. Prints one line per burst.

A development tool: not part of the package and not run in CI. Resident sizes do not depend on timing,
but the load average is printed beside them.

    uv run attention-kv-caceh make-model --out models/tiny
    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 uv run python scripts/rss_burst_probe.py --model models/tiny
    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 uv run python scripts/rss_burst_probe.py --model models/tiny \
        --variant dynamic
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

_SERVE = "{patch}from attention_kv_caceh.cli.serve import main; main({argv!r})"
_DYNAMIC = "import attention_kv_caceh.engine.malloc as m; m.fix_mmap_threshold = lambda *a: False; "


def rss_mb(pid: int) -> float:
    """VmRSS of process `pid` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_serve(model: str, variant: str, port: int) -> subprocess.Popen[bytes]:
    argv = ["--model", model, "--served-model-name", "probe", "--port", str(port)]
    code = _SERVE.format(patch=_DYNAMIC if variant == "dynamic" else "", argv=argv)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited with {proc.returncode}") from None
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("serve did not become healthy within 300 s")


async def burst(url: str, pid: int, count: int, size: int, settle_s: float) -> dict[str, Any]:
    start = rss_mb(pid)
    peak = start
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_mb(pid))
            await asyncio.sleep(0.005)

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        text = f"word{i} " * (size // 6)
        if i % 3 == 0:
            path, body = "/v1/completions", {"prompt": text, "max_tokens": 1}
        elif i % 3 == 1:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
        else:
            path, body = "/v1/completions", {"prompt": [5 + i] * 1500, "max_tokens": 1, "stream": True}
        async with session.post(url + path, json={"model": "probe", **body}) as resp:
            await resp.read()
            return resp.status

    sampler = asyncio.ensure_future(sample())
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        statuses = await asyncio.gather(*(one(session, i) for i in range(count)))
    done.set()
    await sampler
    after: list[float] = []
    for _ in range(int(settle_s / 0.5)):
        await asyncio.sleep(0.5)
        after.append(rss_mb(pid))
    return {"statuses": sorted(set(statuses)), "start": start, "peak": peak, "after": after}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint folder")
    parser.add_argument("--variant", choices=("fixed", "dynamic"), default="fixed")
    parser.add_argument("--burst", type=int, default=12, help="concurrent requests per burst")
    parser.add_argument("--size-bytes", type=int, default=1_000_000, help="text of each big prompt")
    parser.add_argument("--settle-s", type=float, default=10.0, help="seconds of VmRSS after a burst")
    args = parser.parse_args()
    port = free_port()
    proc = start_serve(args.model, args.variant, port)
    try:
        url = f"http://127.0.0.1:{port}"
        for n in (1, 2):
            r = asyncio.run(burst(url, proc.pid, args.burst, args.size_bytes, args.settle_s))
            last = r["after"][-1]
            print(
                f"{args.variant} burst {n}: {args.burst} x {args.size_bytes} B, statuses {r['statuses']}: "
                f"start {r['start']:.1f} MiB, peak {r['peak']:.1f}, after 0.5 s {r['after'][0]:.1f}, "
                f"after {args.settle_s:g} s {last:.1f} ({100 * (last / r['start'] - 1):+.1f} %)   "
                f"load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
