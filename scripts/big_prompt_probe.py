"""Does a big prompt stall the other streams of `serve`, and does the server's memory come back after it?

What and why: the API process of `serve` runs one asyncio event loop for every stream. Whatever runs on
that loop (reading and parsing a request body, validating it, sending the prompt to the engine core) delays
every other stream's next token by as long as it runs; and whatever a big request leaves allocated stays in
the server's resident memory. This probe measures both, from outside, on a running server:

1. a neighbour request streams greedily (`/v1/completions`, `ignore_eos`) and its tokens are timed;
2. once it runs, a big prompt (`--size-bytes` of text) goes to `/v1/completions`, then (with a new
   neighbour) to `/v1/chat/completions`;
3. for each: the neighbour's largest inter-token gap while the big request was in flight and for
   `--tail-s` after its answer (what the server frees or collects afterwards counts too), against its own
   median gap before it and against the engine's decode-step P50 and the longest engine step in that
   window (`GET /debug/step_stats`), and against the largest gap of a control window as long, just
   before the big request (what the machine's own jitter gives), and the resident memory (VmRSS) of the API process and of the engine
   core process before, at peak (sampled every 5 ms) and after `--settle-s` seconds.

With `--model`, the probe serves a temporary copy of the checkpoint whose context
(`max_position_embeddings`) is `--context` (long enough for the neighbour to outlast the big request, short
enough that the big prompt is refused with 400 after tokenizing). `--accept` makes the context long
enough for the prompt instead, so the request is admitted: it is sent streamed with `max_tokens: 1` and the
probe disconnects once the response has started (the engine aborts it at its next step).

Starts `serve` on 127.0.0.1 (a free port) for `--model`, or measures a running one (`--url`, `--pid` of its
API process). Prints one line per big request and one JSON object per request on the last lines. A
development tool: not part of the package and not run in CI. Timings on a shared machine are contaminated by
whatever else runs: the 1-minute load average is printed beside them; compare ratios within one run.

    uv run attention-kv-caceh make-model --out models/tiny
    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 uv run python scripts/big_prompt_probe.py --model models/tiny
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from attention_kv_caceh.harness.engine_server import serve_process
from attention_kv_caceh.harness.sse import SSEParser

_RSS_INTERVAL_S = 0.005


def rss_mb(pid: int) -> float:
    """Resident memory (VmRSS) of process `pid` in MB (10^6 bytes); 0.0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    return 0.0


