"""What a parallel region costs: per launch (an empty region, each threading layer) and per decode step of the real model.

    OPENBLAS_NUM_THREADS=1 uv run python scripts/launch_overhead.py                  # both layers, 1 and 2 threads
    OPENBLAS_NUM_THREADS=1 uv run python scripts/launch_overhead.py --layer omp --quantization gguf

Part 1 (one child process per threading layer, since Numba fixes the layer at the first launch):
`kernels.threads.launch_overhead_us` at every thread count: microseconds of one empty parallel region,
back to back. Part 2 (this process, the layer `kernels.threads` picks): one decode step of `--seqs`
requests of `--model` on the engine at `--threads`, counting the parallel regions it launches (the
GEMMs' output-row splits and the paged decode attention), and that count times the part-1 cost: the
launch overhead of one step. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

CHILD = (
    "import json, sys\n"
    "from attention_kv_caceh.kernels import threads\n"
    "counts = [int(t) for t in sys.argv[1:]]\n"
    "costs = {t: threads.launch_overhead_us(t) for t in counts}\n"
    "print(json.dumps({'layer': threads.threading_layer(), 'us': costs}))\n"
)


def layer_costs(layer: str, counts: list[int]) -> dict[str, Any]:
    """{layer, us: {threads: microseconds per empty region}} measured in a child process."""
    env = os.environ | {"NUMBA_THREADING_LAYER": layer}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, counts)], capture_output=True, text=True, env=env, timeout=600
    )
    if done.returncode != 0:
        return {"layer": layer, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def launches_per_step(model_name: str, quantization: str | None, threads: int, seqs: int) -> dict[str, int]:
    """Parallel regions one pure decode step launches: {"gemm": ..., "attention": ...}."""
    import numpy as np

    from attention_kv_caceh.engine.config import EngineConfig
    from attention_kv_caceh.engine.llm_engine import LLMEngine
    from attention_kv_caceh.engine.model_runner import ModelRunner
    from attention_kv_caceh.engine.request import SamplingParams
    from attention_kv_caceh.kernels import _decode_attention_paged_jit as paged
    from attention_kv_caceh.kernels import block_gemm, gemm
    from attention_kv_caceh.model_executor.model import Model

    counts = {"gemm": 0, "attention": 0}

    def counting_split(original: Any) -> Any:
        def split(kernel: Any) -> Any:
            drive = original(kernel)

            def counted(*args: Any) -> None:
                counts["gemm"] += 1
                drive(*args)

            return counted

        return split

    gemm.row_split = counting_split(gemm.row_split)  # type: ignore[assignment]
    block_gemm.row_split = counting_split(block_gemm.row_split)  # type: ignore[assignment]
    parallel: Any = getattr(paged, "paged_parallel")  # noqa: B009

    def attention(*args: Any) -> None:
        counts["attention"] += 1
        parallel(*args)

    paged.paged_parallel = attention  # type: ignore[assignment]
    model = Model.load(model_name, "float32", "auto", quantization)
    blocks = seqs * 4
    config = EngineConfig(
        max_num_seqs=seqs, block_size=16, num_kv_blocks=blocks, max_model_len=64, threads=threads,
        enable_prefix_caching=False, quantization=quantization,
    )  # fmt: skip
    engine = LLMEngine(config, ModelRunner(model, config, blocks), None, num_blocks=blocks, max_model_len=64)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(f"r{i}", rng.integers(0, model.config.vocab_size, 16).tolist(), params)
    while not (engine.step_stats and engine.step_stats[-1].num_prefill_tokens == 0):
        engine.step()
    counts["gemm"] = counts["attention"] = 0
    engine.step()
    assert engine.step_stats[-1].num_prefill_tokens == 0
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(
        description="launch cost of a parallel region, per layer and per decode step"
    )
    parser.add_argument("--layer", nargs="+", default=["omp", "workqueue"], help="threading layers to time")
    parser.add_argument("--threads", type=int, default=2, help="engine threads of the step (part 2)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--quantization", nargs="+", default=["none", "gguf"], help="none: float32")
    parser.add_argument("--seqs", type=int, default=8, help="requests in the decode step")
    args = parser.parse_args()
    counts = sorted({1, args.threads})
    layers = [layer_costs(layer, counts) for layer in args.layer]
    for row in layers:
        print(
            f"{row['layer']:>10}: "
            + ", ".join(f"{t} threads {us:.2f} us" for t, us in row.get("us", {}).items())
        )
    from attention_kv_caceh.kernels import threads

    steps = {}
    for q in args.quantization:
        found = launches_per_step(args.model, None if q == "none" else q, args.threads, args.seqs)
        total = found["gemm"] + found["attention"]
        cost = threads.launch_overhead_us(args.threads)
        steps[q] = found | {"launches": total, "us_per_launch": cost, "us_per_step": total * cost}
        print(
            f"{args.model} {q}: {total} parallel regions per decode step ({found['gemm']} GEMM splits, "
            f"{found['attention']} attention) x {cost:.2f} us = {total * cost:.0f} us per step "
            f"({threads.threading_layer()}, {args.threads} threads)"
        )
    print(json.dumps({"layers": layers, "steps": steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
