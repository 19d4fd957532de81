"""The table of an alternating comparison: `serve` against another server, pair by pair, from the harness
summaries the bench_serve_vs_*.sh scripts leave in their folder (NAME-cC-pP.json and .rc per run).

    python scripts/pair_table.py OUT PAIRS BASELINE LABEL C [C ...]

BASELINE is the runs' file prefix (e.g. `vllm`, `llamacpp`), LABEL the name in the header (`vLLM`,
`llama.cpp`). Prints one row per pair (output tokens/s of each, serve / BASELINE) and the median ratio per
concurrency over the pairs where both runs finished with every request ok; a failed run is named in its
cell. Exit status 0 (failed runs are the caller's to count).
"""

from __future__ import annotations

import json
import os
import statistics
import sys


def run(out: str, name: str, c: str, p: int) -> tuple[float | None, str | None]:
    """(output tok/s, None) for a run that finished with every request ok, else (None, what failed)."""
    path = f"{out}/{name}-c{c}-p{p}"
    if not os.path.exists(path + ".rc"):
        return None, "not run"
    with open(path + ".rc") as f:
        rc = f.read().strip()
    if not os.path.exists(path + ".json"):
        return None, f"failed: exit {rc}, no summary"
    with open(path + ".json") as f:
        summary = json.load(f)
    if summary["failed"] or rc != "0":
        return None, f"failed: {summary['failed']} of {summary['num_requests']} requests"
    return float(summary["output_throughput"]), None


def main(argv: list[str]) -> None:
    out, pairs, baseline, label, sizes = argv[0], int(argv[1]), argv[2], argv[3], argv[4:]
    width = len(f"serve / {label}")
    print(f"{'C':>4} {'pair':>4} {label + ' tok/s':>26} {'serve tok/s':>26} {f'serve / {label}':>{width}}")
    for c in sizes:
        ratios: list[float] = []
        for p in range(1, pairs + 1):
            (v, v_err), (s, s_err) = run(out, baseline, c, p), run(out, "serve", c, p)
            ratio = f"{s / v:.3f}" if v and s else "-"
            if v and s:
                ratios.append(s / v)
            print(f"{c:>4} {p:>4} {v_err or f'{v:.1f}':>26} {s_err or f'{s:.1f}':>26} {ratio:>{width}}")
        median = f"{statistics.median(ratios):.3f}" if ratios else "- (no pair finished)"
        print(f"{c:>4} median serve / {label} {median} over {len(ratios)} of {pairs} pairs")


if __name__ == "__main__":
    main(sys.argv[1:])
