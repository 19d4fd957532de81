"""Where a decode step's time goes: this thread's CPU time per step in each part of the engine's step.

Runs `bench-engine`'s setup (R random prompts of PROMPT tokens, greedy, ignore_eos, OUTPUT tokens each,
a KV pool of exactly the blocks they need) on one LLMEngine and, for the pure-decode steps after the
first, adds up time.thread_time() spent inside each of the functions that `Model.forward`, the model
runner, the engine core and the scheduler call (wrapped here by name; a wrapper costs about a
microsecond per call). Nested parts are included in their callers (`linear` includes the LM head of
`compute_logits`; `execute_model` includes `forward`). Prints ms per step and calls per step.

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 uv run python scripts/profile_decode_step.py \
        --model models/small-llama --num-seqs 32 [--quantization gguf --activations int8]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

import attention_kv_caceh.engine.model_runner as runner_module
import attention_kv_caceh.model_executor.model as model_module
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.scheduler import Scheduler
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.model_executor.model import Model

# Module-level functions that Model.forward and EngineCore.step call through their module's namespace.
FORWARD_PARTS = (
    "linear",
    "paged_decode_attention_into",
    "write_kv",
    "rope_cos_sin",
    "rms_norm",
    "apply_rotary",
    "silu_and_mul",
    "compiled_rms_norm",
    "compiled_rotary",
    "compiled_silu_and_mul",
)
METHODS = (
    (ModelRunner, "execute_model"),
    (ModelRunner, "prepare_inputs"),
    (Model, "forward"),
    (Model, "compute_logits"),
    (Scheduler, "schedule"),
    (Scheduler, "update_from_output"),
)


class Timers:
    """Thread CPU seconds and calls per name, counted only while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: dict[str, float] = {}
        self.calls: Counter[str] = Counter()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.thread_time() - start
                self.calls[name] += 1

        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description="thread CPU time per decode step in each part of the step")
    parser.add_argument("--model", required=True, help="model folder (make-model --preset small)")
    parser.add_argument("--num-seqs", type=int, default=32, help="requests decoding together")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--quantization", default=None, help="as bench-engine's (gguf: the file's blocks)")
    parser.add_argument("--activations", default=None, choices=("int8", "float32"), help="as bench-engine's")
    args = parser.parse_args()

    timers = Timers()
    for name in FORWARD_PARTS:
        if hasattr(model_module, name):  # the compiled layers exist from a given commit on
            setattr(model_module, name, timers.wrap(name, getattr(model_module, name)))
    runner_module.sample = timers.wrap("sample", runner_module.sample)  # type: ignore[assignment]
    for cls, name in METHODS:
        setattr(cls, name, timers.wrap(name, getattr(cls, name)))

    r, prompt_len, output_len = args.num_seqs, args.prompt_len, args.output_len
    model = Model.load(args.model, "float32", "auto", args.quantization, args.activations)
    blocks = r * -(-(prompt_len + output_len) // 16)
    config = EngineConfig(
        max_num_seqs=r,
        max_num_batched_tokens=max(2048, r),
        block_size=16,
        num_kv_blocks=blocks,
        max_model_len=prompt_len + output_len,
        enable_prefix_caching=False,
        dtype="float32",
    )
    engine = LLMEngine(
        config,
        ModelRunner(model, config, blocks),
        Tokenizer.load(args.model),
        num_blocks=blocks,
        max_model_len=prompt_len + output_len,
    )
    prompts = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(r, prompt_len)).tolist()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=output_len, ignore_eos=True))
    steps, total = 0, 0.0
    while engine.has_unfinished_requests():
        last = engine.step_stats[-1] if engine.step_stats else None
        timers.on = last is not None and last.num_prefill_tokens == 0  # a decode step follows a decode step
        start = time.thread_time()
        engine.step()
        if timers.on:
            total += time.thread_time() - start
            steps += 1
    print(
        f"{r} sequences, {steps} decode steps, {1e3 * total / steps:.2f} ms CPU per step (with the wrappers)"
    )
    for name, seconds in sorted(timers.seconds.items(), key=lambda item: -item[1]):
        print(
            f"  {name:30s} {1e3 * seconds / steps:8.3f} ms/step  {timers.calls[name] / steps:5.1f} calls/step"
        )


if __name__ == "__main__":
    main()
