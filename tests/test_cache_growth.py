"""Cache growth on a tiny shape: oracle first, every step kept, memory accounting, statistics, CLI."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import os
import resource
import signal
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, ClassVar
from unittest import mock

import numpy as np

from attention_kv_caceh import cli, recorder
from attention_kv_caceh.attention import multihead_decode_step
from attention_kv_caceh.cache import PreallocatedKVCache
from attention_kv_caceh.cli import cache as cache_cli
from attention_kv_caceh.experiments import cache_growth, cache_memory
from attention_kv_caceh.experiments.cache_growth import (
    CacheGrowthConfig,
    measure_cache_memory,
    run_cache_growth,
)
from attention_kv_caceh.experiments.cache_growth_stats import (
    CacheStepSample,
    fit_line,
    partial_passes,
    rolling_median,
    summarize_cache_growth,
)
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.presets import kv_cache_bytes
from tests import as_on_a_quiet_machine, ctrl_c_as_in_a_terminal

ctrl_c_as_in_a_terminal()  # the Ctrl-C tests also pass as a background job (tests/__init__.py)

TINY = CacheGrowthConfig(
    steps=24, batch_size=2, num_heads=4, num_kv_heads=2, head_dim=8, repeats=2, warmup=1, seed=7
)


def setUpModule() -> None:
    as_on_a_quiet_machine()  # the scan's load warning would add a stderr line


def synthetic(kind: str, intercept: float, slope: float, steps: int, repeats: int) -> list[CacheStepSample]:
    """Samples lying exactly on a line (every repeat identical)."""
    params = CacheGrowthConfig(steps=steps).params()
    return [
        CacheStepSample(
            cache=kind,
            step=t - 1,
            sequence_length=t,
            elapsed_ms=intercept + slope * t,
            repeat=r,
            **params,
        )
        for r in range(repeats)
        for t in range(1, steps + 1)
    ]


def help_text(command: str) -> str:
    """`attention-kv-caceh COMMAND --help` (the main command's parser), whitespace collapsed."""
    from attention_kv_caceh import benchmark

    out = io.StringIO()
    with redirect_stdout(out), contextlib.suppress(SystemExit):
        benchmark.main([command, "--help"])
    return " ".join(out.getvalue().split())


class ConfigTest(unittest.TestCase):
    def test_rejects_bad_values_naming_them(self) -> None:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"steps": 0}, "steps"),
            ({"batch_size": -1}, "batch_size"),
            ({"num_heads": 6, "num_kv_heads": 4}, "num_heads=6"),
            ({"warmup": -1}, "warmup"),
            ({"dtype": "int32"}, "int32"),
            ({"model": "gpt-5"}, "gpt-5"),
            ({"steps": 4, "oracle_steps": (5,)}, "oracle_steps"),
            ({"seed": -1}, "seed"),
        ]
        for kwargs, needle in cases:
            with self.subTest(kwargs=kwargs), self.assertRaisesRegex(ValueError, needle):
                CacheGrowthConfig(**kwargs)

    def test_checked_steps_default(self) -> None:
        self.assertEqual(CacheGrowthConfig(steps=10).checked_steps, (1, 2, 5, 10))
        self.assertEqual(CacheGrowthConfig(steps=1).checked_steps, (1,))


class RunTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.samples: list[CacheStepSample] = []
        cls.result = run_cache_growth(TINY, samples=cls.samples)

    def test_every_timed_step_is_kept(self) -> None:
        rows = self.result.samples
        self.assertIs(rows, self.samples)
        self.assertEqual(len(rows), 2 * TINY.repeats * TINY.steps)
        for kind in ("dynamic", "preallocated"):
            for r in range(TINY.repeats):
                with self.subTest(cache=kind, repeat=r):
                    mine = [s for s in rows if s.cache == kind and s.repeat == r]
                    self.assertEqual([s.step for s in mine], list(range(TINY.steps)))
                    self.assertEqual([s.sequence_length for s in mine], list(range(1, TINY.steps + 1)))
                    self.assertTrue(all(s.elapsed_ms > 0 for s in mine))
                    self.assertTrue(all(s.warmup == TINY.warmup and s.head_dim == 8 for s in mine))

    def test_oracle_steps_were_checked(self) -> None:
        self.assertEqual(self.result.checked_steps, (1, 2, 12, 24))

    def test_memory_rows_and_theoretical_size(self) -> None:
        itemsize = 4
        for kind in ("dynamic", "preallocated"):
            rows = [m for m in self.result.memory if m.cache == kind]
            self.assertEqual([m.sequence_length for m in rows], list(range(1, TINY.steps + 1)))
            for m in rows:
                expected = 2 * 2 * m.sequence_length * 8 * itemsize * 2  # B * H_kv * T * D * 4 B * (K, V)
                self.assertEqual(m.theoretical_bytes, expected)
                self.assertEqual(m.theoretical_bytes, kv_cache_bytes(2, 2, m.sequence_length, 8, itemsize))
                if kind == "dynamic":
                    self.assertEqual(m.cache_nbytes, m.theoretical_bytes)
                    self.assertEqual(m.new_buffer_bytes, m.theoretical_bytes)
                else:
                    self.assertEqual(m.cache_nbytes, kv_cache_bytes(2, 2, TINY.steps, 8, itemsize))
                    self.assertEqual(m.new_buffer_bytes, 0)

    def test_summary_is_computed(self) -> None:
        summary = self.result.summary
        assert summary is not None
        self.assertEqual(set(summary.fits), {"dynamic", "preallocated"})
        self.assertEqual(summary.totals["dynamic"]["count"], TINY.repeats)
        self.assertAlmostEqual(
            summary.total_ratio,
            summary.totals["dynamic"]["p50_ms"] / summary.totals["preallocated"]["p50_ms"],
        )


