"""KV caches: a Dynamic cache that grows by `np.concatenate`, and a Preallocated one written in place.

Layout of both: keys and values `[B, H_kv, T, D]` (batch, KV heads, positions, head dim), the layout of
gpt-fast's `KVCache` and of Hugging Face's cache classes.

- DynamicKVCache: every append allocates a `[B, H_kv, T+1, D]` array and copies the T old positions
  into it (`np.concatenate`), so a decode step costs O(T) bytes of copy on top of the attention, and
  every returned array is new memory.
- PreallocatedKVCache: allocates `[B, H_kv, T_max, D]` once; an append writes one slice at the current
  length and returns *views* of the valid prefix `[:, :, :T]`. No allocation grows with T.

The length is an explicit counter, never inferred from the contents: an all-zero key is a valid key.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

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
        """Append `[B, H_kv, S, D]` keys and values; return all keys and values `[B, H_kv, T, D]`."""
        ...

    def truncate(self, length: int) -> None:
        """Forget every position at and after `length` (0 <= length <= T)."""
        ...


class _CacheBase:
    """Shape checks shared by both caches."""

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, dtype: npt.DTypeLike) -> None:
        for name, value in (
            ("batch_size", batch_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.dtype: np.dtype[np.floating[Any]] = cast("np.dtype[np.floating[Any]]", np.dtype(dtype))
        if not np.issubdtype(self.dtype, np.floating):
            raise ValueError(f"cache dtype must be floating, got {self.dtype}")
        self.batch_size, self.num_kv_heads, self.head_dim = (
            int(batch_size),
            int(num_kv_heads),
            int(head_dim),
        )
        self._length = 0

    @property
    def length(self) -> int:
        """Positions currently cached (T): an explicit counter, never read from the data."""
        return self._length

    def _check_new(self, k_t: FloatArray, v_t: FloatArray) -> int:
        """Validate `[B, H_kv, S, D]` new keys/values; return S."""
        want = (self.batch_size, self.num_kv_heads)
        for name, x in (("k_t", k_t), ("v_t", v_t)):
            if x.dtype != self.dtype:
                raise ValueError(f"{name} dtype {x.dtype} does not match the cache dtype {self.dtype}")
            if x.ndim != 4 or x.shape[:2] != want or x.shape[3] != self.head_dim:
                raise ValueError(
                    f"{name} must be [B={self.batch_size}, H_kv={self.num_kv_heads}, S, "
                    f"D={self.head_dim}], got shape {x.shape}"
                )
        if k_t.shape != v_t.shape:
            raise ValueError(f"k_t {k_t.shape} and v_t {v_t.shape} must have the same shape")
        return int(k_t.shape[2])

    def _check_truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"truncate length must be in [0, {self._length}], got {length}")


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

        Raises ValueError for a shape or dtype that does not match the cache (the cache is unchanged).
        """
        s = self._check_new(k_t, v_t)
        self._k = np.concatenate([self._k, k_t], axis=2)  # [B, H_kv, T+S, D], new memory
        self._v = np.concatenate([self._v, v_t], axis=2)  # [B, H_kv, T+S, D]
        self._length += s
        return self._k, self._v

    def truncate(self, length: int) -> None:
        """Keep positions [0, length): a view of the current arrays, the next append copies it."""
        self._check_truncate(length)
        self._k = self._k[:, :, :length]  # [B, H_kv, length, D]
        self._v = self._v[:, :, :length]
        self._length = length


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
        if int(max_seq_len) != max_seq_len or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        self.max_seq_len = int(max_seq_len)
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

        Raises CacheCapacityError (a ValueError) when T + S > max_seq_len, and ValueError for a shape or
        dtype mismatch; in both cases the cache is unchanged.
        """
        s = self._check_new(k_t, v_t)
        start, end = self._length, self._length + s
        if end > self.max_seq_len:
            raise CacheCapacityError(
                f"cannot append {s} position(s) to a cache holding {start} of capacity "
                f"max_seq_len={self.max_seq_len}"
            )
        self.k_buffer[:, :, start:end] = k_t  # in place, no allocation
        self.v_buffer[:, :, start:end] = v_t
        self._length = end
        return self.k_buffer[:, :, :end], self.v_buffer[:, :, :end]  # views [B, H_kv, T+S, D]

    def truncate(self, length: int) -> None:
        """Keep positions [0, length): only the counter moves, no data is touched."""
        self._check_truncate(length)
        self._length = length


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
