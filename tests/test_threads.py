"""The engine core's threads: the CPU count it defaults to, the flag's checks, and results that do not depend on it.

The GEMMs split their output rows over Numba's threads; each output is one dot product summed by one
thread in one order, so every thread count must give bit-identical results: kernels on odd shapes
(N not a multiple of a chunk), and a tiny engine's greedy tokens and logits (packed float32 and a
block format). The oracle of the kernels' values stays the float64 product (`test_gemm`,
`test_block_gemm`); here one thread is the oracle of many.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import numpy as np

from attention_kv_caceh.cli.common import UsageError
from attention_kv_caceh.cli.engine_args import add_engine_arguments, engine_flags_given
from attention_kv_caceh.cpus import (
    CpuSet,
    cgroup_cpu_quota,
    check_threads,
    default_threads,
    numba_pool_size,
    parse_cfs_quota,
    parse_cpu_max,
    usable_cpus,
)
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.kernels import threads as pool
from attention_kv_caceh.kernels.block_formats import quantize_weight
from attention_kv_caceh.kernels.block_gemm import block_linear, block_weight
from attention_kv_caceh.kernels.gemm import pack_weight, packed_linear
from attention_kv_caceh.kernels.isa import compiled_variant
from attention_kv_caceh.model_executor.model import Model
from attention_kv_caceh.options import ConfigError
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint
from tests.test_cli_engine import quietly
from tests.test_engine_model import FakeRequest, FakeSchedulerOutput

PACKED = compiled_variant() is not None
COUNTS = [t for t in (1, 2, 3) if t <= min(usable_cpus().count, numba_pool_size())]


class CgroupQuotaTest(unittest.TestCase):
    def test_cpu_max_and_cfs_files_parse_to_cpus_worth(self) -> None:
        self.assertIsNone(parse_cpu_max("max 100000\n"))
        self.assertEqual(parse_cpu_max("150000 100000"), 1.5)
        self.assertEqual(parse_cpu_max("200000 100000\n"), 2.0)
        self.assertIsNone(parse_cfs_quota("-1\n", "100000\n"))
        self.assertEqual(parse_cfs_quota("50000", "100000"), 0.5)
        for bad in ("", "max", "1 2 3", "x 100000", "100 0", "-5 100"):
            with self.subTest(text=bad), self.assertRaises(ValueError):
                parse_cpu_max(bad)
        with self.assertRaisesRegex(ValueError, "-2"):
            parse_cfs_quota("-2", "100000")

    def test_the_quota_is_read_from_v2_then_v1_files_and_missing_files_mean_none(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            self.assertIsNone(cgroup_cpu_quota(root))  # no file at all
            (root / "cpu").mkdir()
            (root / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
            (root / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
            self.assertEqual(cgroup_cpu_quota(root), 2.5)  # v1
            (root / "cpu.max").write_text("max 100000\n")
            self.assertIsNone(cgroup_cpu_quota(root))  # v2 wins: no quota
            (root / "cpu.max").write_text("300000 100000\n")
            self.assertEqual(cgroup_cpu_quota(root), 3.0)
            (root / "cpu.max").unlink()
            (root / "cpu" / "cpu.cfs_period_us").unlink()
            self.assertIsNone(cgroup_cpu_quota(root))  # v1 quota without its period

    def test_the_count_is_the_cpu_set_bounded_by_the_ceiling_of_the_quota(self) -> None:
        eight = tuple(range(8))
        self.assertEqual(CpuSet(eight, None).count, 8)
        self.assertEqual(CpuSet(eight, 2.5).count, 3)
        self.assertEqual(CpuSet(eight, 0.2).count, 1)
        self.assertEqual(CpuSet((0, 1), 16.0).count, 2)
        self.assertEqual(CpuSet((0, 1, 2, 5), None).describe(), "CPUs 0-2,5 (4 usable)")

    def test_a_server_leaves_one_cpu_to_the_api_process_on_four_or_more(self) -> None:
        self.assertEqual(default_threads(True, CpuSet(tuple(range(4)), None)), 3)
        self.assertEqual(default_threads(False, CpuSet(tuple(range(4)), None)), 4)
        self.assertEqual(default_threads(True, CpuSet((0, 1, 2), None)), 3)
        self.assertEqual(default_threads(True, CpuSet(tuple(range(16)), 6.0)), 5)


class CheckThreadsTest(unittest.TestCase):
    def test_a_count_outside_the_usable_cpus_is_refused_naming_it(self) -> None:
        two = CpuSet((0, 1), None)
        self.assertEqual(check_threads(1, two), 1)
        for bad in (0, -1, True, 1.5, "2"):
            with self.subTest(value=bad), self.assertRaisesRegex(ValueError, repr(bad)):
                check_threads(bad, two)
        with self.assertRaisesRegex(ValueError, "^3 exceeds the CPUs 0-1"):
            check_threads(3, two)
        with self.assertRaises(ConfigError) as caught:
            EngineConfig(threads=usable_cpus().count + 1)
        self.assertEqual(caught.exception.field, "threads")
        self.assertIn(str(usable_cpus().count + 1), caught.exception.message)

    def test_the_default_follows_the_cpu_set_of_the_process(self) -> None:
        taskset = shutil.which("taskset")
        if taskset is None:
            self.skipTest("no taskset")
        code = (
            "from attention_kv_caceh.cpus import default_threads\n"
            "from attention_kv_caceh.engine.config import EngineConfig\n"
            "print(default_threads(), default_threads(serving=True), EngineConfig().resolved_threads())"
        )
        done = subprocess.run(
            [taskset, "-c", "0", sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env=os.environ | {"NUMBA_NUM_THREADS": "2"},
        )
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(done.stdout.split(), ["1", "1", "1"])


class FlagTest(unittest.TestCase):
    def test_the_harness_engine_backend_passes_threads_on_to_serve(self) -> None:
        parser = argparse.ArgumentParser()
        add_engine_arguments(parser, defaults=False)
        self.assertEqual(engine_flags_given(parser.parse_args(["--threads", "1"])), ["--threads", "1"])
        self.assertEqual(engine_flags_given(parser.parse_args([])), [])
        with self.assertRaisesRegex(UsageError, "--threads: .*0"):
            engine_flags_given(parser.parse_args(["--threads", "0"]))

    def test_a_bad_threads_flag_exits_2_naming_the_value(self) -> None:
        too_many = str(usable_cpus().count + 7)
        cases = [
            (["generate", "--model", "smollm2", "--prompt", "a", "--max-tokens", "2", "--threads", "0"], "0"),
            (["generate", "--model", "smollm2", "--prompt", "a", "--max-tokens", "2", "--threads", too_many], too_many),
            (["bench-engine", "--model", "smollm2", "--threads", "1", too_many], too_many),
            (["bench-engine", "--model", "smollm2", "--threads", "0"], "0"),
            (["serve", "--model", "smollm2", "--port", "0", "--threads", too_many], too_many),
        ]  # fmt: skip
        for argv, value in cases:
            with self.subTest(argv=argv):
                code, out, err = quietly(argv)
                self.assertEqual(code, 2, err)
                self.assertEqual(out, "")
                self.assertEqual(len(err.splitlines()), 1, err)
                self.assertIn("--threads", err)
                self.assertIn(value, err)


@unittest.skipUnless(PACKED and len(COUNTS) > 1, "needs a packed kernel variant and two threads")
class KernelsAcrossThreadsTest(unittest.TestCase):
    def test_packed_gemms_are_bit_identical_for_every_thread_count(self) -> None:
        rng = np.random.default_rng(1)
        for n, k, m in ((97, 64, 3), (33, 20, 1), (1000, 48, 9), (161, 7, 5)):
            w = rng.standard_normal((n, k)).astype(np.float32)
            x = rng.standard_normal((m, k)).astype(np.float32)
            for dtype in ("float32", "bfloat16"):
                packed = pack_weight(w, dtype)
                one = packed_linear(x, packed, 1)
                self.assertLess(float(np.abs(one - x.astype(np.float64) @ w.T.astype(np.float64)).max()), 0.5)
                for count in COUNTS[1:]:
                    pool.set_threads(count)
                    with self.subTest(n=n, k=k, m=m, dtype=dtype, threads=count):
                        np.testing.assert_array_equal(packed_linear(x, packed, count), one)

    def test_block_gemms_are_bit_identical_for_every_thread_count(self) -> None:
        rng = np.random.default_rng(2)
        for fmt, k in (("q8_0", 64), ("q4_1", 96), ("q5_0", 32), ("f16", 64)):
            for n, m in ((37, 2), (131, 5), (9, 8)):
                w = rng.standard_normal((n, k)).astype(np.float32)
                x = rng.standard_normal((m, k)).astype(np.float32)
                blocks = w.astype(np.float16).view(np.uint8) if fmt == "f16" else quantize_weight(w, fmt)
                weight = block_weight(blocks, fmt)
                one = block_linear(x, weight, 1)
                for count in COUNTS[1:]:
                    pool.set_threads(count)
                    with self.subTest(fmt=fmt, n=n, m=m, threads=count):
                        np.testing.assert_array_equal(block_linear(x, weight, count), one)

    def test_chunks_cover_the_rows_in_whole_groups(self) -> None:
        self.assertEqual(pool.chunk_rows(30, 2), 2)  # 30 / 16 rounded up
        self.assertEqual(pool.chunk_rows(1, 4), 1)
        self.assertEqual(pool.chunk_rows(100, 2, 8), 8)
        self.assertEqual(pool.chunk_rows(1000, 2, 8), 64)


def run_engine(model: Model, threads: int, steps: int = 4) -> tuple[list[list[int]], list[np.ndarray]]:
    """Two greedy requests (a prefill, then decode steps) on `threads`: their tokens and each step's logits."""
    runner = ModelRunner(model, EngineConfig(block_size=4, threads=threads), 8)
    reqs = [
        FakeRequest(r, list(range(1 + 7 * i, 6 + 7 * i)), 0, [2 * i, 2 * i + 1]) for i, r in enumerate("ab")
    ]
    logits_seen: list[np.ndarray] = []
    n = 5
    for _ in range(steps):
        logits = runner.execute_model(FakeSchedulerOutput(reqs, {r.request_id: n for r in reqs}))  # type: ignore[arg-type]
        logits_seen.append(np.array(logits))
        for row, req in enumerate(reqs):
            req.num_computed_tokens += n
            req.all_token_ids.append(int(np.argmax(logits[row])))
        n = 1
    return [r.all_token_ids for r in reqs], logits_seen


@unittest.skipUnless(PACKED and len(COUNTS) > 1, "needs a packed kernel variant and two threads")
class EngineAcrossThreadsTest(unittest.TestCase):
    def test_greedy_tokens_and_logits_are_bit_identical_for_every_thread_count(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_random_checkpoint(Path(tmp) / "m", "llama", "tiny", seed=7)
            for quantization in (None, "q8_0"):
                model = Model.load(folder, "float32", "packed", quantization)
                tokens, logits = run_engine(model, 1)
                self.assertEqual(model.threads, 1)
                for count in COUNTS[1:]:
                    with self.subTest(quantization=quantization, threads=count):
                        more_tokens, more_logits = run_engine(model, count)
                        self.assertEqual(model.threads, count)
                        self.assertEqual(more_tokens, tokens)
                        for a, b in zip(more_logits, logits, strict=True):
                            np.testing.assert_array_equal(a, b)


if __name__ == "__main__":
    unittest.main()
