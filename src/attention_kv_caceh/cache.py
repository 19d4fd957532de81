"""KV caches: a Dynamic cache that grows by `np.concatenate`, and a Preallocated one written in place.

Layout of both: keys and values `[B, H_kv, T, D]` (batch, KV heads, positions, head dim), the layout of
gpt-fast's `KVCache` and of Hugging Face's cache classes.

- DynamicKVCache: every append allocates a `[B, H_kv, T+1, D]` array and copies the T old positions
  into it (`np.concatenate`), so a decode step costs O(T) bytes of copy on top of the attention, and
  every returned array is new memory.
- PreallocatedKVCache: allocates `[B, H_kv, T_max, D]` once; an append writes one slice at the current
  length and returns *views* of the valid prefix `[:, :, :T]`. No allocation grows with T.

The length is an explicit counter, never inferred from the contents: an all-zero key is a valid key.

Sizes (batch_size, num_kv_heads, head_dim, max_seq_len, a truncate length) must be integers: Python or
NumPy ints, anything `operator.index` accepts, but not bool; 1.5, inf or None raise ValueError. Every
method validates all of its input before it changes anything, so a call that raises leaves the cache
as it was.
"""

from __future__ import annotations

import operator
from typing import Any, Protocol, SupportsIndex, cast

import numpy as np
import numpy.typing as npt

__all__ = ["CacheCapacityError", "DynamicKVCache", "KVCache", "PreallocatedKVCache", "make_cache"]

FloatArray = npt.NDArray[np.floating[Any]]


class CacheCapacityError(ValueError):
    """Raised when an append would go past a Preallocated cache's capacity (T_max)."""


class KVCache(Protocol):
    """What a decode step needs from a KV cache (both caches below implement it)."""

    @property
    def length(self) -> int:
        """Positions currently cached (T)."""
        ...

    @property
    def capacity(self) -> int | None:
        """Most positions the cache can hold; None when it grows without bound."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of memory held for keys and values (allocated, not only the valid prefix)."""
        ...

    def append(self, k_t: FloatArray, v_t: FloatArray) -> tuple[FloatArray, FloatArray]:
        """Append `[B, H_kv, S, D]` keys and values; return all keys and values `[B, H_kv, T, D]`.

        Must check everything (dtype, shape, capacity) before it writes: a call that raises ValueError
        leaves the cache unchanged (`multihead_decode_step` relies on it).
        """
        ...

    def truncate(self, length: int) -> None:
        """Forget every position at and after `length` (an integer, 0 <= length <= T)."""
        ...


def _as_size(name: str, value: object, minimum: int) -> int:
    """`value` as an int >= `minimum`; ValueError naming `name` for a non-integer (1.5, inf, None, True)."""
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    if isinstance(value, bool | np.bool_):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    try:
        size = operator.index(cast("SupportsIndex", value))  # TypeError when it has no __index__
    except TypeError:
        raise ValueError(f"{name} must be {what}, got {value!r}") from None
    if size < minimum:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return size


