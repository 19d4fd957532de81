"""experiments/fused.py: the fused and torch decode steps equal the NumPy step on the scan's caches."""

from __future__ import annotations

import unittest

import numpy as np

from attention_kv_caceh.attention import multihead_decode_step
from attention_kv_caceh.cache import make_cache
from attention_kv_caceh.experiments.fused import FusedDecodeStep, torch_sdpa_available, torch_sdpa_step
from attention_kv_caceh.oracle import tolerance_for

# (cache kind, positions of capacity beyond T + 1): 0 is the scan's full buffer (C-contiguous views),
# 5 leaves the views strided.
CACHES = (("dynamic", 0), ("preallocated", 0), ("preallocated", 5))


def scan_like(kind: str, spare: int, dtype: type, h: int = 4, h_kv: int = 2, t: int = 40, d: int = 16):
    """A cache holding t positions and one step's q_t, k_t, v_t, built as experiments/scan.py does."""
    rng = np.random.default_rng(11)
    b = 3
    cache = make_cache(kind, b, h_kv, d, max_seq_len=t + 1 + spare, dtype=dtype)
    cache.append(*(rng.standard_normal((b, h_kv, t, d)).astype(dtype) for _ in range(2)))
    q_t = rng.standard_normal((b, h, 1, d)).astype(dtype)  # [B, H, 1, D]
    k_t, v_t = (rng.standard_normal((b, h_kv, 1, d)).astype(dtype) for _ in range(2))  # [B, H_kv, 1, D]
    return cache, q_t, k_t, v_t


class FusedDecodeStepTest(unittest.TestCase):
    def test_equals_numpy_step_on_every_cache_layout(self) -> None:
        for dtype in (np.float32, np.float64):
            for kind, spare in CACHES:
                with self.subTest(dtype=dtype, kind=kind, spare=spare):
                    cache, q_t, k_t, v_t = scan_like(kind, spare, dtype)
                    expected, _ = multihead_decode_step(q_t, k_t, v_t, cache)  # [B, H, 1, D]
                    cache.truncate(40)
                    step = FusedDecodeStep(q_t)
                    self.assertGreater(step.prepare(q_t, k_t, v_t, cache), 0.0)
                    self.assertEqual(cache.length, 40)  # prepare leaves the cache as it found it
                    out = step(q_t, k_t, v_t, cache)
                    self.assertEqual(cache.length, 41)
                    rtol, atol = tolerance_for(dtype, 16 + 41)
                    np.testing.assert_allclose(out, expected, rtol=rtol, atol=atol)
                    cache.truncate(40)
                    self.assertIs(step(q_t, k_t, v_t, cache), out)  # one buffer, no allocation per step

    def test_rejects_a_query_of_the_wrong_rank_or_dtype(self) -> None:
        with self.assertRaisesRegex(ValueError, r"\[B, H, 1, D\]"):
            FusedDecodeStep(np.zeros((2, 4, 16), np.float32))
        with self.assertRaisesRegex(ValueError, "float32 or float64"):
            FusedDecodeStep(np.zeros((2, 4, 1, 16), np.float16))


class TorchSdpaStepTest(unittest.TestCase):
    @unittest.skipUnless(torch_sdpa_available(), "torch is not installed (optional)")
    def test_equals_numpy_step_on_every_cache_layout(self) -> None:
        step = torch_sdpa_step(threads=1)
        for kind, spare in CACHES:
            with self.subTest(kind=kind, spare=spare):
                cache, q_t, k_t, v_t = scan_like(kind, spare, np.float32)
                expected, _ = multihead_decode_step(q_t, k_t, v_t, cache)
                cache.truncate(40)
                out = step(q_t, k_t, v_t, cache)
                rtol, atol = tolerance_for(np.float32, 16 + 41)
                np.testing.assert_allclose(out, expected, rtol=rtol, atol=atol)

    @unittest.skipIf(torch_sdpa_available(), "torch is installed")
    def test_without_torch_the_step_raises_import_error(self) -> None:
        with self.assertRaises(ImportError):
            torch_sdpa_step()


if __name__ == "__main__":
    unittest.main()
