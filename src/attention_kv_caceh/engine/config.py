"""EngineConfig: the engine's limits and the size of its KV cache, validated once.

Corresponds to the parts of vLLM's `SchedulerConfig` (max_num_seqs, max_num_batched_tokens), `CacheConfig`
(block_size, num_gpu_blocks, enable_prefix_caching), `ModelConfig` (max_model_len, dtype, quantization:
GGUF block formats only) and `VllmConfig.speculative_config` the engine uses. Left out: everything about
devices and parallelism (one process; `threads` is the engine core's thread count, as vLLM-CPU's
`VLLM_CPU_OMP_THREADS_BIND` gives its worker's threads), and the quantization methods other than GGUF's blocks.

KV cache size. vLLM profiles a forward pass and gives the KV cache `gpu_memory_utilization` (0.9) of the
GPU's memory minus what the weights and activations took. On a CPU shared with other processes there is
nothing to profile against, so by default the cache gets `DEFAULT_KV_CACHE_FRACTION` of the memory the
kernel reports as available (`MemAvailable` in /proc/meminfo), capped at `DEFAULT_KV_CACHE_MAX_BYTES`
and at the blocks max_num_seqs requests of max_model_len tokens hold at once (`blocks_needed`, which the
caller computes from the model's KV cache groups: `kv_cache_manager.full_batch_blocks`), so a tiny model
does not get a pool of hundreds of thousands of blocks no batch can fill; either `num_kv_blocks` or
`kv_cache_memory` (bytes) overrides that.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attention_kv_caceh.cpus import check_threads, default_threads, numba_pool_size
from attention_kv_caceh.kernels.dispatch import (
    ACTIVATION_CHOICES,
    ENGINE_DTYPES,
    QUANTIZATIONS,
)
from attention_kv_caceh.options import ConfigError, check_options, option

from .spec_decode.config import SpeculativeConfig

__all__ = [
    "DEFAULT_KV_CACHE_FRACTION",
    "DEFAULT_KV_CACHE_MAX_BYTES",
    "MODEL_HELP",
    "SUPPORTED_DTYPES",
    "SUPPORTED_QUANTIZATIONS",
    "EngineConfig",
    "available_memory_bytes",
    "model_option",
]

DEFAULT_KV_CACHE_FRACTION = 0.25
"""Share of the available memory the KV cache takes when no size is given (vLLM's analogue: 0.9 of the GPU)."""
DEFAULT_KV_CACHE_MAX_BYTES = 4 * 1024**3
"""Upper bound of the default KV cache size: 4 GiB, so a large machine is not claimed by a toy model."""
SUPPORTED_DTYPES = ENGINE_DTYPES
SUPPORTED_QUANTIZATIONS = QUANTIZATIONS
MODEL_HELP = (
    "the checkpoint: a model name (smollm2: SmolLM2-135M-Instruct, installed with the project), a .gguf "
    "file, a folder holding one, or a Hugging Face folder (make-model writes one) (default: none, required)"
)


def model_option() -> Any:
    """The `model` field of a command that runs the engine (`--model`: what `model_source.resolve_model`
    takes), required; declared here once for `generate`, `serve` and `bench-engine`."""
    return option(help=MODEL_HELP, metavar="MODEL", required=True)


def available_memory_bytes() -> int:
    """Memory the kernel can give new allocations without swapping, in bytes.

    Reads `MemAvailable` from /proc/meminfo (Linux); elsewhere falls back to
    `os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")` (free pages, an underestimate).

    Raises:
        OSError: neither source is available on this system.
    """
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError) as exc:
        raise OSError("cannot read the available memory (no /proc/meminfo, no sysconf)") from exc


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, f"must be a positive int, got {value!r}")


def _speculative_config(text: str) -> SpeculativeConfig:
    """`--speculative-config`'s JSON object, read with vLLM's rules and messages."""
    return SpeculativeConfig.from_json(text)


_COUNTS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks", "kv_cache_memory")


