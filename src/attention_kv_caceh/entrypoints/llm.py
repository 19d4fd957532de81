"""Offline generation: prompts run through one LLMEngine together, each step handed out as it ends.

vLLM's offline loop (`vllm/entrypoints/llm.py`, `LLM._run_engine`: add every request, `step()` until
none is left, collect the outputs) with each step's `StepStats` yielded, so that a caller can print or
record it while the run goes on (`generate` prints a table row and writes its --trace line). Requests
are named "0", "1", ... in prompt order.

`GenerateConfig` holds the flags of `generate` that are not the engine's (EngineConfig's): the
checkpoint, the prompts, vLLM's SamplingParams fields and the output files. Nothing here prints.

Left out, against `LLM.generate`: batches of prompt dicts, multimodal inputs, LoRA requests, `n` > 1 and
the progress bar.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attention_kv_caceh.engine.config import model_option
from attention_kv_caceh.options import ConfigError, check_options, option

if TYPE_CHECKING:
    from attention_kv_caceh.engine.core import StepStats
    from attention_kv_caceh.engine.llm_engine import LLMEngine
    from attention_kv_caceh.engine.request import SamplingParams
    from attention_kv_caceh.engine.tokenizer import Tokenizer

__all__ = ["GenerateConfig", "OfflineRun", "SamplingOptions", "load_seconds"]


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """The SamplingParams fields `generate` takes as flags (vLLM's names; `params()` builds them)."""

    max_tokens: int = option(
        help="most output tokens per prompt (default: none, required)", required=True, minimum=1
    )
    temperature: float = option(0.0, help="0 is greedy (default: 0)", metavar="T", minimum=0.0)
    top_p: float = option(1.0, help="nucleus sampling mass in (0, 1]", metavar="P")
    top_k: int = option(0, help="keep the k most probable tokens; 0 disables (default: 0)", minimum=0)
    seed: int | None = option(
        None,
        help="seed of every request's own generator, so equal prompts sample equally (default: fresh entropy)",
        minimum=0,
        maximum=2**63 - 1,
    )
    ignore_eos: bool = option(False, help="keep generating after eos (default: stop at eos)")

    def __post_init__(self) -> None:
        check_options(self)
        if not math.isfinite(self.temperature):
            raise ConfigError("temperature", f"must be a finite number, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")

    def params(self) -> SamplingParams:
        """The SamplingParams of every request (ValueError for a value they refuse)."""
        from attention_kv_caceh.engine.request import SamplingParams

        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """`generate`'s own flags: the checkpoint, the prompts (texts or a file, one of them) and the outputs."""

    model: str = model_option()
    prompt: tuple[str, ...] | None = option(
        None,
        help="prompt texts, one or more (default: none; this or --prompts-file)",
        metavar="TEXT",
        nargs="+",
        extend=True,
        exclusive="prompts",
        required=True,
    )
    prompts_file: str | None = option(
        None,
        help="UTF-8 text file, one prompt per line, blank lines skipped (default: none; this or --prompt)",
        metavar="FILE",
        exclusive="prompts",
    )
    output: str | None = option(
        None,
        help="one JSON line per prompt: index, prompt, prompt_token_ids, token_ids, text, finish_reason "
        "(default: not written)",
        metavar="OUT.jsonl",
    )
    trace: str | None = option(
        None,
        help="one JSON line per engine step (StepStats plus finished_request_ids) (default: not written)",
        metavar="STEPS.jsonl",
    )

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompts_file is None):
            raise ConfigError("prompt", "give prompt texts or a prompts file, one of them")


_TOTALS = ("num_prefill_tokens", "num_decode_tokens", "num_preemptions", "prefix_cache_hits")


class OfflineRun:
    """The prompts (`prompt_ids`, token ids) of one run added to `engine` as requests "0", "1", ...

    `steps()` runs them; afterwards (or after an interruption) `outputs` holds each request's output
    token ids, `finish` the finish reason of those that finished, `totals` the StepStats counts summed
    over the steps (engine.step_stats keeps only the newest), `spec_steps` each step's
    SpecDecodingStats (None without drafts).

    Raises:
        ValueError: the engine refused a prompt (from `engine.add_request`).
    """

    def __init__(self, engine: LLMEngine, prompt_ids: list[list[int]], params: SamplingParams) -> None:
        self.engine = engine
        self.outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompt_ids))}
        self.finish: dict[str, str | None] = {}
        self.totals: dict[str, int] = dict.fromkeys(_TOTALS, 0)
        self.spec_steps: list[Any] = []
        for i, ids in enumerate(prompt_ids):
            engine.add_request(str(i), ids, params)

    def steps(self) -> Iterator[tuple[StepStats, list[str]]]:
        """step() until no request is left, yielding each step's StepStats and the ids of the requests
        that finished in it. RuntimeError if a step schedules nothing while requests wait (a bug)."""
        engine = self.engine
        while engine.has_unfinished_requests():
            before = engine.num_steps  # step_stats is bounded: its length stops growing
            step_outputs = engine.step()
            if engine.num_steps == before:
                raise RuntimeError("the engine scheduled nothing while requests were waiting (a bug)")
            done: list[str] = []
            for out in step_outputs:
                self.outputs[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    self.finish[out.request_id] = out.finish_reason
                    done.append(out.request_id)
            stats = engine.step_stats[-1]
            for key in self.totals:
                self.totals[key] += getattr(stats, key)
            self.spec_steps.append(stats.spec_decoding)
            yield stats, done

    @property
    def num_generated_tokens(self) -> int:
        """Output tokens generated so far, over every request (the unfinished ones of an interrupted run
        included)."""
        return sum(map(len, self.outputs.values()))

    def records(
        self, prompts: list[str], prompt_ids: list[list[int]], tokenizer: Tokenizer
    ) -> list[dict[str, Any]]:
        """One record per finished prompt, in prompt order: index, prompt, prompt_token_ids, token_ids,
        text, finish_reason (the lines of `generate --output`)."""
        return [
            {
                "index": i,
                "prompt": prompts[i],
                "prompt_token_ids": prompt_ids[i],
                "token_ids": self.outputs[str(i)],
                "text": tokenizer.decode(self.outputs[str(i)]),
                "finish_reason": self.finish[str(i)],
            }
            for i in range(len(prompts))
            if str(i) in self.finish
        ]


def load_seconds(engine: LLMEngine) -> float | None:
    """Seconds the load spent warming up: the model's kernel preparation and the runner's warm-up forward
    passes (`Model.gemm_compile_s`, `ModelRunner.warmup_s`); None for a runner that is not a ModelRunner."""
    from attention_kv_caceh.engine.model_runner import ModelRunner

    runner = engine.model_runner
    if not isinstance(runner, ModelRunner):
        return None
    return runner.model.gemm_compile_s + runner.warmup_s