def core_pid(pid: int) -> int | None:
    """The child of `pid` named EngineCore (Linux /proc), or None."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                if Path(f"/proc/{child}/comm").read_text().strip() == "EngineCore":
                    return int(child)
    return None


class Neighbour:
    """A streamed greedy completion; `times` are the perf_counter seconds at which each token arrived."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, max_tokens: int) -> None:
        self.times: list[float] = []
        body = {
            "model": model,
            "prompt": "hello",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            # a chunk for every token, also one whose text ends inside a UTF-8 character (a random
            # checkpoint writes many): without it such tokens send nothing and look like a stall
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        self.task = asyncio.ensure_future(self._run(session, f"{url}/v1/completions", body))

    async def _run(self, session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
        async with session.post(url, json=body) as resp:
            resp.raise_for_status()
            parser = SSEParser()
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                self.times += [now for e in parser.feed(chunk) if e.data != "[DONE]"]

    async def wait_tokens(self, n: int, timeout_s: float) -> None:
        deadline = time.perf_counter() + timeout_s
        while len(self.times) < n:
            if self.task.done():
                self.task.result()
                raise RuntimeError("the neighbour ended before streaming")
            if time.perf_counter() > deadline:
                raise TimeoutError(f"the neighbour streamed {len(self.times)} tokens in {timeout_s} s")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            await self.task


async def sample_rss(pids: list[int], peaks: list[float], stop: asyncio.Event) -> None:
    """Keep in `peaks[i]` the largest VmRSS of `pids[i]` seen until `stop` is set."""
    while not stop.is_set():
        for i, pid in enumerate(pids):
            peaks[i] = max(peaks[i], rss_mb(pid))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _RSS_INTERVAL_S)


async def big_request(
    session: aiohttp.ClientSession, url: str, path: str, body: bytes, accepted: bool
) -> tuple[int, int]:
    """POST the pre-encoded `body`; returns (status, length of the answer in bytes). With `accepted`,
    disconnect as soon as a 200 stream has started: the request was admitted, and leaving aborts it."""
    headers = {"Content-Type": "application/json"}
    async with session.post(url + path, data=body, headers=headers) as resp:
        if accepted and resp.status == 200:
            resp.close()
            return resp.status, 0
        return resp.status, len(await resp.read())


async def probe_one(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    url: str,
    model: str,
    pids: list[int],
    path: str,
    prompt: str,
    neighbour_tokens: int,
) -> dict[str, Any]:
    big: dict[str, Any] = {"model": model, "max_tokens": 1, "temperature": 0}
    if path == "/v1/completions":
        big["prompt"] = prompt
    else:
        big["messages"] = [{"role": "user", "content": prompt}]
    if args.accept:
        big["stream"] = True
    body = json.dumps(big).encode()  # encoded here, before the timed window
    neighbour = Neighbour(session, url, model, neighbour_tokens)
    try:
        await neighbour.wait_tokens(1, timeout_s=args.timeout_s)
        await asyncio.sleep(args.baseline_s)  # the control window: the same stream without a big request
        before = [rss_mb(p) for p in pids]
        peaks = list(before)
        stop = asyncio.Event()
        sampler = asyncio.ensure_future(sample_rss(pids, peaks, stop))
        t_send = time.perf_counter()
        status, answer_bytes = await asyncio.wait_for(
            big_request(session, url, path, body, args.accept), args.timeout_s
        )
        t_done = time.perf_counter()
        # what the server does after answering (freeing, collecting) can still hold up the neighbour
        await asyncio.sleep(args.tail_s)
        stop.set()
        await sampler
    finally:
        await neighbour.stop()
    await asyncio.sleep(args.settle_s)
    after = [rss_mb(p) for p in pids]
    times = neighbour.times
    gaps = list(itertools.pairwise(times))
    base = [b - a for a, b in gaps if b <= t_send]
    t_end = t_done + args.tail_s
    during = [b - a for a, b in gaps if b > t_send and a < t_end]
    # control: the largest gap in a window as long, just before the big request
    control = [b - a for a, b in gaps if t_send - (t_end - t_send) < b <= t_send]
    async with session.get(f"{url}/debug/step_stats", params={"last": "100000"}) as resp:
        steps: list[dict[str, Any]] = (await resp.json())["data"]
    decode = [s["step_time_ms"] for s in steps if s["num_prefill_tokens"] == 0]
    return {
        "path": path,
        "prompt_bytes": len(prompt.encode()),
        "body_bytes": len(body),
        "status": status,
        "answer_bytes": answer_bytes,
        "request_s": round(t_done - t_send, 3),
        "neighbour_tokens_during": sum(1 for t in times if t_send < t <= t_end),
        "neighbour_median_gap_ms": round(1e3 * statistics.median(base), 2),
        "neighbour_max_gap_ms": round(1e3 * max(during, default=0.0), 2),
        "control_max_gap_ms": round(1e3 * max(control, default=0.0), 2),
        "control_window_s": round(min(t_end - t_send, t_send - times[0]), 3),
        "decode_step_p50_ms": round(statistics.median(decode), 2),
        "longest_step_ms": round(max(s["step_time_ms"] for s in steps[-len(during) - 20 :]), 2),
        "api_rss_mb": [round(before[0], 1), round(peaks[0], 1), round(after[0], 1)],
        "core_rss_mb": [round(before[1], 1), round(peaks[1], 1), round(after[1], 1)]
        if len(pids) > 1
        else None,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


@contextlib.contextmanager
def long_context_copy(model_dir: str, max_len: int) -> Iterator[str]:
    """A temporary folder of links to `model_dir`'s files but a config.json that allows `max_len` positions."""
    with tempfile.TemporaryDirectory(prefix="long-context-") as tmp:
        source = Path(model_dir).resolve()
        dest = Path(tmp) / source.name
        dest.mkdir()
        for file in source.iterdir():  # the weights are linked, not copied
            (dest / file.name).symlink_to(file)
        (dest / "config.json").unlink()
        config = json.loads((source / "config.json").read_text())
        config["max_position_embeddings"] = max_len
        (dest / "config.json").write_text(json.dumps(config))
        yield str(dest)


async def run_probe(args: argparse.Namespace, url: str, pid: int) -> list[dict[str, Any]]:
    core = core_pid(pid)
    pids = [pid] if core is None else [pid, core]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(f"{url}/v1/models") as resp:
            card = (await resp.json())["data"][0]
        model, max_model_len = card["id"], int(card["max_model_len"])
        repeats = max(1, args.size_bytes // len(args.unit))
        prompt = args.unit * repeats
        neighbour_tokens = min(max_model_len - 8, 16384)
        # warm-up: one refused request below the server's memory-release size, so that the first use of
        # the refusal path is not counted against the big prompt
        warm = {"model": model, "prompt": "a " * min(max_model_len, 50_000), "max_tokens": 1}
        warm_body = json.dumps({**warm, "stream": args.accept}).encode()
        await big_request(session, url, "/v1/completions", warm_body, args.accept)
        rows: list[dict[str, Any]] = []
        for _ in range(args.repeats):
            for path in args.paths:
                row = await probe_one(session, args, url, model, pids, path, prompt, neighbour_tokens)
                rows.append(row)
                gap, step = row["neighbour_max_gap_ms"], row["decode_step_p50_ms"]
                print(
                    f"{path:22} {row['status']} in {row['request_s']:6.3f} s | neighbour max gap "
                    f"{gap:7.2f} ms = {gap / max(row['neighbour_median_gap_ms'], 1e-3):5.1f} x its median "
                    f"gap, {gap / max(step, 1e-3):5.1f} x decode step P50 ({step} ms), longest step "
                    f"{row['longest_step_ms']} ms; control window's max gap {row['control_max_gap_ms']} "
                    f"ms | API RSS MB before/peak/after {row['api_rss_mb']} "
                    f"core {row['core_rss_mb']} | load {row['load_average_1m']}",
                    flush=True,
                )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="checkpoint folder: start `serve` for it on a free loopback port")
    where.add_argument("--url", help="base URL of a running server (no /v1); give --pid too")
    parser.add_argument("--pid", type=int, help="with --url: the server's API process")
    parser.add_argument("--size-bytes", type=int, default=1_000_000, help="bytes of prompt text")
    parser.add_argument("--unit", default="hello world ", help="text repeated to make the prompt")
    parser.add_argument(
        "--paths", nargs="+", default=["/v1/completions", "/v1/chat/completions"], help="endpoints to probe"
    )
    parser.add_argument(
        "--accept", action="store_true", help="make the prompt fit the context (with --model)"
    )
    parser.add_argument(
        "--context", type=int, default=16384, help="with --model: max_position_embeddings of the copy served"
    )
    parser.add_argument("--serve-arg", action="append", default=[], help="extra flag for serve (repeatable)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over --paths")
    parser.add_argument(
        "--baseline-s", type=float, default=3.0, help="neighbour streams this long before the big request"
    )
    parser.add_argument(
        "--tail-s", type=float, default=1.0, help="the window goes on this long after the big answer"
    )
    parser.add_argument("--settle-s", type=float, default=2.0, help="wait before reading RSS 'after'")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="bound on each wait")
    args = parser.parse_args()
    if args.url is not None:
        if args.pid is None:
            parser.error("--url needs --pid (the server's API process)")
        rows = asyncio.run(run_probe(args, args.url.rstrip("/"), args.pid))
    else:
        flags = list(args.serve_arg)
        with contextlib.ExitStack() as stack:
            # room for a neighbour that outlasts the big request; with --accept, for the prompt too (a
            # byte-level tokenizer gives at most about one token per byte)
            max_len = args.size_bytes + 4096 if args.accept else args.context
            model = stack.enter_context(long_context_copy(args.model, max_len))
            flags += ["--num-kv-blocks", str(max_len // 16 + 16)]
            server = stack.enter_context(serve_process(model, flags))
            rows = asyncio.run(run_probe(args, server.base_url, server.pid))
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
