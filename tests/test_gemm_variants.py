"""Which kernel variant each CPU Numba compiles for gets, and the AVX2 variants (linear layers and paged decode
attention) built for an AVX2 CPU.

Numba compiles for one CPU per process (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, read at import), so each
CPU runs in a child process: AMD Zen 3 (`znver3`: AVX2 and FMA, no AVX-512) on any x86-64 machine
with AVX2, and LLVM's generic x86-64 (no variant: NumPy). The NEON variant is built only on an
AArch64 machine, where the whole suite runs it as the host's variant.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import unittest

from attention_kv_caceh.kernels.isa import _classify, compiled_variant  # pyright: ignore[reportPrivateUsage]

HOST = compiled_variant()
X86_WITH_AVX2 = platform.machine().lower() in ("x86_64", "amd64") and HOST is not None

# Runs in the child: the variant found, the kernels against float64, and whether the AVX2 tile's code
# touches a 512-bit register (a kernel compiled here without Numba's cache, so its assembly is kept).
_AVX2_CHILD = r"""
import json
import numba
import numpy as np
from attention_kv_caceh.kernels import _gemm_jit, block_formats, block_gemm, gemm
from attention_kv_caceh.kernels.isa import compiled_variant
from tests.test_block_gemm import random_blocks

found = compiled_variant()
rng = np.random.default_rng(0)
worst = {}
for m in (1, 3, 8, 13):
    x = rng.standard_normal((m, 96)).astype(np.float32)
    w = rng.standard_normal((37, 96)).astype(np.float32)
    for dtype in ("float32", "bfloat16"):
        packed = gemm.pack_weight(w, dtype)
        want = x.astype(np.float64) @ gemm.unpack_weight(packed).astype(np.float64).T
        err = float(np.abs(gemm.packed_linear(x, packed) - want).max() / np.abs(want).max())
        worst[packed.path] = max(worst.get(packed.path, 0.0), err)
    for fmt in block_formats.BLOCK_FORMATS:  # random blocks with finite scales, every bit pattern
        blocks = random_blocks(rng, fmt, 37, 2)
        weight = block_gemm.block_weight(blocks, fmt)
        decoded = block_formats.dequantize_blocks(blocks, fmt)  # [37, K]
        xk = rng.standard_normal((m, weight.in_features)).astype(np.float32)
        want = xk.astype(np.float64) @ decoded.T
        terms = np.abs(xk.astype(np.float64)) @ np.abs(decoded).T
        err = float((np.abs(block_gemm.block_linear(xk, weight) - want) / terms).max())
        worst[weight.path] = max(worst.get(weight.path, 0.0), err)

from attention_kv_caceh.model_executor.paged_attention import pack_kv_blocks
from attention_kv_caceh.kernels.decode_attention import paged_decode_attention
from attention_kv_caceh.oracle import reference_paged_decode_attention
blocks = [rng.standard_normal((6, 16, 2, 64)).astype(np.float32) for _ in range(2)]  # [NB, BS, H_kv, D]
k_cache, v_cache = pack_kv_blocks(*blocks)
tables = np.array([[4, 1, 3], [0, 5, -1]], np.int32)
lens = np.array([40, 17], np.int32)
q = rng.standard_normal((2, 6, 64)).astype(np.float32)
want = reference_paged_decode_attention(q.astype(np.float64), k_cache.astype(np.float64), v_cache.astype(np.float64), tables, lens)
worst["paged attention"] = float(np.abs(paged_decode_attention(q, k_cache, v_cache, tables, lens) - want).max())

@numba.njit(cache=False)
def avx2_tile(x, panels, y):
    _gemm_jit._matmul_lanes(x, _gemm_jit._lane_groups(x, 8, panels.shape[1]), panels, y, 1)

packed = gemm.pack_weight(rng.standard_normal((24, 16)).astype(np.float32))
x = rng.standard_normal((9, 16)).astype(np.float32)
avx2_tile(x, packed.panels, np.empty((9, packed.padded_out_features), np.float32))
asm = next(iter(avx2_tile.inspect_asm().values()))
print(json.dumps({"isa": found and found.isa, "worst": worst, "zmm": "zmm" in asm, "ymm": "ymm" in asm}))
"""


def _child(code: str, cpu: str) -> dict[str, object]:
    env = os.environ | {"NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": ""}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise AssertionError(f"child for {cpu} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class CompileTargetTest(unittest.TestCase):
    def test_the_assembly_of_a_wide_fma_names_the_variant(self) -> None:
        self.assertEqual(_classify("vfmadd213ps %zmm0, %zmm1, %zmm2", "x86_64"), "avx512")
        self.assertEqual(_classify("vfmadd213ps %ymm0, %ymm1, %ymm2", "x86_64"), "avx2")
        self.assertIsNone(_classify("mulps %xmm0, %xmm1\naddps %xmm1, %xmm2", "x86_64"))
        self.assertEqual(_classify("fmla v0.4s, v1.4s, v2.4s", "aarch64"), "neon")

    @unittest.skipUnless(X86_WITH_AVX2, "needs an x86-64 CPU with AVX2")
    def test_generic_x86_64_gets_no_variant_and_the_engine_keeps_numpy(self) -> None:
        code = (
            "import json; from attention_kv_caceh.kernels.isa import compiled_variant; "
            "from attention_kv_caceh.kernels.dispatch import resolve_gemm_path; "
            "print(json.dumps([compiled_variant() is None, resolve_gemm_path('auto', 'float32')[0]]))"
        )
        self.assertEqual(_child(code, "generic"), [True, "numpy"])

    @unittest.skipUnless(X86_WITH_AVX2, "needs an x86-64 CPU with AVX2")
    def test_an_avx2_cpu_gets_the_avx2_kernels_and_they_equal_float64(self) -> None:
        found = _child(_AVX2_CHILD, "znver3")
        self.assertEqual(found["isa"], "avx2")
        worst = found["worst"]
        assert isinstance(worst, dict)
        from attention_kv_caceh.kernels.block_formats import BLOCK_FORMATS

        blocks = [f"avx2 {fmt}" for fmt in BLOCK_FORMATS]
        self.assertEqual(
            sorted(worst), sorted(["avx2 bfloat16 (widened)", "avx2 float32", *blocks, "paged attention"])
        )
        for path, err in worst.items():
            self.assertLess(err, 1e-5, path)
        self.assertEqual((found["zmm"], found["ymm"]), (False, True))  # AVX2 code: 256-bit, never 512-bit


if __name__ == "__main__":
    unittest.main()