class _CacheBase:
    """Shape checks shared by both caches."""

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, dtype: npt.DTypeLike) -> None:
        self.batch_size = _as_size("batch_size", batch_size, 1)
        self.num_kv_heads = _as_size("num_kv_heads", num_kv_heads, 1)
        self.head_dim = _as_size("head_dim", head_dim, 1)
        try:
            self.dtype: np.dtype[np.floating[Any]] = cast("np.dtype[np.floating[Any]]", np.dtype(dtype))
        except TypeError:
            raise ValueError(f"cache dtype must be a floating dtype, got {dtype!r}") from None
        if not np.issubdtype(self.dtype, np.floating):
            raise ValueError(f"cache dtype must be floating, got {self.dtype}")
        self._length = 0

    @property
    def length(self) -> int:
        """Positions currently cached (T): an explicit counter, never read from the data."""
        return self._length

    def _check_new(self, k_t: object, v_t: object) -> tuple[FloatArray, FloatArray]:
        """Validate `[B, H_kv, S, D]` new keys/values (array-likes converted by `np.asarray`); return
        them as arrays."""
        want = (self.batch_size, self.num_kv_heads)
        arrays: list[FloatArray] = []
        for name, value in (("k_t", k_t), ("v_t", v_t)):
            try:
                x = np.asarray(value)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{name} cannot be converted to an array: {exc}") from None
            arrays.append(x)
            if x.dtype != self.dtype:
                raise ValueError(f"{name} dtype {x.dtype} does not match the cache dtype {self.dtype}")
            if x.ndim != 4 or x.shape[:2] != want or x.shape[3] != self.head_dim:
                raise ValueError(
                    f"{name} must be [B={self.batch_size}, H_kv={self.num_kv_heads}, S, "
                    f"D={self.head_dim}], got shape {x.shape}"
                )
        k, v = arrays
        if k.shape != v.shape:
            raise ValueError(f"k_t {k.shape} and v_t {v.shape} must have the same shape")
        return k, v

    def _check_truncate(self, length: object) -> int:
        size = _as_size("truncate length", length, 0)
        if size > self._length:
            raise ValueError(f"truncate length must be in [0, {self._length}], got {length!r}")
        return size


class DynamicKVCache(_CacheBase):
    """KV cache that grows by `np.concatenate` on every append (a full copy of the T old positions).

    Arrays `[B, H_kv, T, D]`; starts empty (T = 0). Every append returns newly allocated arrays that share
    no memory with the previous step's.
    """

    def __init__(
        self, batch_size: int, num_kv_heads: int, head_dim: int, dtype: npt.DTypeLike = np.float32
    ) -> None:
        super().__init__(batch_size, num_kv_heads, head_dim, dtype)
        empty_shape = (self.batch_size, self.num_kv_heads, 0, self.head_dim)  # [B, H_kv, 0, D]
        self._k: FloatArray = np.empty(empty_shape, dtype=self.dtype)
        self._v: FloatArray = np.empty(empty_shape, dtype=self.dtype)

    @property
    def capacity(self) -> int | None:
        """None: a Dynamic cache grows without bound (until memory runs out)."""
        return None

    @property
    def nbytes(self) -> int:
        """Bytes of K and V held now: 2 * B * H_kv * T * D * itemsize (grows every step)."""
        return int(self._k.nbytes + self._v.nbytes)

    @property
    def keys(self) -> FloatArray:
        """Cached keys `[B, H_kv, T, D]` (the array the last append returned)."""
        return self._k

    @property
    def values(self) -> FloatArray:
        """Cached values `[B, H_kv, T, D]`."""
        return self._v

    def append(self, k_t: FloatArray, v_t: FloatArray) -> tuple[FloatArray, FloatArray]:
        """Concatenate `[B, H_kv, S, D]` onto the cache; returns new `[B, H_kv, T+S, D]` arrays.

        Array-likes are converted with `np.asarray` and must then match the cache dtype. Raises
        ValueError for a shape or dtype that does not match the cache (the cache is unchanged).
        """
        k, v = self._check_new(k_t, v_t)
        new_k = np.concatenate([self._k, k], axis=2)  # [B, H_kv, T+S, D], new memory
        new_v = np.concatenate([self._v, v], axis=2)  # [B, H_kv, T+S, D]
        self._k, self._v = new_k, new_v  # both or neither (a MemoryError above changes nothing)
        self._length += int(k.shape[2])
        return self._k, self._v

    def truncate(self, length: int) -> None:
        """Keep positions [0, length): a view of the current arrays, the next append copies it.

        Raises ValueError unless `length` is an integer in [0, T] (the cache is then unchanged).
        """
        size = self._check_truncate(length)
        self._k = self._k[:, :, :size]  # [B, H_kv, length, D]
        self._v = self._v[:, :, :size]
        self._length = size


