"""What verifying a draft costs: the engine's decode step with K draft tokens per request against K = 0.

What and why: speculative decoding pays when a step that computes 1 + K tokens per request costs little
more than a step of one token per request (a decode step reads every weight once, whatever its number of
rows, until the arithmetic catches up). This script times `ModelRunner.execute_model` (the whole forward
and the logits of every verified position) for B requests at context T with 0 .. K draft tokens each, on
a checkpoint, and prints the step time and its ratio to K = 0 per batch size: the rows where the ratio
stays near 1 are where verification is free; past them a draft token costs what the token it may save
costs. It is the measurement behind `spec_decode.config.DEFAULT_VERIFY_ROWS` and docs/engine.md.

Oracle first: for B = 1 and the largest K, the logits of the verified positions computed in one step equal
those computed one token per step (float32, relative tolerance 1e-4), else it exits 1.

Timing: per (B, K), `--repeats` timed steps after one warm-up, the K values interleaved within each
repeat so that a shared machine's load falls on all of them alike; the table gives the median of the
thread's CPU time in ms (`time.thread_time`: the step's own work, its stalls on memory included,
without the time other processes held the core), each line ends with the wall-clock ratios, and both
are in `--json`. The KV
blocks hold the zeros they were allocated with (their values do not change the arithmetic).

    OPENBLAS_NUM_THREADS=1 uv run python scripts/spec_step_cost.py --model models/small-llama \
        --batch 1 2 4 8 16 32 --k 0 1 2 4 --context 256 --repeats 7 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.engine.request import Request, SamplingParams
from attention_kv_caceh.engine.scheduler import SchedulerOutput
from attention_kv_caceh.model_executor.model import Model
from attention_kv_caceh.timing import capture_environment

BLOCK = 16


def step_output(requests: list[Request], n: dict[str, int], drafts: dict[str, list[int]]) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_requests=requests,
        num_scheduled_tokens=n,
        total_num_scheduled_tokens=sum(n.values()),
        num_prefill_tokens=0,
        num_decode_tokens=sum(n.values()),
        scheduled_spec_decode_tokens=drafts,
        num_computed_tokens={r.request_id: r.num_computed_tokens for r in requests},
    )


def make_requests(b: int, context: int, k: int, vocab: int, rng: np.random.Generator) -> list[Request]:
    """B requests whose tokens 0 .. context - 2 count as computed, each with its own blocks."""
    per = -(-(context + k + 1) // BLOCK)
    out = []
    for i in range(b):
        r = Request(str(i), rng.integers(0, vocab, size=context).tolist(), SamplingParams())
        r.num_computed_tokens = context - 1
        r.block_ids = list(range(i * per, (i + 1) * per))
        out.append(r)
    return out


def oracle(model: Model, k: int, vocab: int) -> float:
    """Largest relative difference between the one-step verify logits and one token per step."""
    config = EngineConfig(block_size=BLOCK, num_kv_blocks=64)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, vocab, size=24).tolist()
    drafts = rng.integers(0, vocab, size=k).tolist()

    def fresh(ids: list[int]) -> np.ndarray:
        runner = ModelRunner(model, config, 64)
        r = Request("0", ids, SamplingParams())
        r.block_ids = list(range(4))
        return runner.execute_model(step_output([r], {"0": len(ids)}, {}))[0]

    reference = np.array([fresh((tokens + drafts)[:end]) for end in range(24, 25 + k)])
    runner = ModelRunner(model, config, 64)
    r = Request("0", tokens, SamplingParams())
    r.block_ids = list(range(4))
    runner.execute_model(step_output([r], {"0": 23}, {}))
    r.num_computed_tokens = 23
    got = runner.execute_model(step_output([r], {"0": 1 + k}, {"0": drafts}))
    return float(np.max(np.abs(got - reference)) / np.max(np.abs(reference)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ks = sorted(set([0, *args.k]))
    model = Model.load(args.model, "float32")
    vocab = model.config.vocab_size
    diff = oracle(model, max(ks), vocab)
    if diff > 1e-4:
        print(f"oracle failed: verify logits differ from one token per step by {diff:.2e} (relative)")
        return 1
    print(f"{args.model}: {model.config.architecture}, {model.num_parameters / 1e6:.0f} M parameters, "
          f"{model.gemm_path} GEMM, context {args.context}; oracle: verify logits within {diff:.1e} of one token per step")  # fmt: skip
    rng = np.random.default_rng(0)
    rows = []
    header = f"{'B':>4}" + "".join(f"{f'K={k} cpu':>11}{'rows':>6}{'ratio':>7}" for k in ks)
    print(header)
    print("-" * len(header))
    for b in args.batch:
        per = -(-(args.context + max(ks) + 1) // BLOCK)
        runner = ModelRunner(model, EngineConfig(block_size=BLOCK, num_kv_blocks=b * per), b * per)
        cases = {}
        for k in ks:
            reqs = make_requests(b, args.context, k, vocab, rng)
            drafts = {r.request_id: rng.integers(0, vocab, size=k).tolist() for r in reqs} if k else {}
            cases[k] = step_output(reqs, {r.request_id: 1 + k for r in reqs}, drafts)
            runner.execute_model(cases[k])  # warm-up
        wall: dict[int, list[float]] = {k: [] for k in ks}
        cpu: dict[int, list[float]] = {k: [] for k in ks}
        for _ in range(args.repeats):
            for k in ks:
                t0, c0 = time.perf_counter(), time.thread_time()
                runner.execute_model(cases[k])
                cpu[k].append((time.thread_time() - c0) * 1e3)
                wall[k].append((time.perf_counter() - t0) * 1e3)
        med = {k: statistics.median(v) for k, v in cpu.items()}
        med_wall = {k: statistics.median(v) for k, v in wall.items()}
        rows.append(
            {
                "batch": b,
                "cpu_ms": {str(k): med[k] for k in ks},
                "wall_ms": {str(k): med_wall[k] for k in ks},
                "cpu_ratio": {str(k): med[k] / med[0] for k in ks},
                "wall_ratio": {str(k): med_wall[k] / med_wall[0] for k in ks},
            }
        )
        print(
            f"{b:>4}"
            + "".join(f"{med[k]:>11.2f}{b * (1 + k):>6}{med[k] / med[0]:>7.2f}" for k in ks)
            + "   wall ratios "
            + " ".join(f"{med_wall[k] / med_wall[0]:.2f}" for k in ks),
            flush=True,
        )
    if args.json:
        env = capture_environment() | {"model": args.model, "context": args.context, "repeats": args.repeats}
        Path(args.json).write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
