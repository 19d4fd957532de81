"""What do concurrent large request bodies cost the API process of `serve`?

Starts `serve --model DIR` on 127.0.0.1 (a free port), samples the resident memory (VmRSS) of its API
process every 10 ms, sends `--concurrent` requests at once to `--path` (`/v1/completions` or `/tokenize`),
each with a text prompt of about `--bytes` bytes (`--text`: "hello world " repeated, one word
without a space, Japanese text without a space, or a list of token ids), and prints the peak above the
start, per request, the memory at the end and 5 s later, and how many answers had each HTTP status (a
prompt past the context gets 400; a body past `--max-request-bytes-in-flight`, 503 with Retry-After).
Extra flags after `--` go to `serve`. A development tool: not part of the package and not run in CI.

    uv run attention-kv-caceh make-model --out models/tiny-llama
    uv run python scripts/body_memory_probe.py --model models/tiny-llama --concurrent 4 --bytes 8300000
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint folder")
    parser.add_argument("--path", default="/v1/completions", choices=("/v1/completions", "/tokenize"))
    parser.add_argument("--concurrent", type=int, default=4, help="requests sent at once")
    parser.add_argument("--bytes", type=int, default=8_300_000, help="prompt size in bytes")
    parser.add_argument(
        "--text",
        choices=("words", "no-spaces", "cjk", "ids", "big-ids"),
        default="words",
        help="what the prompt holds: text, or token ids 5 (ids) or 300 (big-ids)",
    )
    parser.add_argument("serve_flags", nargs="*", help="after --: more flags for serve")
    args = parser.parse_args()
    command = [sys.executable, "-m", "attention_kv_caceh.benchmark", "serve", "--model", args.model]
    proc = subprocess.Popen(
        [*command, "--port", "0", *args.serve_flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = None
        for line in proc.stdout:
            match = re.search(r"serving \S+ at http://127\.0\.0\.1:(\d+)", line)
            if match:
                port = int(match.group(1))
                break
        if port is None:
            print("serve did not start", file=sys.stderr)
            return 1
        stdout = proc.stdout
        threading.Thread(target=lambda: collections.deque(stdout, maxlen=0), daemon=True).start()
        prompt: str | list[int]
        if args.text in ("ids", "big-ids"):
            token = 5 if args.text == "ids" else 300
            prompt = [token] * (args.bytes // len(f"{token},"))
        else:
            unit = {"words": "hello world ", "no-spaces": "x", "cjk": "\u65e5\u672c\u8a9e\u306e\u6587"}[
                args.text
            ]
            prompt = unit * (args.bytes // len(unit.encode()))  # about --bytes of UTF-8
        fields = {"prompt": prompt} if args.path == "/tokenize" else {"prompt": prompt, "max_tokens": 4}
        body = json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode()
        start = _rss_mb(proc.pid)
        peak = [start]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _rss_mb(proc.pid))
                time.sleep(0.01)

        statuses: list[int] = []

        def one() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            conn.request("POST", args.path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            statuses.append(resp.status)
            conn.close()

        sampler = threading.Thread(target=sample)
        sampler.start()
        clients = [threading.Thread(target=one) for _ in range(args.concurrent)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        end = _rss_mb(proc.pid)
        time.sleep(5)
        later = _rss_mb(proc.pid)
        done.set()
        sampler.join()
        per = (peak[0] - start) / args.concurrent
        print(
            f"{args.path}: {args.concurrent} x {len(body) / 1e6:.1f} MB bodies: RSS start {start} MB, "
            f"peak {peak[0]} MB (+{peak[0] - start} MB, +{per:.0f} MB per request, "
            f"{per * 1e6 / len(body):.1f} x a body), end {end} MB, 5 s later {later} MB; "
            f"statuses {dict(collections.Counter(statuses))}; load {os.getloadavg()[0]:.2f}"
        )
        return 0
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
