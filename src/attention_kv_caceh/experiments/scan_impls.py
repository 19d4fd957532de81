"""The implementations the batch-size scan can time, and the oracle each one passes before timing.

Three decode steps do the same work on the same arrays (`experiments.fused` says how): "numpy"
(`attention.multihead_decode_step`, the lab's path, which also returns the weights), "fused" (the
Numba kernel through `fused.FusedDecodeStep`, one thread, no weights) and "torch-sdpa" (torch's
`scaled_dot_product_attention` with one intra-op thread; only where torch can be imported, as it is not
a dependency). `--impl all` times every one that is available at every batch size.

Oracle, before anything of an implementation is timed at a batch size:
- numpy: output and weights against the float64 reference run one sequence at a time
  (`oracle.check_decode_batch`);
- the others (no weights): the output against that float64 reference, and against
  `multihead_decode_step`'s output on the same inputs, both within `oracle.tolerance_for(dtype, D + T)`.
A mismatch raises OracleMismatch naming the implementation.

Kernel imports (Numba, torch) happen only when a step of that implementation is made, so a NumPy-only
scan never loads them. Shape legend as in attention.py: B batch, H query heads, H_kv KV heads,
T cached positions (after the step's append), D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.attention import multihead_decode_step
from attention_kv_caceh.cache import DynamicKVCache, KVCache, PreallocatedKVCache
from attention_kv_caceh.oracle import (
    OracleMismatch,
    check_close,
    check_decode_batch,
    reference_attention,
    tolerance_for,
)

__all__ = [
    "IMPLS",
    "IMPL_CHOICES",
    "DecodeStep",
    "check_step",
    "make_step",
    "resolve_impls",
]

FloatArray = npt.NDArray[np.floating[Any]]

# Every implementation, in the order they are timed at each B (so drift hits all of them alike).
IMPLS: tuple[str, ...] = ("numpy", "fused", "torch-sdpa")
# What --impl accepts: one implementation, or "all" (numpy, fused, and torch-sdpa where importable).
IMPL_CHOICES: tuple[str, ...] = ("numpy", "fused", "all")


def resolve_impls(choice: str, *, torch_available: bool | None = None) -> tuple[str, ...]:
    """The implementations an --impl value stands for, in timing order.

    "all" is numpy and fused, plus torch-sdpa when torch can be imported (`torch_available`, by default
    `fused.torch_sdpa_available()`). Raises ValueError for any other value than IMPL_CHOICES.
    """
    if choice not in IMPL_CHOICES:
        raise ValueError(f"impl must be one of {IMPL_CHOICES}, got {choice!r}")
    if choice != "all":
        return (choice,)
    if torch_available is None:
        from attention_kv_caceh.experiments.fused import torch_sdpa_available

        torch_available = torch_sdpa_available()
    return IMPLS if torch_available else IMPLS[:2]


@dataclass(frozen=True)
class DecodeStep:
    """One implementation's decode step for one batch size.

    `fn(q_t, k_t, v_t, cache)` is what is timed: it appends k_t, v_t `[B, H_kv, 1, D]` to the cache
    and attends q_t `[B, H, 1, D]` over the T cached positions; it returns the output `[B, H, 1, D]`,
    or (output, weights `[B, H, 1, T]`) for numpy. `prepare`, where not None, compiles what `fn` runs
    for these arrays (it leaves the cache as it found it) and returns the seconds it took.
    """

    impl: str
    fn: Callable[[FloatArray, FloatArray, FloatArray, KVCache], object]
    prepare: Callable[[FloatArray, FloatArray, FloatArray, KVCache], float] | None = None


def make_step(impl: str, q_t: FloatArray) -> DecodeStep:
    """The DecodeStep of `impl` (one of IMPLS) for queries shaped like q_t `[B, H, 1, D]`.

    "fused" allocates its output buffer for q_t's shape and dtype (float32 or float64). Raises
    ValueError for an unknown impl, ImportError for torch-sdpa without torch.
    """
    if impl == "numpy":
        return DecodeStep(impl, multihead_decode_step)
    if impl == "fused":
        from attention_kv_caceh.experiments.fused import FusedDecodeStep

        fused = FusedDecodeStep(q_t, threads=1)
        return DecodeStep(impl, fused, fused.prepare)
    if impl == "torch-sdpa":
        from attention_kv_caceh.experiments.fused import torch_sdpa_step

        return DecodeStep(impl, torch_sdpa_step(threads=1))
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _output(result: object) -> FloatArray:
    """The output of a step's return value: the array itself, or the first of (output, weights)."""
    out: Any = cast("tuple[Any, ...]", result)[0] if isinstance(result, tuple) else result
    return np.asarray(out)


def check_step(
    step: DecodeStep,
    q_t: FloatArray,
    k_t: FloatArray,
    v_t: FloatArray,
    cache: DynamicKVCache | PreallocatedKVCache,
    reference_cache: Callable[[], KVCache],
) -> float:
    """Run the step once on `cache` and check it (module docstring); returns its max |error| vs float64.

    `reference_cache()` returns a cache holding the same positions as `cache`; it is called only for a
    step without weights, to run `multihead_decode_step` beside it (so NumPy's check allocates none). Both caches hold T + 1 positions after
    the call. Raises OracleMismatch naming `step.impl` on a wrong shape, dtype, length or value.
    """
    length = cache.length
    result = step.fn(q_t, k_t, v_t, cache)
    if cache.length != length + 1:
        raise OracleMismatch(
            f"{step.impl}: cache length {cache.length} after one step, expected {length + 1}"
        )
    keys, values = cache.keys, cache.values  # [B, H_kv, T, D]
    output = _output(result)  # [B, H, 1, D]
    try:
        if isinstance(result, tuple):
            weights: FloatArray = np.asarray(cast("tuple[Any, ...]", result)[1])  # [B, H, 1, T]
            max_err = check_decode_batch(q_t, keys, values, output, weights)
        else:
            max_err = _check_output(q_t, keys, values, output, reference_cache(), k_t, v_t)
    except OracleMismatch as exc:
        raise OracleMismatch(f"{step.impl}: {exc}") from None
    if output.dtype != q_t.dtype:
        raise OracleMismatch(f"{step.impl}: output dtype {output.dtype} != input dtype {q_t.dtype}")
    return max_err


def _check_output(
    q_t: FloatArray,
    keys: FloatArray,
    values: FloatArray,
    output: FloatArray,
    reference_cache: KVCache,
    k_t: FloatArray,
    v_t: FloatArray,
) -> float:
    """A step without weights: output vs the float64 reference per sequence and vs the NumPy step."""
    b, h, _, d = q_t.shape
    t = keys.shape[2]
    if output.shape != (b, h, 1, d):
        raise OracleMismatch(f"output shape {output.shape}, want {(b, h, 1, d)}")
    rtol, atol = tolerance_for(output.dtype, d + t)
    numpy_out, _ = multihead_decode_step(q_t, k_t, v_t, reference_cache)  # [B, H, 1, D]
    check_close(output, numpy_out, rtol=rtol, atol=atol, what="output vs multihead_decode_step")
    max_err = 0.0
    for i in range(b):
        ref_out, _ = reference_attention(q_t[i : i + 1], keys[i : i + 1], values[i : i + 1])
        check_close(output[i : i + 1], ref_out, rtol=rtol, atol=atol, what=f"output of sequence {i}")
        max_err = max(max_err, float(np.max(np.abs(output[i : i + 1].astype(np.float64) - ref_out))))
    return max_err
