"""How far one harness process goes before its own lateness passes a bound: bursts and request rates.

What and why: the harness's client is one asyncio event loop. Every request it starts, every SSE chunk it
parses and every record it fills runs on that loop, so past some load the loop starts requests later
than their scheduled arrival (client lateness, `lateness_ms` of each record). This script measures where
that happens against the scripted server (`harness/scripted_server.py`, in a child process: first token
after `--ttft-ms`, then one token every `--itl-ms`), in two ways:

- bursts (`--request-rate inf`): N requests arriving at once at concurrency N, for each N of `--bursts`;
- rates: Poisson arrivals at each rate of `--rates` (requests/s), `--seconds` worth of requests each, at a
  concurrency no run reaches (the semaphore never holds a request back).

Each point is run `--repeats` times, alternating over the points, and printed with the client lateness
P50 / P99 and the 1-minute load average beside it (client and server share this machine's cores with
whatever else runs). A development tool: not part of the package and not run in CI.

    OPENBLAS_NUM_THREADS=1 uv run python scripts/client_scale.py --bursts 16 32 64 128 --rates 25 50 100 200
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os

from attention_kv_caceh.harness.load import LengthRange
from attention_kv_caceh.harness.run import HarnessConfig, run_harness
from attention_kv_caceh.harness.scripted_server import scripted_server_process


def _point(url: str, requests: int, rate: float, tokens: int, seed: int) -> dict[str, float]:
    config = HarnessConfig(
        backend="openai-completions",
        base_url=url,
        model="scripted",
        num_requests=requests,
        concurrency=requests,
        request_rate=rate,
        output_len=LengthRange(tokens, tokens),
        server_metrics_interval_s=0,
        seed=seed,
        timeout_s=120,
    )
    summary = asyncio.run(run_harness(config)).summary
    if summary["failed"]:
        raise SystemExit(f"{requests} requests at rate {rate}: failures {summary['failures']}")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--bursts", type=int, nargs="*", default=[16, 32, 64, 128], metavar="N")
    parser.add_argument("--rates", type=float, nargs="*", default=[25, 50, 100, 200], metavar="R")
    parser.add_argument("--seconds", type=float, default=3.0, help="requests per rate point: R x this")
    parser.add_argument("--tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--itl-ms", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    points = [("burst", n, n, math.inf) for n in args.bursts]
    points += [("rate", r, max(16, round(r * args.seconds)), r) for r in args.rates]
    print(
        f"{'kind':>5} {'value':>6} {'requests':>8} {'late p50 ms':>11} {'late p99 ms':>11} "
        f"{'req/s':>7} {'out tok/s':>9} {'load1':>5}"
    )
    with scripted_server_process(args.ttft_ms, args.itl_ms) as url:
        for repeat in range(args.repeats):
            for kind, value, requests, rate in points:
                s = _point(url, requests, rate, args.tokens, seed=repeat)
                print(
                    f"{kind:>5} {value:>6g} {requests:>8d} {s['median_lateness_ms']:>11.2f} "
                    f"{s['p99_lateness_ms']:>11.2f} {s['request_throughput']:>7.1f} "
                    f"{s['output_throughput']:>9.0f} {os.getloadavg()[0]:>5.1f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