@dataclass(frozen=True)
class EngineConfig:
    """Limits of the scheduler and size of the paged KV cache.

    Each field is also an engine flag (vLLM's names: `--max-num-seqs`, ...; `options.option` carries
    the flag, help and bounds, `cli/engine_args.py` declares them on `generate`, `serve`,
    `bench-engine` and `harness --backend engine`).

    Attributes:
        max_num_seqs: most requests running at once (vLLM's `max_num_seqs`, the batch's request count).
        max_num_batched_tokens: most tokens computed in one step, prefill and decode together (the
            token budget of vLLM v1's scheduler). Must be >= max_num_seqs so every running request can
            decode in the same step.
        block_size: tokens per KV block.
        num_kv_blocks: explicit number of KV blocks; excludes `kv_cache_memory`.
        kv_cache_memory: bytes for K and V of all layers; the block count is this divided by the bytes of
            one block. Excludes `num_kv_blocks`. Both None: see `num_blocks_for`.
        max_model_len: most tokens (prompt + output) of one request; None takes the checkpoint's
            `max_position_embeddings`, a value may only lower it (`resolve_max_model_len`).
        enable_prefix_caching: share KV blocks between requests with equal prefixes.
        dtype: dtype of the model and its KV cache, "float32" or "float64" (equivalence tests), or
            "bfloat16": the linear layers' weights in bfloat16, activations and KV cache in float32
            (`dispatch.compute_dtype`).
        quantization: None, or the GGUF block format ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1",
            llama.cpp's names) the linear layers keep their weights in (vLLM's `--quantization`), a
            float checkpoint quantized at load; or "gguf": a GGUF file's own tensors of every type of
            `block_formats` (Q4_0 to Q8_0, the k-quants Q2_K to Q6_K, F32, F16, BF16), as stored.
            Not with dtype "bfloat16".
        activations: "int8" or "float32" (`dispatch.ACTIVATION_CHOICES`); None: float32, and no warning
            when no weight has an integer kernel: how a linear layer
            over GGUF blocks with an integer-dot kernel (`block_gemm_int.INT_FORMATS`) treats x; other
            weights ignore it (`layers.linear`).
        speculative_config: speculative decoding (n-gram drafts, `spec_decode/config.py`); None: off.
        threads: threads the engine core computes a step on (Numba's pool, `kernels.threads`); None:
            `cpus.default_threads()` in the core's process (`resolved_threads`). Checked against the
            CPUs this process may use and NUMBA_NUM_THREADS (`cpus.check_threads`). At None, each
            step computes on what other processes' load leaves of it (`cpu_load.LoadGovernor`).
        follow_load: not a flag: `threads` is a default its caller filled in (serve's, for the core's
            process), which the load governor may lower as it does at None; False: a count given is
            used as given.

    Raises:
        ConfigError (a ValueError naming the field): a count is not a positive int, both cache sizes
            are given, the dtype or the quantization is unknown, or a quantization is given with dtype
            "bfloat16", or threads below 1 or above the usable CPUs or Numba's pool.
    """

    max_num_seqs: int = option(8, help="most requests running at once (one step's batch)", minimum=1)
    max_num_batched_tokens: int = option(
        512, help="token budget of one step, prefill and decode together (>= --max-num-seqs)", minimum=1
    )
    block_size: int = option(16, help="tokens per KV block", minimum=1)
    num_kv_blocks: int | None = option(
        None, help="KV blocks in the pool (default: see --kv-cache-memory)", exclusive="kv", minimum=1
    )
    kv_cache_memory: int | None = option(
        None,
        help="bytes for K and V of all layers (default: 1/4 of the available memory, at most 4 GiB and "
        "at most what --max-num-seqs requests of max_model_len tokens hold)",
        metavar="BYTES",
        exclusive="kv",
        minimum=1,
    )
    max_model_len: int | None = option(
        None,
        help="most tokens (prompt + output) per request; may only lower the checkpoint's "
        "(default: its max_position_embeddings)",
        minimum=1,
    )
    enable_prefix_caching: bool = option(
        True, help="turn prefix caching off (default: on)", flag="--no-prefix-caching"
    )
    dtype: str = option(
        "float32",
        help="dtype of the weights, activations and KV cache (bfloat16: weights only, computing in float32)",
        choices=SUPPORTED_DTYPES,
    )
    quantization: str | None = option(
        None,
        help="keep the linear layers' weights in a GGUF block format (llama.cpp's names), quantizing a "
        "float checkpoint at load, or gguf: a GGUF file's own tensors as stored (Q4_0 to Q8_0, Q2_K to "
        "Q6_K, F32, F16, BF16; a note names any other) "
        "(default: none, weights in --dtype)",
        choices=SUPPORTED_QUANTIZATIONS,
    )
    activations: str | None = option(
        None,
        help="the linear layers' activations against GGUF blocks with an integer kernel (Q4_0 to Q8_0, "
        "Q2_K to Q6_K): int8 quantizes each row of x to 8 bits once per product (llama.cpp's Q8_0 / "
        "Q8_1 / Q8_K) and multiplies integers; float32 decodes the weights to float32 for each row "
        "(default: float32)",
        choices=ACTIVATION_CHOICES,
    )
    speculative_config: SpeculativeConfig | None = option(
        None,
        help="speculative decoding, vLLM's JSON: "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\' (prompt_lookup_min / _max default to 5; '
        "docs/engine.md) (default: off)",
        metavar="JSON",
        parse=_speculative_config,
    )
    threads: int | None = option(
        None,
        help="threads the engine core computes on (default: the CPUs this process may use, bounded by "
        "its cgroup's quota; serve: one less on four or more, for the API process; fewer while other "
        "processes keep CPUs busy, re-read every 0.5 s; a count given is used as given, with a warning "
        "when other processes keep its CPUs busy at start)",
        metavar="N",
        minimum=1,
    )
    follow_load: bool = False

    def __post_init__(self) -> None:
        for name in _COUNTS[:3]:
            _check_positive_int(name, getattr(self, name))
        for name in (*_COUNTS[3:], "max_model_len"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        check_options(self)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                "max_num_seqs",
                f"must be <= max_num_batched_tokens ({self.max_num_batched_tokens}) so every running "
                f"request can decode in one step, got {self.max_num_seqs}",
            )
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ConfigError(
                "num_kv_blocks",
                f"give it ({self.num_kv_blocks}) or kv_cache_memory ({self.kv_cache_memory}), not both",
            )
        if self.threads is not None:
            try:
                check_threads(self.threads)
            except ValueError as exc:
                raise ConfigError("threads", str(exc)) from None
        if self.quantization is not None and self.dtype == "bfloat16":
            raise ConfigError(
                "quantization", f"{self.quantization!r} needs dtype float32 or float64, got bfloat16"
            )

    def num_blocks_for(
        self, bytes_per_block: int, free_memory: int | None = None, blocks_needed: int | None = None
    ) -> int:
        """Number of KV blocks the cache gets.

        `num_kv_blocks` if given; else `kv_cache_memory // bytes_per_block`; else
        `min(DEFAULT_KV_CACHE_FRACTION * free_memory, DEFAULT_KV_CACHE_MAX_BYTES) // bytes_per_block`,
        at most `blocks_needed`.

        Args:
            bytes_per_block: bytes of K and V of one block over all layers
                (2 * layers * block_size * H_kv * D * itemsize; the model runner computes it).
            free_memory: available memory in bytes; None reads it with `available_memory_bytes()`.
            blocks_needed: the blocks max_num_seqs requests of max_model_len tokens hold at once
                (`kv_cache_manager.full_batch_blocks`); caps the default only. None: no cap.

        Raises:
            ValueError: bytes_per_block, free_memory or blocks_needed is not positive, or the memory
                holds no block.
        """
        _check_positive_int("bytes_per_block", bytes_per_block)
        if blocks_needed is not None:
            _check_positive_int("blocks_needed", blocks_needed)
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        if self.kv_cache_memory is not None:
            budget = self.kv_cache_memory
            source = f"kv_cache_memory={self.kv_cache_memory}"
        else:
            free = available_memory_bytes() if free_memory is None else free_memory
            _check_positive_int("free_memory", free)
            budget = min(int(DEFAULT_KV_CACHE_FRACTION * free), DEFAULT_KV_CACHE_MAX_BYTES)
            source = f"{DEFAULT_KV_CACHE_FRACTION} of {free} available bytes, capped at {DEFAULT_KV_CACHE_MAX_BYTES}"
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget ({source}) holds no block of {bytes_per_block} bytes")
        if self.kv_cache_memory is None and blocks_needed is not None:
            return min(num_blocks, blocks_needed)
        return num_blocks

    def resolved_threads(self) -> int:
        """`threads`, or (None) `cpus.default_threads()` of this process, at most Numba's pool."""
        return min(default_threads(), numba_pool_size()) if self.threads is None else self.threads

    def resolve_max_model_len(self, checkpoint_max_len: int) -> int:
        """The effective max_model_len: the checkpoint's, or this config's when it is lower.

        Raises:
            ValueError: checkpoint_max_len is not positive, or max_model_len exceeds it.
        """
        _check_positive_int("checkpoint_max_len", checkpoint_max_len)
        if self.max_model_len is None:
            return checkpoint_max_len
        if self.max_model_len > checkpoint_max_len:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the checkpoint's max_position_embeddings "
                f"({checkpoint_max_len}); it may only lower it"
            )
        return self.max_model_len
