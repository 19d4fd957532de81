"""Decode steps for the batch-size scan beside its NumPy step: the fused Numba kernel, and torch's SDPA.

Each step does what `attention.multihead_decode_step` does to the scan's inputs (experiments/scan.py):
append one position `[B, H_kv, 1, D]` to the cache, then attend `q_t [B, H, 1, D]` over the T+1 cached
positions `[B, H_kv, T+1, D]`, so the three paths time the same work on the same arrays. The fused step
writes into a preallocated output and returns no weights; the torch step exists only where torch can
be imported (it is not a dependency of this project) and is imported lazily.

The cache's arrays are read in place whatever their strides: a PreallocatedKVCache returns views of its
`[B, H_kv, T_max, D]` buffer, which are not C-contiguous when T + 1 < T_max; the kernel reads them
without a copy (tests/test_kernels_scan.py checks both cases against the NumPy step).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.cache import KVCache
from attention_kv_caceh.kernels.decode_attention import decode_attention_into, prepare_decode_attention

__all__ = [
    "FusedDecodeStep",
    "torch_sdpa_available",
    "torch_sdpa_step",
]

FloatArray = npt.NDArray[np.floating[Any]]


class FusedDecodeStep:
    """A decode step through the fused kernel, with its output buffer allocated once.

    `FusedDecodeStep(q_t, threads=1)` checks q_t `[B, H, 1, D]` (float32 or float64) and allocates
    `out [B, H, 1, D]`; `step(q_t, k_t, v_t, cache)` appends k_t, v_t `[B, H_kv, 1, D]` to `cache` and
    writes softmax(q K^T / sqrt(D)) V into `out`, which it returns (the same array every call). The
    hot path does no argument checks beyond the cache's own append; `prepare(q_t, k_t, v_t, cache)`
    compiles the kernel for the step's array types first and returns the compile seconds.

    Raises ValueError from the constructor for a q_t of the wrong rank or dtype.
    """

    def __init__(self, q_t: FloatArray, threads: int = 1) -> None:
        q_t = np.asarray(q_t)
        if q_t.ndim != 4 or q_t.shape[2] != 1:
            raise ValueError(f"q_t must be [B, H, 1, D], got shape {q_t.shape}")
        if q_t.dtype.name not in ("float32", "float64"):
            raise ValueError(f"q_t must be float32 or float64, got {q_t.dtype}")
        self.threads = threads
        self.scale = 1.0 / math.sqrt(q_t.shape[3])
        self.out: FloatArray = np.zeros_like(q_t)  # [B, H, 1, D]
        self._out_rows = self.out[:, :, 0]  # [B, H, D], a view

    def prepare(self, q_t: FloatArray, k_t: FloatArray, v_t: FloatArray, cache: KVCache) -> float:
        """Compile (or load) the kernel for the arrays a step will see; returns the seconds it took.

        Appends k_t, v_t as a step does (so the cache's arrays have the step's layout), runs the kernel
        once, then truncates the cache back to its length before the call.
        """
        length = cache.length
        keys, values = cache.append(k_t, v_t)  # [B, H_kv, T+1, D] each
        try:
            return prepare_decode_attention(q_t[:, :, 0], keys, values, self._out_rows, self.threads)
        finally:
            cache.truncate(length)

    def __call__(self, q_t: FloatArray, k_t: FloatArray, v_t: FloatArray, cache: KVCache) -> FloatArray:
        keys, values = cache.append(k_t, v_t)  # [B, H_kv, T+1, D] each
        decode_attention_into(q_t[:, :, 0], keys, values, self._out_rows, self.scale, self.threads)
        return self.out


def torch_sdpa_available() -> bool:
    """True when `import torch` would find a package (nothing is imported)."""
    return importlib.util.find_spec("torch") is not None


def torch_sdpa_step(threads: int = 1) -> Callable[[FloatArray, FloatArray, FloatArray, KVCache], FloatArray]:
    """A decode step through `torch.nn.functional.scaled_dot_product_attention` on the scan's arrays.

    Imports torch and sets its intra-op thread count to `threads` for the whole process
    (`torch.set_num_threads`). The returned `step(q_t, k_t, v_t, cache)` appends to the cache, wraps
    q_t `[B, H, 1, D]` and the cached `[B, H_kv, T+1, D]` keys and values with `torch.from_numpy` (no
    copy) and returns SDPA's output as a NumPy array `[B, H, 1, D]` (GQA through `enable_gqa=True`).

    Raises ImportError when torch is not installed (check `torch_sdpa_available()` first), ValueError
    for threads < 1.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch = importlib.import_module("torch")
    sdpa = importlib.import_module("torch.nn.functional").scaled_dot_product_attention
    torch.set_num_threads(threads)

    def step(q_t: FloatArray, k_t: FloatArray, v_t: FloatArray, cache: KVCache) -> FloatArray:
        keys, values = cache.append(k_t, v_t)  # [B, H_kv, T+1, D] each
        with torch.inference_mode():
            out = sdpa(
                torch.from_numpy(q_t),
                torch.from_numpy(keys),
                torch.from_numpy(values),
                enable_gqa=keys.shape[1] != q_t.shape[1],
            )  # [B, H, 1, D]
        result: FloatArray = out.numpy()
        return result

    return step
