"""timing.py: the one statistics function against hand-computed values; measure's contract."""

from __future__ import annotations

import unittest

from attention_kv_caceh.timing import Sample, capture_environment, measure, summarize_samples


class SummarizeSamplesTest(unittest.TestCase):
    def test_hand_computed_values(self) -> None:
        stats = summarize_samples([1000.0, 1000.0, 10000.0])  # E2ELs of 1 s, 1 s, 10 s in ms
        self.assertEqual(stats["count"], 3)
        self.assertAlmostEqual(stats["mean_ms"], 4000.0)
        self.assertAlmostEqual(stats["p50_ms"], 1000.0)
        self.assertAlmostEqual(stats["min_ms"], 1000.0)
        self.assertAlmostEqual(stats["max_ms"], 10000.0)
        # Population stdev: sqrt(((3000)^2 * 2 + 6000^2) / 3) = sqrt(18e6)
        self.assertAlmostEqual(stats["stdev_ms"], 18e6**0.5)
        # Linear interpolation: P95 of [1000, 1000, 10000] sits at rank 1.9 -> 1000 + 0.9 * 9000
        self.assertAlmostEqual(stats["p95_ms"], 9100.0)

    def test_percentiles_of_one_to_hundred(self) -> None:
        stats = summarize_samples([float(i) for i in range(1, 101)])
        self.assertAlmostEqual(stats["p50_ms"], 50.5)
        self.assertAlmostEqual(stats["p90_ms"], 90.1)
        self.assertAlmostEqual(stats["p99_ms"], 99.01)

    def test_bad_input(self) -> None:
        with self.assertRaisesRegex(ValueError, "non-empty"):
            summarize_samples([])
        with self.assertRaisesRegex(ValueError, "finite"):
            summarize_samples([1.0, float("nan")])


class MeasureTest(unittest.TestCase):
    def test_warmup_and_repeats_counts_and_setup_runs_outside(self) -> None:
        calls: list[str] = []
        samples = measure(
            lambda: calls.append("fn"), warmup=2, repeats=5, setup=lambda: calls.append("setup")
        )
        self.assertEqual(len(samples), 5)
        self.assertEqual(calls, ["setup", "fn"] * 7)
        self.assertTrue(all(s >= 0 for s in samples))

    def test_args_are_passed(self) -> None:
        seen: list[tuple[int, int]] = []
        measure(lambda a, b: seen.append((a, b)), 1, 2, warmup=0, repeats=1)
        self.assertEqual(seen, [(1, 2)])

    def test_bad_counts(self) -> None:
        with self.assertRaisesRegex(ValueError, "repeats must be >= 1, got 0"):
            measure(lambda: None, repeats=0)
        with self.assertRaisesRegex(ValueError, "warmup"):
            measure(lambda: None, warmup=-1)


class EnvironmentTest(unittest.TestCase):
    def test_records_versions_and_blas(self) -> None:
        env = capture_environment()
        for key in ("python", "numpy", "cpu_model", "blas", "thread_env", "start_time_utc", "git_commit"):
            self.assertIn(key, env)
        self.assertIsInstance(env["blas"], list)

    def test_sample_is_frozen(self) -> None:
        sample = Sample(batch_size=2, sequence_length=128, elapsed_ms=1.5)
        with self.assertRaises(AttributeError):
            sample.batch_size = 4  # type: ignore[misc]


if __name__ == "__main__":
    unittest.main()
