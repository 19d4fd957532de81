"""How the API process hands memory back to the OS after big requests (glibc's allocator; elsewhere no-ops).

A big prompt allocates far more than its body: tokenizing a 1 MB text builds the Rust tokenizer's Encoding
(ids, token strings, offsets: about 150 MB) in a worker thread, then the prompt's Python objects. Two
things of glibc's malloc keep such memory resident after the request has freed it:

- the dynamic mmap threshold. An allocation of 128 KiB or more starts out as its own mmap, returned to the
  OS when freed; but each such free raises the threshold to the freed size (up to 32 MiB), and the trim
  threshold to twice that. From then on buffers of a few MiB come from the malloc arena of the thread
  that allocated them, and a thread's arena is given back only from its top, when more than the trim
  threshold (by then up to 64 MiB) is free there; `malloc_trim(0)` releases free chunks inside an arena
  but not that top. So the worker threads' arenas kept what a burst of big prompts had used.
  `fix_mmap_threshold()` pins the threshold at 1 MiB (mallopt(M_MMAP_THRESHOLD), which also stops the
  dynamic adjustment of both thresholds: the trim threshold stays at glibc's 128 KiB), so a buffer of
  1 MiB or more is its own mmap again, and an arena's free top is trimmed once it passes 128 KiB.
  Prompts of ordinary size allocate nothing that large. Measured: docs/results.md.
- memory freed in chunks smaller than that: `release_freed_memory()` (malloc_trim(0)) returns the whole
  free pages of every arena; the server calls it after a body of 256 KiB or more.

Both are no-ops off glibc (musl and macOS have no mallopt/malloc_trim of this kind).

vLLM has no counterpart in its code: for its CPU backend its documentation recommends preloading TCMalloc
(`LD_PRELOAD`) in place of glibc's allocator. Left out: another allocator (TCMalloc, jemalloc), a cap on
the number of arenas (`M_ARENA_MAX`), and trimming in the engine-core process (only the API server's
middleware, where request bodies arrive, calls `release_freed_memory`).
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

__all__ = ["MMAP_THRESHOLD_BYTES", "fix_mmap_threshold", "release_freed_memory"]

MMAP_THRESHOLD_BYTES = 1024 * 1024  # allocations this large or larger are mmapped (glibc's default: 128 KiB)
_M_MMAP_THRESHOLD = -3  # <malloc.h>


def _libc_function(name: str, argtypes: list[Any]) -> Any:
    """glibc's function `name` (returning int) through ctypes, or None off Linux or without it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


_MALLOC_TRIM = _libc_function("malloc_trim", [ctypes.c_size_t])  # glibc only (musl has none)


def release_freed_memory() -> None:
    """Hand the free pages of every malloc arena back to the OS (glibc's `malloc_trim(0)`)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def fix_mmap_threshold(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve every allocation of `threshold_bytes` or more with its own mmap for the rest of the process
    (glibc's mallopt(M_MMAP_THRESHOLD); see the module docstring); True when glibc took it."""
    mallopt = _libc_function("mallopt", [ctypes.c_int, ctypes.c_int])
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes))
