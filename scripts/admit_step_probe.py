"""How long does the engine take to add a long prompt, and how long is the step that admits it?

What and why: a prompt of hundreds of thousands of tokens has tens of thousands of full KV blocks, and each
needs its prefix-cache hash. Whatever of that work runs inside `step()` delays every other running request
by as much. This probe builds an in-process engine (`LLMEngine`, the core in this thread) on a copy of the
checkpoint whose context fits the prompt, then for each repeat: times `add_request` of the prompt, times
the `step()` that admits it (its first prefill chunk), aborts it and resets the prefix cache, so each
repeat starts from the same state. The prompt is `--unit` repeated to `--size-bytes` bytes, tokenized by
the checkpoint's tokenizer.

With `--mp` the core runs in its own process behind ZMQ (`MPClient.launch_process`, as `serve` runs it):
a neighbour request decodes, the long prompt is added, and once a step has scheduled the long prompt's
first chunk it is aborted. Printed: the neighbour's median step, the longest step between the add and the
admission (the core's input thread and busy loop share one GIL), and the admitting step (wall and CPU).

A development tool: not part of the package and not run in CI. Timings on a shared machine are
contaminated by whatever else runs: the 1-minute load average is printed beside them.

    uv run attention-kv-caceh make-model --preset tiny --out models/tiny
    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 uv run python scripts/admit_step_probe.py --model models/tiny
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.core import EngineCoreRequest, StepStats
from attention_kv_caceh.engine.core_client import MPClient
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.tokenizer import Tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint folder")
    parser.add_argument("--size-bytes", type=int, default=1_000_000, help="bytes of prompt text")
    parser.add_argument("--unit", default="hello world ", help="text repeated to make the prompt")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--repeats", type=int, default=3, help="add + admitting step, this many times")
    parser.add_argument("--mp", action="store_true", help="the core in its own process, beside a neighbour")
    args = parser.parse_args()

    text = args.unit * (args.size_bytes // len(args.unit))
    ids = Tokenizer.load(args.model).encode(text)
    context = len(ids) + 64
    num_blocks = -(-context // args.block_size) + 8
    with tempfile.TemporaryDirectory(prefix="long-context-") as tmp:
        copy = Path(tmp) / "model"
        shutil.copytree(args.model, copy)
        config_path = copy / "config.json"
        model_config = json.loads(config_path.read_text())
        model_config["max_position_embeddings"] = context
        config_path.write_text(json.dumps(model_config))
        config = EngineConfig(block_size=args.block_size, num_kv_blocks=num_blocks, max_model_len=context)
        if args.mp:
            probe_mp(str(copy), config, ids, args.repeats)
            return
        engine = LLMEngine.from_pretrained(str(copy), config)
    add_ms: list[float] = []
    step_ms: list[float] = []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        engine.add_request(f"big-{i}", ids, SamplingParams(max_tokens=1))
        add_ms.append((time.perf_counter() - t0) * 1e3)
        engine.step()
        step_ms.append(engine.step_stats[-1].step_time_ms)
        engine.abort_request(f"big-{i}")
        engine.reset_prefix_cache()
    load = os.getloadavg()[0]
    print(
        f"prompt {len(ids)} tokens ({len(ids) // args.block_size} full blocks of {args.block_size}): "
        f"add_request {' '.join(f'{t:.1f}' for t in add_ms)} ms, admitting step "
        f"{' '.join(f'{t:.1f}' for t in step_ms)} ms (median {statistics.median(step_ms):.1f}); load {load:.2f}"
    )


def probe_mp(model: str, config: EngineConfig, ids: list[int], repeats: int) -> None:
    """The core in its own process: a decoding neighbour, then the long prompt added and aborted once
    admitted; prints one line per repeat."""
    client = MPClient.launch_process(model, config)
    try:
        for i in range(repeats):
            neighbour = EngineCoreRequest(
                f"n-{i}", [5, 6, 7], SamplingParams(max_tokens=100_000, ignore_eos=True)
            )
            client.add_request(neighbour)
            steps: list[StepStats] = []
            while len(steps) < 200:  # the neighbour's own steps first
                out = client.get_output(60.0)
                assert out is not None
                if out.step_stats is not None:
                    steps.append(out.step_stats)
            base = statistics.median(s.step_time_ms for s in steps[-100:])
            big = f"big-{i}"
            client.add_request(EngineCoreRequest(big, ids, SamplingParams(max_tokens=1)))
            window: list[StepStats] = []
            while True:
                out = client.get_output(60.0)
                assert out is not None
                if out.step_stats is None:
                    continue
                window.append(out.step_stats)
                if big in out.step_stats.num_scheduled_tokens:
                    break
            client.abort_requests([big, neighbour.request_id])
            admit = window[-1]
            before = max((s.step_time_ms for s in window[:-1]), default=0.0)
            print(
                f"mp: neighbour step median {base:.2f} ms; {len(window) - 1} steps between add and admission, "
                f"longest {before:.1f} ms; admitting step {admit.step_time_ms:.1f} ms wall, "
                f"{admit.step_cpu_ms:.1f} ms CPU; load {os.getloadavg()[0]:.2f}"
            )
            time.sleep(0.5)
            while (out := client.get_output(0.2)) is not None and (out.outputs or out.step_stats):
                pass  # drain what the aborts left
    finally:
        client.shutdown()
        client.close()


if __name__ == "__main__":
    main()
