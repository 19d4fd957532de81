"""The scan's --impl: every implementation checked, then timed at every B; oracle failures; old files.

No test bounds a time: they check which rows exist, which oracle ran and what was refused.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import tempfile
import unittest
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from attention_kv_caceh import cli
from attention_kv_caceh.experiments import fused
from attention_kv_caceh.experiments.calibration import calibrate
from attention_kv_caceh.experiments.fused import torch_sdpa_available
from attention_kv_caceh.experiments.scan import (
    ScanConfig,
    build_inputs,
    prefilled_cache,
    run_batch,
)
from attention_kv_caceh.experiments.scan_impls import IMPLS, check_step, make_step, resolve_impls
from attention_kv_caceh.experiments.scan_stats import scan_table, scan_tables
from attention_kv_caceh.files import write_csv_atomic, write_json_atomic
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.report import build as report
from attention_kv_caceh.report.readers import classify_header
from attention_kv_caceh.timing import Sample
from tests import as_on_a_quiet_machine

TINY = ("--batch-sizes", "1,2,4", "--seq-len", "16", "--repeats", "4", "--warmup", "1")
REPEATS = 4


def setUpModule() -> None:
    as_on_a_quiet_machine()  # the scan's load warning would add a stderr line


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def expected_all() -> tuple[str, ...]:
    return IMPLS if torch_sdpa_available() else IMPLS[:2]


def wrong_kernel(shift: float, from_batch: int = 1) -> Any:
    """A stand-in for the fused kernel: the real result, plus `shift` once B >= from_batch."""
    real = fused.decode_attention_into

    def kernel(q: Any, k: Any, v: Any, out: Any, scale: float, threads: int) -> None:
        real(q, k, v, out, scale, threads)
        if q.shape[0] >= from_batch:
            out += shift

    return kernel


class ScanImplCliTest(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.csv = Path(self._tmp.name) / "results" / "benchmark.csv"

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def meta(self) -> dict[str, Any]:
        return json.loads(Path(f"{self.csv}.meta.json").read_text(encoding="utf-8"))

    def summary(self) -> list[dict[str, str]]:
        return read_rows(self.csv.with_name("benchmark-summary.csv"))

    def test_impl_all_times_every_implementation_at_every_batch_size_with_the_same_repeats(self) -> None:
        impls = expected_all()
        for cache in ("dynamic", "preallocated"):
            with self.subTest(cache=cache):
                code, out, err = run_cli("--csv", str(self.csv), *TINY, "--cache", cache, "--impl", "all")
                self.assertEqual(code, 0, err)
                rows = read_rows(self.csv)
                counts: dict[tuple[str, str], int] = {}
                for r in rows:
                    counts[(r["batch_size"], r["impl"])] = counts.get((r["batch_size"], r["impl"]), 0) + 1
                self.assertEqual(counts, {(b, i): REPEATS for b in ("1", "2", "4") for i in impls})
                # Interleaved per B: every implementation of B=1 is written before any of B=2.
                order = [(r["batch_size"], r["impl"]) for r in rows]
                self.assertEqual(list(dict.fromkeys(order)), [(b, i) for b in ("1", "2", "4") for i in impls])
                self.assertEqual(
                    [(r["batch_size"], r["impl"]) for r in self.summary()],
                    [(b, i) for b in ("1", "2", "4") for i in impls],
                )
                meta = self.meta()
                self.assertEqual(meta["status"], "complete")
                self.assertEqual(meta["impls"], list(impls))
                self.assertEqual(set(meta["predictions"]), set(impls))
                self.assertEqual(set(meta["prediction_outcomes"]), set(impls))
                self.assertEqual(set(meta["saturation_by_impl"]), set(impls))
                self.assertEqual(set(meta["oracle_max_abs_error_by_impl"]), set(impls))
                self.assertIn("contiguous/float32/C/threads=1", meta["kernel_compile_seconds"])
                self.assertIn("fused step", meta["predictions"]["fused"]["calibration"]["overhead_shape"])
                for impl in impls:
                    self.assertRegex(out, rf"\n\s*4\s+{impl}\s+\d")  # one table row per impl at B = 4
                    self.assertIn(f"Saturation ({impl}): ", out)
                summary = json.loads(out.strip().splitlines()[-1])
                self.assertEqual(list(summary["impls"]), list(impls))

    def test_the_report_reads_an_impl_all_run_with_one_prediction_check_per_implementation(self) -> None:
        code, _, err = run_cli("--csv", str(self.csv), *TINY, "--impl", "all")
        self.assertEqual(code, 0, err)
        result = report.build_report(self.csv.parent, self.csv.parent / "report.md", plot=False)
        self.assertEqual(result.problems, [])
        for impl in expected_all():
            self.assertIn(f"### Batch-size scan: `benchmark.csv`, {impl}\n", result.markdown)
            self.assertIn(f"\n**{impl}**\n", result.markdown)
        self.assertEqual(result.markdown.count("model saturation"), len(expected_all()))

    def test_the_default_times_numpy_only_and_prints_the_plain_table(self) -> None:
        code, out, err = run_cli("--csv", str(self.csv), *TINY)
        self.assertEqual(code, 0, err)
        self.assertEqual({r["impl"] for r in read_rows(self.csv)}, {"numpy"})
        self.assertEqual(self.meta()["impls"], ["numpy"])
        self.assertNotIn("kernel_compile_seconds", self.meta())
        self.assertIn("\nSaturation: ", out)
        self.assertNotIn(" impl ", out)

    def test_a_fused_kernel_failing_its_oracle_is_never_timed_and_exits_1(self) -> None:
        with mock.patch.object(fused, "decode_attention_into", wrong_kernel(1e-2)):
            code, out, err = run_cli("--csv", str(self.csv), *TINY, "--impl", "all")
        self.assertEqual(code, 1)
        self.assertIn("oracle check failed in the calibration of fused", err)
        rows = read_rows(self.csv)
        self.assertNotIn("fused", {r["impl"] for r in rows})
        self.assertEqual({r["batch_size"] for r in rows if r["impl"] == "numpy"}, {"1", "2", "4"})
        meta = self.meta()
        self.assertEqual(meta["status"], "oracle-failed")
        self.assertIn("fused", meta["oracle_failures"])
        self.assertNotIn("fused", meta["predictions"])
        self.assertIn("Oracle FAILED for fused", out)

    def test_a_fused_kernel_failing_at_a_larger_batch_is_dropped_from_there_on(self) -> None:
        with mock.patch.object(fused, "decode_attention_into", wrong_kernel(1e-2, from_batch=2)):
            code, _, err = run_cli("--csv", str(self.csv), *TINY, "--impl", "fused")
        self.assertEqual(code, 1)
        self.assertIn("oracle check failed at B=2", err)
        self.assertEqual({r["batch_size"] for r in read_rows(self.csv)}, {"1"})
        self.assertEqual(self.meta()["status"], "oracle-failed")

    def test_only_fused_failing_mid_scan_keeps_timing_numpy(self) -> None:
        with mock.patch.object(fused, "decode_attention_into", wrong_kernel(1e-2, from_batch=2)):
            code, out, err = run_cli("--csv", str(self.csv), *TINY, "--impl", "all")
        self.assertEqual(code, 1)
        self.assertIn("oracle check failed for fused at B=2", err)
        rows = read_rows(self.csv)
        self.assertEqual({r["batch_size"] for r in rows if r["impl"] == "fused"}, {"1"})
        self.assertEqual({r["batch_size"] for r in rows if r["impl"] == "numpy"}, {"1", "2", "4"})
        self.assertTrue(self.meta()["oracle_failures"]["fused"].startswith("B=2: fused: "))
        self.assertIn("Oracle: every B of numpy matched", out)
        self.assertIn("Oracle FAILED for fused: B=2", out)

    def test_an_unknown_impl_is_a_usage_error_and_touches_nothing(self) -> None:
        code, out, err = run_cli("--csv", str(self.csv), *TINY, "--impl", "bogus")
        self.assertEqual(code, 2)
        self.assertEqual(out, "")
        self.assertIn("--impl", err)
        self.assertFalse(self.csv.parent.exists())


class ScanImplUnitTest(unittest.TestCase):
    def test_resolve_impls(self) -> None:
        self.assertEqual(resolve_impls("numpy"), ("numpy",))
        self.assertEqual(resolve_impls("fused"), ("fused",))
        self.assertEqual(resolve_impls("all", torch_available=False), ("numpy", "fused"))
        self.assertEqual(resolve_impls("all", torch_available=True), ("numpy", "fused", "torch-sdpa"))
        with self.assertRaisesRegex(ValueError, "bogus"):
            resolve_impls("bogus")

    def test_check_step_names_the_implementation_of_a_wrong_output(self) -> None:
        config = ScanConfig(batch_sizes=(2,), seq_len=8, head_dim=8, num_heads=4, num_kv_heads=2)
        inputs = build_inputs(config)
        q_t, k_t, v_t = inputs.q_t, inputs.k_t, inputs.v_t
        good = make_step("fused", q_t)
        cache = prefilled_cache(config, inputs, 2)
        err = check_step(good, q_t, k_t, v_t, cache, lambda: prefilled_cache(config, inputs, 2))
        self.assertLess(err, 1e-5)
        with mock.patch.object(fused, "decode_attention_into", wrong_kernel(1e-3)):
            bad = make_step("fused", q_t)
            cache = prefilled_cache(config, inputs, 2)
            with self.assertRaisesRegex(OracleMismatch, r"^fused: output vs multihead_decode_step"):
                check_step(bad, q_t, k_t, v_t, cache, lambda: prefilled_cache(config, inputs, 2))

    def test_calibration_times_the_implementation_it_predicts(self) -> None:
        config = ScanConfig(batch_sizes=(1, 2), seq_len=8, warmup=2, repeats=3)
        calls = {"n": 0}
        real = fused.FusedDecodeStep.__call__

        def counting(self: fused.FusedDecodeStep, *args: Any) -> Any:
            calls["n"] += 1
            return real(self, *args)

        with mock.patch.object(fused.FusedDecodeStep, "__call__", counting):
            numpy_cal = calibrate(config)
            self.assertEqual(calls["n"], 0)
            fused_cal = calibrate(config, impl="fused", probe_samples_ms=numpy_cal.probe_samples_ms)
        self.assertEqual(calls["n"], 1 + 2 + 3)  # oracle, warm-up, timed
        self.assertEqual(fused_cal.probe_samples_ms, numpy_cal.probe_samples_ms)  # shared probe
        self.assertTrue(fused_cal.overhead_shape.endswith("fused step"))

    def test_run_batch_tags_samples_and_a_summary_never_mixes_implementations(self) -> None:
        config = ScanConfig(batch_sizes=(2,), seq_len=8, warmup=0, repeats=3)
        result = run_batch(config, build_inputs(config), 2, ("numpy", "fused"))
        self.assertEqual([s.impl for s in result.samples], ["numpy"] * 3 + ["fused"] * 3)
        self.assertEqual([i for i, _ in result.oracle_errors], ["numpy", "fused"])
        with self.assertRaisesRegex(ValueError, "mix implementations"):
            scan_table(result.samples)
        tables = scan_tables(result.samples, {2: result.probe_samples_ms}, {2: result.kv_bytes_per_step})
        self.assertEqual(list(tables), ["numpy", "fused"])
        self.assertEqual([t[0]["count"] for t in tables.values()], [3, 3])
        with self.assertRaisesRegex(ValueError, "impls"):
            run_batch(config, build_inputs(config), 2, ("cuda",))

    @unittest.skipUnless(torch_sdpa_available(), "torch is not installed (it is not a dependency)")
    def test_torch_sdpa_passes_the_oracle_and_is_timed(self) -> None:
        config = ScanConfig(batch_sizes=(2,), seq_len=8, num_heads=4, num_kv_heads=2, warmup=0, repeats=2)
        result = run_batch(config, build_inputs(config), 2, ("torch-sdpa",))
        self.assertEqual({s.impl for s in result.samples}, {"torch-sdpa"})
        self.assertEqual(result.oracle_failures, ())


class OldScanFileTest(unittest.TestCase):
    def test_a_scan_csv_without_the_impl_column_is_reported_as_numpy(self) -> None:
        fields = [f.name for f in dataclasses.fields(Sample) if f.name != "impl"]
        self.assertEqual(classify_header(fields), "scan")
        self.assertIsNone(classify_header([*fields, "impl", "extra"]))
        values = {1: [1.0, 2.0, 3.0], 2: [2.0, 3.0, 4.0]}
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            rows = [
                {k: v for k, v in dataclasses.asdict(Sample(b, 128, ms, repeat=i)).items() if k != "impl"}
                for b, vs in values.items()
                for i, ms in enumerate(vs)
            ]
            path = write_csv_atomic(folder / "old.csv", rows, fields)
            write_json_atomic(
                Path(f"{path}.meta.json"),
                {
                    "environment": {"cpu_model": "Test CPU", "numpy": "9.9", "blas": [], "thread_env": {}},
                    "config": {},
                    "probe_samples_ms": {"1": [1.0], "2": [2.0]},
                    "kv_bytes_per_step": {"1": 1_000_000, "2": 2_000_000},
                },
            )
            result = report.build_report(folder, folder / "report.md", plot=False)
        self.assertEqual(result.problems, [])
        self.assertIn("### Batch-size scan: `old.csv`\n", result.markdown)
        self.assertIn("6 raw samples", result.markdown)

    def test_a_file_of_two_implementations_gets_one_part_each(self) -> None:
        samples = [
            Sample(b, 16, ms, repeat=i, impl=impl)
            for impl, scale in (("numpy", 2.0), ("fused", 1.0))
            for b in (1, 2)
            for i, ms in enumerate(np.array([1.0, 1.1, 1.2]) * scale * b)
        ]
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            fields = [f.name for f in dataclasses.fields(Sample)]
            path = write_csv_atomic(folder / "all.csv", (dataclasses.asdict(s) for s in samples), fields)
            write_json_atomic(
                Path(f"{path}.meta.json"),
                {
                    "environment": {"cpu_model": "Test CPU", "numpy": "9.9", "blas": [], "thread_env": {}},
                    "config": {},
                    "probe_samples_ms": {"1": [1.0], "2": [2.0]},
                    "kv_bytes_per_step": {"1": 1_000_000, "2": 2_000_000},
                },
            )
            result = report.build_report(folder, folder / "report.md", plot=False)
        self.assertEqual(result.problems, [])
        self.assertIn("### Batch-size scan: `all.csv`, numpy\n", result.markdown)
        self.assertIn("### Batch-size scan: `all.csv`, fused\n", result.markdown)
        self.assertEqual(result.markdown.count("6 raw samples"), 2)


if __name__ == "__main__":
    unittest.main()
