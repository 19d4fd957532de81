"""BenchEngineConfig and `bench_engine`: what `bench-engine` runs, with or without speculative decoding.

One body for both benchmarks: without a speculative config, `engine.run_engine_benchmark` (random
token-id prompts drawn inside it); with one, `spec_decode.run_spec_benchmark` over the prompts
`spec_prompts` builds (random token ids, or copy-heavy text of `harness.copy_workload`). Either way the
result is the rows (as dicts) and the environment, which the command prints and writes.

Left out: vLLM's dataset sources for the prompts (ShareGPT, sonnet, Hugging Face datasets).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attention_kv_caceh.cpus import check_threads
from attention_kv_caceh.engine.config import model_option
from attention_kv_caceh.engine.spec_decode.config import SpeculativeConfig
from attention_kv_caceh.kernels.dispatch import GEMM_CHOICES
from attention_kv_caceh.options import ConfigError, check_options, option

if TYPE_CHECKING:
    from attention_kv_caceh.engine.tokenizer import Tokenizer
    from attention_kv_caceh.model_executor.model_config import ModelConfig

__all__ = ["BenchEngineConfig", "BenchResult", "bench_engine", "spec_prompts"]


_SIZES = (1, 4, 16, 32)


@dataclass(frozen=True, kw_only=True)
class BenchEngineConfig:
    """The flags of `bench-engine` that are not the engine's; the engine's it takes (the token budget,
    block size, dtype, quantization, speculative config) are plain fields, EngineConfig's flags."""

    model: str = model_option()
    max_num_seqs: tuple[int, ...] = option(
        _SIZES,
        help="one run per value, each with N requests at once",
        metavar="N",
        nargs="+",
        parse=int,
        minimum=1,
        default_text=str(list(_SIZES)),
    )
    prompt_len: int = option(128, help="prompt tokens per request", metavar="PROMPT_LEN", minimum=1)
    output_len: int = option(128, help="output tokens per request", metavar="OUTPUT_LEN")
    workload: str = option(
        "random",
        help="with --speculative-config: random token ids, or copy-heavy prompts (repeat a passage with "
        "one change)",
        choices=("random", "copy"),
    )
    pairs: int = option(
        1,
        help="with --speculative-config: alternating runs without and with drafts per max_num_seqs (medians)",
        minimum=1,
    )
    gemm: str = option(
        "auto",
        help="linear layers: auto (packed where the CPU has AVX-512, AVX2 or NEON and activations are "
        "float32, else numpy), packed (the compiled kernel of that instruction set; to run the AVX2 "
        "one on an AVX-512 CPU, set NUMBA_CPU_NAME=znver3 NUMBA_CPU_FEATURES= ), or numpy (x @ W.T)",
        choices=GEMM_CHOICES,
    )
    temperature: float = option(
        0.0,
        help="sampling temperature of every request; 0 is greedy (a serve request without temperature "
        "samples at 1.0)",
        metavar="T",
        minimum=0.0,
    )
    seed: int = option(
        0,
        help="seed of the random prompts and of every request's sampling generator",
        metavar="SEED",
        minimum=0,
        maximum=2**63 - 1,
    )
    json: str | None = option(
        None, help="rows and environment as JSON (default: not written)", metavar="PATH.json"
    )
    threads: tuple[int, ...] | None = option(
        None,
        help="one run per value, on that many engine threads, the read probe on as many; then a "
        "thread table (default: one run on the engine's default threads, the read probe on one)",
        metavar="N",
        nargs="+",
        parse=int,
        minimum=1,
    )
    max_num_batched_tokens: int = 512
    block_size: int = 16
    dtype: str = "float32"
    quantization: str | None = None
    activations: str | None = None
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.output_len < 2:
            raise ConfigError(
                "output_len", f"must be >= 2 (one prefill token and one decode step), got {self.output_len}"
            )
        check_options(self)
        for count in self.threads or ():
            try:
                check_threads(count)
            except ValueError as exc:
                raise ConfigError("threads", str(exc)) from None
        if self.threads is not None and self.speculative_config is not None:
            raise ConfigError(
                "threads",
                "is not taken with --speculative-config (that comparison runs on the default threads)",
            )
        if not math.isfinite(self.temperature):
            raise ConfigError("temperature", f"must be a finite number, got {self.temperature}")
        if self.max_num_batched_tokens < max(self.max_num_seqs):
            raise ConfigError(
                "max_num_batched_tokens",
                f"{self.max_num_batched_tokens} must be >= every max_num_seqs (largest "
                f"{max(self.max_num_seqs)}) so every running request can decode in one step",
            )

    @property
    def sizes(self) -> list[int]:
        """The max_num_seqs values, sorted, each once: one run each, in this order."""
        return sorted(set(self.max_num_seqs))