class MemoryAccountingTest(unittest.TestCase):
    """Preallocated allocations per step do not grow with T; the Dynamic cache's do, like its size."""

    def test_growth(self) -> None:
        config = CacheGrowthConfig(steps=96, batch_size=2, num_heads=2, num_kv_heads=2, head_dim=32)
        rng = np.random.default_rng(0)
        q = rng.standard_normal((96, 2, 2, 1, 32), dtype=np.float32)
        k = rng.standard_normal((96, 2, 2, 1, 32), dtype=np.float32)
        v = rng.standard_normal((96, 2, 2, 1, 32), dtype=np.float32)
        pre = measure_cache_memory("preallocated", config, q, k, v)
        dyn = measure_cache_memory("dynamic", config, q, k, v)
        pre_peaks = [m.append_peak_bytes for m in pre[1:]]
        self.assertLess(max(pre_peaks) - min(pre_peaks), 256)  # a few view objects, whatever T is
        self.assertLess(max(pre_peaks), 2048)
        pre_slope = fit_line([m.sequence_length for m in pre], [m.append_peak_bytes for m in pre])[0]
        self.assertLess(abs(pre_slope), 1.0)  # bytes per position
        # Dynamic: at its peak the append holds one new K (or V) array of T positions: >= half the size.
        for m in dyn:
            self.assertGreaterEqual(m.append_peak_bytes, m.theoretical_bytes // 2)
        dyn_slope = fit_line([m.sequence_length for m in dyn], [m.append_peak_bytes for m in dyn])[0]
        per_position = kv_cache_bytes(2, 2, 1, 32, 4)
        self.assertGreater(dyn_slope, 0.4 * per_position)
        self.assertGreater(dyn[-1].append_peak_bytes, 20 * dyn[0].append_peak_bytes)
        # Each step keeps exactly one more position in the Dynamic cache.
        self.assertEqual([m.cache_nbytes for m in dyn], [per_position * m.sequence_length for m in dyn])

    def test_refuses_when_already_tracing(self) -> None:
        import tracemalloc

        tracemalloc.start()
        try:
            z = np.zeros((1, 1, 1, 1, 1), dtype=np.float32)
            with self.assertRaisesRegex(ValueError, "tracemalloc"):
                measure_cache_memory("dynamic", CacheGrowthConfig(steps=1), z, z, z)
        finally:
            tracemalloc.stop()


class OracleTest(unittest.TestCase):
    def test_a_wrong_cache_fails_before_timing(self) -> None:
        def broken(q_t: Any, k_t: Any, v_t: Any, cache: Any) -> Any:
            out, weights = multihead_decode_step(q_t, k_t, v_t, cache)
            if isinstance(cache, PreallocatedKVCache) and cache.length == 5:
                out = out + np.float32(1e-3)
            return out, weights

        samples: list[CacheStepSample] = []
        with (
            mock.patch.object(cache_growth, "multihead_decode_step", broken),
            self.assertRaisesRegex(OracleMismatch, "T=5"),
        ):
            run_cache_growth(TINY, samples=samples)
        self.assertEqual(samples, [])


class StatisticsTest(unittest.TestCase):
    def test_fit_line_exact(self) -> None:
        slope, intercept, r2 = fit_line([1, 2, 3, 4], [3.0, 5.0, 7.0, 9.0])
        self.assertAlmostEqual(slope, 2.0)
        self.assertAlmostEqual(intercept, 1.0)
        self.assertAlmostEqual(r2, 1.0)
        with self.assertRaises(ValueError):
            fit_line([1], [1.0])

    def test_rolling_median(self) -> None:
        np.testing.assert_array_equal(rolling_median([1, 100, 3, 4, 5], 3), [50.5, 3, 4, 4, 4.5])
        with self.assertRaises(ValueError):
            rolling_median([1.0], 0)

    def test_summary_of_known_lines(self) -> None:
        # dynamic = 0.1 + 0.01 T, preallocated = 0.1 + 0.002 T: 2x from T >= 16.7, 10% from T >= 1.3.
        n = 100
        samples = synthetic("dynamic", 0.1, 0.01, n, 3) + synthetic("preallocated", 0.1, 0.002, n, 3)
        s = summarize_cache_growth(samples)
        self.assertAlmostEqual(s.fits["dynamic"].slope_ms_per_position, 0.01)
        self.assertAlmostEqual(s.fits["preallocated"].intercept_ms, 0.1)
        self.assertAlmostEqual(s.fits["dynamic"].r2, 1.0)
        self.assertAlmostEqual(s.fits["dynamic"].r2_raw, 1.0)
        t = np.arange(1, n + 1)
        self.assertAlmostEqual(s.totals["dynamic"]["p50_ms"], float(np.sum(0.1 + 0.01 * t)))
        self.assertAlmostEqual(s.total_ratio, float(np.sum(0.1 + 0.01 * t) / np.sum(0.1 + 0.002 * t)))
        self.assertEqual(s.copy_dominates_from, 17)
        self.assertEqual(s.copy_visible_from, 2)
        assert s.copy_dominates_fitted is not None
        self.assertAlmostEqual(s.copy_dominates_fitted, 0.1 / 0.006)
        self.assertEqual([c["sequence_length"] for c in s.checkpoints], [6, 12, 25, 50, 100])
        last = s.checkpoints[-1]
        self.assertAlmostEqual(last["dynamic_p50_ms"], 0.1 + 0.01 * 100)  # window (99, 100] at n/64 = 1

    def test_a_pass_cut_part_way_is_left_out_of_the_totals(self) -> None:
        dyn = synthetic("dynamic", 0.1, 0.01, 10, 2)
        pre = synthetic("preallocated", 0.1, 0.005, 10, 2)
        cut = [dataclasses.replace(x, repeat=2, elapsed_ms=100.0) for x in pre[:4]]
        s = summarize_cache_growth(dyn + pre + cut)
        self.assertEqual(s.totals["preallocated"]["count"], 2)
        self.assertAlmostEqual(s.totals["preallocated"]["p50_ms"], sum(x.elapsed_ms for x in pre[:10]))
        self.assertEqual(partial_passes(dyn + pre + cut), ["preallocated repeat 2"])
        self.assertEqual(partial_passes(dyn + pre), [])
        only_cut = summarize_cache_growth(dyn + cut)  # no complete preallocated pass: no total
        self.assertTrue(np.isnan(only_cut.totals["preallocated"]["p50_ms"]))
        self.assertTrue(np.isnan(only_cut.total_ratio))

    def test_summary_needs_both_caches(self) -> None:
        with self.assertRaisesRegex(ValueError, "preallocated"):
            summarize_cache_growth(synthetic("dynamic", 0.1, 0.01, 10, 1))


class CacheCommandTest(unittest.TestCase):
    FLAGS: ClassVar[list[str]] = [
        *("--steps", "16", "--batch-size", "1", "--num-heads", "2", "--num-kv-heads", "1"),
        *("--head-dim", "8", "--repeats", "2", "--warmup", "0"),
    ]

    def run_cli(self, argv: list[str]) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = cli.main(argv)
        return code, out.getvalue(), err.getvalue()

    def test_writes_raw_memory_summary_meta_and_plot(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "r", "cache.csv")
            code, out, _ = self.run_cli(["cache", "--csv", str(path), *self.FLAGS, "--plot", f"{tmp}/c.png"])
            self.assertEqual(code, 0)
            with path.open(newline="", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
            self.assertEqual(len(rows), 2 * 2 * 16)
            self.assertEqual(rows[0]["cache"], "dynamic")
            with Path(tmp, "r", "cache-memory.csv").open(newline="", encoding="utf-8") as f:
                self.assertEqual(len(list(csv.DictReader(f))), 2 * 16)
            meta = json.loads(Path(f"{path}.meta.json").read_text(encoding="utf-8"))
            self.assertEqual(meta["config"]["steps"], 16)
            self.assertEqual(meta["config"]["oracle_steps"], [1, 2, 8, 16])  # the T the oracle checked
            self.assertIn("numpy", meta["environment"])
            self.assertTrue(Path(tmp, "r", "cache-summary.csv").exists())
            self.assertEqual(Path(tmp, "c.png").read_bytes()[:8], b"\x89PNG\r\n\x1a\n")
            self.assertIn("N-step total time ratio", out)

    def test_model_preset_sets_shape_and_prints_sizes(self) -> None:
        args = cli.build_parser("cache").parse_args(["--model", "llama-3-8b", "--steps", "4"])
        config = cache_cli.cache_config(args)
        self.assertEqual((config.num_heads, config.num_kv_heads, config.head_dim), (32, 8, 128))
        card = cache_growth.kv_size_card(config)
        self.assertEqual(card["kv_bytes_per_token_all_layers_float16"], 2 * 8 * 128 * 2 * 32)

    def test_bad_input_exits_2_and_creates_nothing(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "cache.csv")
            for bad in (
                ["--num-heads", "3", "--num-kv-heads", "2"],
                ["--steps", "0"],
                ["--dtype", "float16"],
                ["--model", "nope"],
                ["--plot", f"{tmp}/x.jpg"],
            ):
                with self.subTest(bad=bad):
                    code, _, err = self.run_cli(["cache", "--csv", str(path), *bad])
                    self.assertEqual(code, 2)
                    self.assertEqual(len(err.strip().splitlines()), 1)
            self.assertEqual(list(Path(tmp).iterdir()), [])

    def meta(self, path: Path) -> dict[str, Any]:
        return json.loads(Path(f"{path}.meta.json").read_text(encoding="utf-8"))

    def csv_rows(self, path: Path) -> list[dict[str, str]]:
        with path.open(newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))

    def test_interrupt_keeps_samples_in_one_line_exit_130(self) -> None:
        def interrupted(config: CacheGrowthConfig, *, samples: list[CacheStepSample], **_: Any) -> None:
            samples.extend(synthetic("dynamic", 0.1, 0.01, 5, 1))
            raise KeyboardInterrupt

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "cache.csv")
            with mock.patch.object(cache_growth, "run_cache_growth", interrupted):
                code, _, err = self.run_cli(["cache", "--csv", str(path), *self.FLAGS])
            self.assertEqual(code, 130)
            self.assertEqual(len(err.strip().splitlines()), 1, err)
            self.assertTrue(err.startswith("attention-kv-caceh: interrupted: kept 5 timed samples"), err)
            self.assertEqual(len(self.csv_rows(path)), 5)
            meta = self.meta(path)
            self.assertEqual((meta["status"], meta["timed_samples"]), ("interrupted", 5))
            self.assertEqual(self.meta(Path(tmp, "cache-memory.csv"))["status"], "interrupted")

    def test_interrupt_before_any_sample_writes_a_header_only_csv(self) -> None:
        # Ctrl-C in the oracle: the message and the metadata must describe files that exist.
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "cache.csv")
            with mock.patch.object(
                cache_growth, "check_cache_oracle", mock.Mock(side_effect=KeyboardInterrupt)
            ):
                code, _, err = self.run_cli(["cache", "--csv", str(path), *self.FLAGS])
            self.assertEqual(code, 130)
            self.assertEqual(len(err.strip().splitlines()), 1, err)
            self.assertIn(f"kept 0 timed samples in {path}", err)
            self.assertEqual(self.csv_rows(path), [])
            self.assertEqual(self.csv_rows(Path(tmp, "cache-memory.csv")), [])
            self.assertEqual(self.meta(path)["status"], "interrupted")

    def test_complete_run_meta_status(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "cache.csv")
            code, out, _ = self.run_cli(["cache", "--csv", str(path), *self.FLAGS])
            self.assertEqual(code, 0)
            self.assertEqual(self.meta(path)["status"], "complete")
            self.assertEqual(self.meta(Path(tmp, "cache-memory.csv"))["status"], "complete")
            self.assertFalse(self.meta(path)["partial_pass"])
            self.assertIn(f"wrote {path}", out)
            self.assertIn(f"{path}.meta.json, {tmp}/cache-memory.csv.meta.json", out)

    def test_oracle_failure_and_runtime_errors_exit_1_in_one_line(self) -> None:
        def failing(exc: BaseException) -> Any:
            def run(config: CacheGrowthConfig, *, samples: list[CacheStepSample], **_: Any) -> None:
                samples.extend(synthetic("dynamic", 0.1, 0.01, 3, 1))
                raise exc

            return run

        cases: list[tuple[BaseException, str, str]] = [
            (OracleMismatch("bad output"), "oracle-failed", "oracle check failed"),
            (MemoryError(), "failed", "out of memory"),
            (RuntimeError("boom"), "failed", "RuntimeError: boom"),
        ]
        for exc, status, needle in cases:
            with self.subTest(exc=exc), tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp, "cache.csv")
                with mock.patch.object(cache_growth, "run_cache_growth", failing(exc)):
                    code, _, err = self.run_cli(["cache", "--csv", str(path), *self.FLAGS])
                self.assertEqual(code, 1)
                self.assertEqual(len(err.strip().splitlines()), 1, err)
                self.assertTrue(err.startswith("attention-kv-caceh: error: "), err)
                self.assertIn(needle, err)
                self.assertEqual(len(self.csv_rows(path)), 3)
                self.assertEqual(self.meta(path)["status"], status)

    def test_a_second_ctrl_c_during_the_final_save_is_ignored(self) -> None:
        # Under `uv run` one Ctrl-C reaches python twice; the second lands while the files are saved.
        first_ctrl_c = [False]

        def interrupted(config: CacheGrowthConfig, *, samples: list[CacheStepSample], **_: Any) -> None:
            samples.extend(synthetic("dynamic", 0.1, 0.01, 5, 1))
            first_ctrl_c[0] = True
            raise KeyboardInterrupt

        real_write = recorder.write_csv_atomic

        def write_interrupted(*args: Any, **kwargs: Any) -> Path:
            if first_ctrl_c[0]:  # the saves before the run (the prediction's) are not the final one
                signal.raise_signal(signal.SIGINT)
            return real_write(*args, **kwargs)

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "cache.csv")
            with (
                mock.patch.object(cache_growth, "run_cache_growth", interrupted),
                mock.patch.object(recorder, "write_csv_atomic", write_interrupted),
            ):
                try:
                    code, _, err = self.run_cli(["cache", "--csv", str(path), *self.FLAGS])
                except KeyboardInterrupt:
                    self.fail("the second Ctrl-C cut the final save short")
            self.assertEqual(code, 130)
            self.assertEqual(len(err.strip().splitlines()), 1, err)
            self.assertEqual(len(self.csv_rows(path)), 5)
            self.assertEqual(self.meta(path)["status"], "interrupted")
            self.assertEqual(self.meta(Path(tmp, "cache-memory.csv"))["status"], "interrupted")
        self.assertIs(signal.getsignal(signal.SIGINT), signal.default_int_handler)

    def test_a_pass_cut_part_way_keeps_its_rows(self) -> None:
        def interrupt_on_call(n: int, real: Any) -> Any:
            calls = [0]

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                calls[0] += 1
                if calls[0] == n:
                    raise KeyboardInterrupt
                return real(*args, **kwargs)

            return wrapped

        # 16 steps, no warm-up: Ctrl-C at the 20th timed step keeps the first pass (16 rows) and 3
        # steps of the second; Ctrl-C at the 5th memory step keeps 4 memory rows.
        cases = [
            (cache_growth, "measure", 20, 19, 32, "preallocated repeat 0"),
            (cache_memory, "scaled_dot_product_attention", 5, 0, 4, "dynamic memory pass"),
        ]
        for module, name, n, timed, memory, cut in cases:
            with self.subTest(name=name), tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp, "cache.csv")
                patched = interrupt_on_call(n, getattr(module, name))
                with mock.patch.object(module, name, patched):
                    code, _, err = self.run_cli(["cache", "--csv", str(path), *self.FLAGS])
                self.assertEqual(code, 130)
                self.assertEqual(len(err.strip().splitlines()), 1, err)
                self.assertIn(f"kept {timed} timed samples", err)
                self.assertIn(f"cut part-way: {cut}", err)
                rows = self.csv_rows(path)
                self.assertEqual(len(rows), timed)
                self.assertEqual(len(self.csv_rows(Path(tmp, "cache-memory.csv"))), memory)
                meta = self.meta(path)
                self.assertEqual((meta["status"], meta["timed_samples"]), ("interrupted", timed))
                self.assertEqual((meta["memory_rows"], meta["partial_pass"]), (memory, True))
                self.assertEqual(meta["partial_passes"], [cut])
                if timed:
                    self.assertEqual(
                        [r["step"] for r in rows if r["repeat"] == "0" and r["cache"] == "preallocated"],
                        ["0", "1", "2"],
                    )

    def test_usage_errors_leave_an_earlier_run_alone(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "cache.csv")
            earlier = Path(f"{path}.meta.json")
            earlier.write_text('{"earlier": true}\n', encoding="utf-8")
            for bad in (
                ["--seed", "-1"],
                ["--steps", "1"],
                ["--steps", "1000000000"],
                ["--batch-size", "1000", "--num-heads", "64", "--head-dim", "4096"],
            ):
                with self.subTest(bad=bad):
                    code, out, err = self.run_cli(["cache", "--csv", str(path), *bad])
                    self.assertEqual(code, 2)
                    self.assertEqual(len(err.strip().splitlines()), 1, err)
                    self.assertEqual(out, "")
            self.assertEqual(earlier.read_text(encoding="utf-8"), '{"earlier": true}\n')
            self.assertEqual(list(Path(tmp).iterdir()), [earlier])

    def test_flags_are_named_in_errors(self) -> None:
        for bad, needle in (
            (["--seed", "-1"], "--seed"),
            (["--num-heads", "3", "--num-kv-heads", "2"], "--num-kv-heads"),
            (["--model", "nope"], "--model"),
        ):
            with self.subTest(bad=bad):
                _, _, err = self.run_cli(["cache", *bad])
                self.assertIn(needle, err)

    def test_memory_check_names_size_and_flags(self) -> None:
        config = CacheGrowthConfig(steps=1024, batch_size=4, num_heads=8, num_kv_heads=8, head_dim=64)
        needed = cache_growth.estimate_run_bytes(config)
        # inputs (q, k, v for N steps) and both caches at T = N at least
        self.assertGreater(needed, 1024 * 4 * 24 * 64 * 4 + 2 * 4 * 8 * 1024 * 64 * 4 * 2)
        flags = ["--steps", "1024", "--batch-size", "4", "--num-heads", "8", "--head-dim", "64"]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "cache.csv")
            # 1 MiB of physical memory, then a `ulimit -v` (RLIMIT_AS) lower than physical memory
            for patch in (
                mock.patch.object(os, "sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else 256),
                mock.patch.object(resource, "getrlimit", lambda _: (2**20, resource.RLIM_INFINITY)),
            ):
                with self.subTest(patch=patch), patch:
                    code, _, err = self.run_cli(["cache", "--csv", str(path), *flags])
                self.assertEqual(code, 2)
                self.assertRegex(err, r"MiB.*lower --steps, --batch-size")
            self.assertEqual(list(Path(tmp).iterdir()), [])

    def test_every_output_path_is_checked_first(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            blocker = Path(tmp, "file.txt")
            blocker.write_text("x", encoding="utf-8")
            Path(tmp, "cache-memory.csv").mkdir()  # a folder where a side file goes
            for argv in (
                ["--csv", f"{blocker}/cache.csv"],
                ["--csv", f"{tmp}/cache.csv"],
                ["--csv", f"{tmp}/ok.csv", "--plot", f"{blocker}/c.png"],
            ):
                with self.subTest(argv=argv):
                    code, out, err = self.run_cli(["cache", *argv, *self.FLAGS])
                    self.assertEqual(code, 2)
                    self.assertEqual(len(err.strip().splitlines()), 1, err)
                    self.assertEqual(out, "")
            self.assertEqual(sorted(p.name for p in Path(tmp).iterdir()), ["cache-memory.csv", "file.txt"])


if __name__ == "__main__":
    unittest.main()