class PreallocatedKVCache(_CacheBase):
    """KV cache allocated once as `[B, H_kv, T_max, D]`; appends write a slice in place.

    `append` returns views `[B, H_kv, T, D]` of the valid prefix of the one buffer
    (`np.shares_memory(keys, cache.k_buffer)` is True). Unused positions are zero-filled at allocation
    but never read: the length counter says what is valid.
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        dtype: npt.DTypeLike = np.float32,
    ) -> None:
        super().__init__(batch_size, num_kv_heads, head_dim, dtype)
        self.max_seq_len = _as_size("max_seq_len", max_seq_len, 1)
        shape = (
            self.batch_size,
            self.num_kv_heads,
            self.max_seq_len,
            self.head_dim,
        )  # [B, H_kv, T_max, D]
        self.k_buffer: FloatArray = np.zeros(shape, dtype=self.dtype)
        self.v_buffer: FloatArray = np.zeros(shape, dtype=self.dtype)

    @property
    def capacity(self) -> int | None:
        """T_max, the positions allocated up front."""
        return self.max_seq_len

    @property
    def nbytes(self) -> int:
        """Bytes allocated for K and V: 2 * B * H_kv * T_max * D * itemsize, whatever T is."""
        return int(self.k_buffer.nbytes + self.v_buffer.nbytes)

    @property
    def keys(self) -> FloatArray:
        """A view `[B, H_kv, T, D]` of the valid prefix of the key buffer."""
        return self.k_buffer[:, :, : self._length]  # [B, H_kv, T, D], a view

    @property
    def values(self) -> FloatArray:
        """A view `[B, H_kv, T, D]` of the valid prefix of the value buffer."""
        return self.v_buffer[:, :, : self._length]

    def append(self, k_t: FloatArray, v_t: FloatArray) -> tuple[FloatArray, FloatArray]:
        """Write `[B, H_kv, S, D]` at positions [T, T+S); return views `[B, H_kv, T+S, D]`.

        Array-likes are converted with `np.asarray` and must then match the cache dtype. Raises
        CacheCapacityError (a ValueError) when T + S > max_seq_len, and ValueError for a shape or dtype
        mismatch; in both cases the cache is unchanged.
        """
        k, v = self._check_new(k_t, v_t)
        s = int(k.shape[2])
        start, end = self._length, self._length + s
        if end > self.max_seq_len:
            raise CacheCapacityError(
                f"cannot append {s} position(s) to a cache holding {start} of capacity "
                f"max_seq_len={self.max_seq_len}"
            )
        self.k_buffer[:, :, start:end] = k  # in place, no allocation
        self.v_buffer[:, :, start:end] = v
        self._length = end
        return self.k_buffer[:, :, :end], self.v_buffer[:, :, :end]  # views [B, H_kv, T+S, D]

    def truncate(self, length: int) -> None:
        """Keep positions [0, length): only the counter moves, no data is touched.

        Raises ValueError unless `length` is an integer in [0, T] (the cache is then unchanged).
        """
        self._length = self._check_truncate(length)


def make_cache(
    kind: str,
    batch_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    max_seq_len: int | None = None,
    dtype: npt.DTypeLike = np.float32,
) -> DynamicKVCache | PreallocatedKVCache:
    """Build a cache by name: "dynamic" or "preallocated" (which needs `max_seq_len`).

    Raises ValueError for an unknown kind or a missing max_seq_len.
    """
    if kind == "dynamic":
        return DynamicKVCache(batch_size, num_kv_heads, head_dim, dtype)
    if kind == "preallocated":
        if max_seq_len is None:
            raise ValueError("a preallocated cache needs max_seq_len")
        return PreallocatedKVCache(batch_size, num_kv_heads, head_dim, max_seq_len, dtype)
    raise ValueError(f"unknown cache kind {kind!r}; expected 'dynamic' or 'preallocated'")