@dataclass(frozen=True)
class BenchResult:
    """The rows of one `bench_engine` run as dicts (max_num_seqs order) and its environment."""

    rows: list[dict[str, Any]]
    environment: dict[str, Any]


def spec_prompts(
    config: BenchEngineConfig, model_config: ModelConfig, tokenizer: Tokenizer
) -> list[list[int]]:
    """The prompts of the comparison with speculation, as token ids: for `copy`, the copy-heavy texts of
    `harness.copy_workload` (a passage of at least prompt_len words) encoded by `tokenizer`; for
    `random`, prompt_len random ids below the vocabulary size, drawn from `seed`."""
    import numpy as np

    from attention_kv_caceh.harness.copy_workload import copy_prompts

    count = max(config.sizes)
    if config.workload == "copy":
        return [tokenizer.encode(text) for text in copy_prompts(count, config.seed, config.prompt_len)]
    rng = np.random.default_rng(config.seed)
    return rng.integers(0, model_config.vocab_size, size=(count, config.prompt_len)).tolist()


def bench_engine(
    config: BenchEngineConfig, model: Path, tokenizer: Tokenizer, prompts: list[list[int]] | None = None
) -> BenchResult:
    """Run the benchmark `config` names on the checkpoint at `model`: with no speculative config,
    `run_engine_benchmark` (streaming text through `tokenizer`); with one, `run_spec_benchmark` over
    `prompts` (`spec_prompts`). Raises what they raise (ValueError, CheckpointError, OracleMismatch)."""
    common: dict[str, Any] = {
        "block_size": config.block_size,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "gemm": config.gemm,
        "temperature": config.temperature,
        "quantization": config.quantization,
        "activations": config.activations,
    }
    if config.speculative_config is None and config.threads is not None:
        from attention_kv_caceh.benchmarks.thread_table import run_thread_sweep

        rows, environment = run_thread_sweep(
            model, config.threads, config.sizes, prompt_len=config.prompt_len,
            output_len=config.output_len, dtype=config.dtype, seed=config.seed, tokenizer=tokenizer,
            **common,
        )  # fmt: skip
        return BenchResult(rows, environment)
    if config.speculative_config is None:
        from attention_kv_caceh.benchmarks.engine import run_engine_benchmark

        result = run_engine_benchmark(
            model, config.sizes, config.prompt_len, config.output_len, config.dtype, config.seed,
            tokenizer=tokenizer, **common,
        )  # fmt: skip
        return BenchResult([asdict(row) for row in result.rows], result.environment)
    from attention_kv_caceh.benchmarks.spec_decode import run_spec_benchmark

    assert prompts is not None, "the comparison with speculation runs over given prompts"
    rows, environment = run_spec_benchmark(
        model, config.speculative_config, prompts, config.sizes, config.output_len, config.dtype,
        workload=config.workload, pairs=config.pairs, seed=config.seed, **common,
    )  # fmt: skip
    return BenchResult([asdict(row) for row in rows], environment)
