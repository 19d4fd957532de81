"""Warm-up: run the model once on dummy inputs when the engine is built, so its first real step compiles nothing.

What vLLM v1's `v1/worker/gpu_worker.py` (`compile_or_warm_up_model`) and `gpu_model_runner.py`
(`_dummy_run`) do, for one CPU process: before any request, a forward pass over dummy tokens makes
every kernel a step calls compile (or load from Numba's disk cache) for the exact argument types the
model passes. Numba compiles one machine-code version per argument-type signature, and a signature
includes each array's dtype, rank, layout and whether it is read-only: a GGUF file's float32 tensors
(the RMSNorm weights) are read-only views of the file, so a warm-up on arrays made for the purpose
would miss the signatures the model's own weights need. Running the model's own `forward` on its own
weights and KV buffers covers whatever signatures it uses. Left out: vLLM's CUDA-graph capture and
its profiling run that sizes the KV cache (`memory.py` sizes it here from the flags).

`numba_compile_counts` reads Numba's per-function statistics, so a caller can say whether the kernels
were compiled or loaded from the disk cache.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import numpy.typing as npt
from numba.core.dispatcher import Dispatcher

from attention_kv_caceh.model_executor.model import Model
from attention_kv_caceh.model_executor.paged_attention import AttentionMetadata

__all__ = ["numba_compile_counts", "warm_up"]

FloatArray = npt.NDArray[np.floating[Any]]


def numba_compile_counts() -> tuple[int, int]:
    """(compiled, loaded) signatures so far in this process, summed over every Numba function of the
    package's modules already imported: compiled is Numba's cache misses (a compile from source),
    loaded its cache hits (machine code read from the disk cache)."""
    compiled = loaded = 0
    for name, module in list(sys.modules.items()):
        if name != "attention_kv_caceh" and not name.startswith("attention_kv_caceh."):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Dispatcher):
                stats = value.stats
                compiled += sum(stats.cache_misses.values())
                loaded += sum(stats.cache_hits.values())
    return compiled, loaded


def _metadata(num_tokens: int, block_size: int) -> AttentionMetadata:
    """One request at positions 0 .. num_tokens - 1 in blocks 0, 1, ... (slots 0 .. num_tokens - 1)."""
    num_blocks = -(-num_tokens // block_size)
    return AttentionMetadata(
        slot_mapping=np.arange(num_tokens, dtype=np.int64),  # [N]
        query_start_loc=np.array([0, num_tokens], dtype=np.int64),  # [R + 1], R = 1
        block_tables=np.arange(num_blocks, dtype=np.int32)[None],  # [1, blocks]
        context_lens=np.array([num_tokens], dtype=np.int64),  # [R]
        block_size=block_size,
    )


def warm_up(model: Model, kv_caches: list[tuple[FloatArray, FloatArray]]) -> float:
    """Run `model` on one decode token and, where the pool has two slots, a two-token prefill, then its
    LM head; returns the seconds that took.

    kv_caches: the runner's per-layer (K, V) buffers, K `[num_blocks, H_kv, D, block_size]` and V
    `[num_blocks, H_kv, block_size, D]` (`paged_attention.allocate_kv_cache`). The dummy tokens (id 0)
    write their K/V into the first slots, whose blocks are zeroed again afterwards, so the buffers are
    left as they were made. The first decode step then runs the paged decode kernel
    (`decode_attention.paged_decode_attention_into`), the packed linear kernel and the compiled small layers of
    `model_executor/layers.py` on signatures already compiled; a step with prefill tokens runs the same
    compiled functions (its attention is NumPy). Raises nothing beyond what `Model.forward` raises.
    """
    start = time.perf_counter()
    k_cache = kv_caches[0][0]
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[3]
    sizes = [1, 2] if num_blocks * block_size >= 2 else [1]
    for n in sizes:
        metadata = _metadata(n, block_size)
        ids = np.zeros(n, dtype=np.int64)  # [N]
        hidden = model.forward(ids, np.arange(n, dtype=np.int64), kv_caches, metadata)  # [N, D_model]
        model.compute_logits(hidden[-1:])  # [1, V]
    used_blocks = -(-max(sizes) // block_size)
    for k, v in kv_caches:
        k[:used_blocks] = 0
        v[:used_blocks] = 0
    return time.perf_counter() - start
