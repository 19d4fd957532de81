"""Time what a start pays for a GGUF file: the metadata read alone, and a whole `generate` of one token.

Each repetition runs in a fresh process, cold (the file dropped from the page cache first, with
`posix_fadvise(POSIX_FADV_DONTNEED)`, which needs no privileges for pages nobody has dirtied) and then
warm (the file cached). The metadata read is `GGUFCheckpoint(file)`, its `config()` and the vocabulary
and merges (what the config, tokenizer and chat template read), timed inside the process after the
imports; `generate` is the command's wall time and its CPU time (user + system):

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 uv run python scripts/gguf_start_probe.py --model smollm2 --repeats 3

Prints one line per measurement and the medians. `--src DIR` runs another checkout's `src` (the
package imported from there first) for a before/after pair on one machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

_METADATA = """
import sys, time
try:
    from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint
    from attention_kv_caceh.model_executor.gguf_config import model_config_from_gguf
except ImportError:  # a checkout from before model_executor/ (--src)
    from attention_kv_caceh.engine.gguf_checkpoint import GGUFCheckpoint
    model_config_from_gguf = GGUFCheckpoint.config
start = time.perf_counter()
ckpt = GGUFCheckpoint(sys.argv[1])
model_config_from_gguf(ckpt)
ckpt.metadata("tokenizer.ggml.tokens")
ckpt.metadata("tokenizer.ggml.merges")
print(time.perf_counter() - start)
"""


GENERATE = [sys.executable, "-m", "attention_kv_caceh.benchmark", "generate"]


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a GGUF file or model name (default: smollm2)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of each (default: 3)")
    parser.add_argument("--src", type=Path, help="import the package from this src folder instead")
    args = parser.parse_args()
    from attention_kv_caceh.model_executor.model_source import resolve_model

    path = resolve_model(args.model).path
    env = dict(os.environ)
    if args.src is not None:
        env["PYTHONPATH"] = str(args.src.resolve())
    results: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for state in ("cold", "warm"):
            if state == "cold":
                evict(path)
            out = subprocess.run(
                [sys.executable, "-c", _METADATA, str(path)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            seconds = float(out.stdout.strip())
            results.setdefault(f"metadata {state} s", []).append(seconds)
            print(f"metadata {state}: {seconds:.3f} s", flush=True)
        for state in ("cold", "warm"):
            if state == "cold":
                evict(path)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            subprocess.run(
                [*GENERATE, "--model", str(path), "--prompt", "Hello", "--max-tokens", "1"],
                env=env,
                capture_output=True,
                check=True,
            )
            wall = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
            results.setdefault(f"generate {state} wall s", []).append(wall)
            results.setdefault(f"generate {state} cpu s", []).append(cpu)
            print(f"generate {state}: {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)
    print("medians: " + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in results.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
