"""Predict before measuring, end to end through the CLI (`cli/scan.py`, `cli/cache.py`): the prediction is on disk and on stdout before the first timed sample, a wrong
prediction is reported as failed (text and JSON line), anomalies are listed with their repeat index,
and a saturation no scan could measure is a usage error.

Where a verdict is asserted, the timed samples are replaced by hand-made ones (known P50s), so the
assertion does not depend on this machine's speed; the calibration and the oracle still run for real.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import sys
import tempfile
import unittest
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar
from unittest import mock

from attention_kv_caceh import cli
from attention_kv_caceh.experiments import cache_growth, cache_prediction, calibration, scan_run
from attention_kv_caceh.experiments.cache_growth import CacheGrowthConfig
from attention_kv_caceh.experiments.cache_growth_stats import CacheStepSample
from attention_kv_caceh.experiments.cache_prediction import CachePrediction
from attention_kv_caceh.experiments.prediction import ScanPrediction
from attention_kv_caceh.experiments.scan import BatchResult, ScanConfig, ScanInputs, kv_bytes_per_step
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.timing import Sample
from tests import as_on_a_quiet_machine

SMALL = ("--batch-sizes", "1,2,4,8", "--repeats", "5", "--warmup", "1")


def setUpModule() -> None:
    as_on_a_quiet_machine()  # the scan's load warning would add a stderr line


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def last_json(out: str) -> dict[str, Any]:
    return json.loads(out.strip().splitlines()[-1])


def fake_batches(p50_ms: dict[int, float], outlier: tuple[int, int, float] | None = None) -> Any:
    """A stand-in for `run_batch`: config.repeats samples per B, all at the given P50 (so every statistic
    is it), except an optional (B, repeat, elapsed_ms) outlier; the oracle is not run."""

    def run_batch(
        config: ScanConfig, inputs: ScanInputs, b: int, impls: Sequence[str] = ("numpy",)
    ) -> BatchResult:
        values = [p50_ms[b]] * config.repeats
        if outlier is not None and outlier[0] == b:
            values[outlier[1]] = outlier[2]
        samples = tuple(
            Sample(b, config.seq_len, ms, repeat=i, seed=config.seed, warmup=config.warmup)
            for i, ms in enumerate(values)
        )
        return BatchResult(b, samples, (0.01,) * config.repeats, kv_bytes_per_step(config, b), 0.0)

    return run_batch


# positions/s = B * T / P50: doubling B from 1 to 2 doubles it, from 2 to 4 leaves it flat, so the
# measured saturation point is B = 2 (`scan_stats.saturation_point`, gain < 10 %).
SATURATES_AT_2 = {1: 0.05, 2: 0.05, 4: 0.10, 8: 0.20}
# Every doubling raises positions/s by 60 % or more: not reached.
NEVER_SATURATES = {1: 0.05, 2: 0.06, 4: 0.07, 8: 0.08}


class ScanPredictionCliTest(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.csv = Path(self._tmp.name) / "results" / "benchmark.csv"
        self.meta_file = Path(f"{self.csv}.meta.json")

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def meta(self) -> dict[str, Any]:
        return json.loads(self.meta_file.read_text(encoding="utf-8"))

    def test_prediction_is_on_disk_and_on_stdout_before_the_first_timed_sample(self) -> None:
        real = scan_run.run_batch
        seen: dict[str, Any] = {}

        def first_batch_reads_the_files(
            config: ScanConfig, inputs: ScanInputs, b: int, impls: Sequence[str]
        ) -> BatchResult:
            if not seen:  # the first B, before any of its samples is timed
                seen["meta"] = json.loads(self.meta_file.read_text(encoding="utf-8"))
                seen["stdout"] = sys.stdout.getvalue()  # type: ignore[attr-defined]  # redirected StringIO
            return real(config, inputs, b, impls)

        with mock.patch.object(scan_run, "run_batch", first_batch_reads_the_files):
            code, out, _ = run_cli(
                "--csv", str(self.csv), *SMALL, "--predict", "saturates at B = 4", "--predict-saturation", "4"
            )
        self.assertEqual(code, 0)
        before = seen["meta"]
        self.assertEqual(before["status"], "running")
        self.assertEqual(
            before["prediction"]["user"],
            {"text": "saturates at B = 4", "saturation_given": True, "saturation": 4},
        )
        self.assertEqual([r["batch_size"] for r in before["prediction"]["model"]["rows"]], [1, 2, 4, 8])
        self.assertIn("Prediction (written", seen["stdout"])
        self.assertIn("'saturates at B = 4'", seen["stdout"])
        self.assertNotIn("Prediction against measurement", seen["stdout"])
        self.assertNotIn("probe GB/s", seen["stdout"])  # the scan's table comes after the run

        meta = self.meta()
        written = dt.datetime.fromisoformat(meta["prediction"]["written_at_utc"])
        started = dt.datetime.fromisoformat(meta["timing_started_utc"])
        self.assertLessEqual(written, started)
        self.assertEqual(meta["prediction"], before["prediction"])  # not rewritten after measuring
        self.assertEqual(ScanPrediction.from_json(meta["prediction"]).to_json(), meta["prediction"])
        names = [v["name"] for v in meta["prediction_outcome"]["verdicts"]]
        self.assertEqual(names, ["user (text)", "user saturation", "model saturation", "model P50"])
        self.assertLess(out.index("Prediction (written"), out.index("Prediction against measurement"))
        self.assertLess(out.index("Saturation:"), out.index("Prediction against measurement"))
        self.assertIn("Boundary: ", out)
        self.assertEqual(set(last_json(out)["predictions"]), set(names))

    def test_a_wrong_saturation_prediction_is_reported_as_failed(self) -> None:
        with mock.patch.object(scan_run, "run_batch", fake_batches(SATURATES_AT_2)):
            code, out, _ = run_cli("--csv", str(self.csv), *SMALL, "--predict-saturation", "4")
        self.assertEqual(code, 0)
        self.assertRegex(out, r"user saturation\s+FAILED")
        self.assertIs(last_json(out)["predictions"]["user saturation"], False)
        outcome = self.meta()["prediction_outcome"]
        self.assertEqual(outcome["measured_saturation"], 2)
        verdict = next(v for v in outcome["verdicts"] if v["name"] == "user saturation")
        self.assertIs(verdict["held"], False)

    def test_a_right_saturation_prediction_holds(self) -> None:
        with mock.patch.object(scan_run, "run_batch", fake_batches(SATURATES_AT_2)):
            code, out, _ = run_cli("--csv", str(self.csv), *SMALL, "--predict-saturation", "2")
        self.assertEqual(code, 0)
        self.assertIs(last_json(out)["predictions"]["user saturation"], True)
        self.assertEqual(self.meta()["prediction_outcome"]["measured_saturation"], 2)

    def test_none_holds_when_saturation_is_not_reached_and_fails_when_it_is(self) -> None:
        for p50, held in ((NEVER_SATURATES, True), (SATURATES_AT_2, False)):
            with self.subTest(held=held), mock.patch.object(scan_run, "run_batch", fake_batches(p50)):
                code, out, _ = run_cli("--csv", str(self.csv), *SMALL, "--predict-saturation", "none")
                self.assertEqual(code, 0)
                self.assertIs(last_json(out)["predictions"]["user saturation"], held)

    def test_without_a_user_prediction_only_the_model_is_judged(self) -> None:
        with mock.patch.object(scan_run, "run_batch", fake_batches(NEVER_SATURATES)):
            code, out, _ = run_cli("--csv", str(self.csv), *SMALL)
        self.assertEqual(code, 0)
        self.assertEqual(set(last_json(out)["predictions"]), {"model saturation", "model P50"})
        # No card of a prediction nobody gave: the model's verdicts only, one line each.
        self.assertNotIn("Prediction (written", out)
        self.assertNotIn("Prediction against measurement", out)
        self.assertLessEqual(len(out.splitlines()), 25, out)
        self.assertIs(self.meta()["prediction"]["user"]["saturation_given"], False)
        self.assertEqual(len(self.meta()["prediction"]["model"]["rows"]), 4)

    def test_an_anomaly_is_listed_with_its_repeat_index(self) -> None:
        # 40 samples at B = 4: 39 at 0.07 ms and repeat 13 at 10 ms. P95 (linear, index 37.05 of the
        # sorted 40) is 0.07 ms, so 10 ms is above 2 x P95; every other group is flat, with none above.
        with mock.patch.object(scan_run, "run_batch", fake_batches(NEVER_SATURATES, (4, 13, 10.0))):
            code, out, _ = run_cli(
                "--csv", str(self.csv), "--batch-sizes", "1,2,4,8", "--repeats", "40", "--warmup", "0"
            )
        self.assertEqual(code, 0)
        self.assertIn("B = 4, repeat 13: 10.0000 ms (group P95 0.0700 ms)", out)
        self.assertIn("1 sample(s) above 2 x their group's P95", out)
        anomalies = self.meta()["prediction_outcome"]["anomalies"]
        self.assertEqual([(a["batch_size"], a["repeat"]) for a in anomalies], [(4, 13)])

    def test_a_saturation_that_is_not_a_scanned_b_exits_2_touching_nothing(self) -> None:
        for value in ("3", "8", "0", "four"):
            with self.subTest(value=value):
                code, out, err = run_cli("--csv", str(self.csv), *SMALL, "--predict-saturation", value)
                self.assertEqual(code, 2)
                self.assertEqual(out, "")
                self.assertEqual(len(err.strip().splitlines()), 1, err)
                self.assertIn("--predict-saturation", err)
                self.assertFalse(self.csv.parent.exists())

    def test_an_interrupt_keeps_the_prediction_in_the_metadata(self) -> None:
        real = scan_run.run_batch

        def interrupted(config: ScanConfig, inputs: ScanInputs, b: int, impls: Sequence[str]) -> BatchResult:
            if b == 2:
                raise KeyboardInterrupt
            return real(config, inputs, b, impls)

        with mock.patch.object(scan_run, "run_batch", interrupted):
            code, _, _ = run_cli("--csv", str(self.csv), *SMALL, "--predict", "flat")
        self.assertEqual(code, 130)
        meta = self.meta()
        self.assertEqual(meta["status"], "interrupted")
        self.assertEqual(meta["prediction"]["user"]["text"], "flat")
        self.assertNotIn("prediction_outcome", meta)

    def test_a_calibration_oracle_failure_exits_1_before_any_timing(self) -> None:
        def wrong(*_: Any) -> float:
            raise OracleMismatch("weights do not sum to 1")

        with (
            mock.patch.object(calibration, "check_step", wrong),
            mock.patch.object(
                scan_run, "run_batch", side_effect=AssertionError("timed after a failed oracle")
            ),
        ):
            code, _, err = run_cli("--csv", str(self.csv), *SMALL)
        self.assertEqual(code, 1)
        self.assertIn("oracle check failed in the calibration", err)
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertEqual(self.meta()["status"], "oracle-failed")


def on_a_line(kind: str, slope: float, steps: int, repeats: int) -> list[CacheStepSample]:
    """Cache samples lying exactly on elapsed_ms = slope * T (every repeat identical)."""
    params = CacheGrowthConfig(steps=steps).params()
    return [
        CacheStepSample(cache=kind, step=t - 1, sequence_length=t, elapsed_ms=slope * t, repeat=r, **params)
        for r in range(repeats)
        for t in range(1, steps + 1)
    ]


class CachePredictionCliTest(unittest.TestCase):
    # B = 1, H_kv = 1, D = 8, float32: 2 x 8 x 4 = 64 bytes per position (Preallocated), 192 (Dynamic);
    # the probe reads the K/V of a cache at T = N = 16: 1,024 bytes.
    FLAGS: ClassVar[list[str]] = [
        *("--steps", "16", "--batch-size", "1", "--num-heads", "2", "--num-kv-heads", "1"),
        *("--head-dim", "8", "--repeats", "2", "--warmup", "0"),
    ]

    def test_the_prediction_is_written_and_printed_before_timing_and_judged_after(self) -> None:
        real = cache_growth.run_cache_growth
        seen: dict[str, Any] = {}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "cache.csv")

            def checking(config: CacheGrowthConfig, **kwargs: Any) -> Any:
                seen["meta"] = json.loads(Path(f"{path}.meta.json").read_text(encoding="utf-8"))
                seen["stdout"] = sys.stdout.getvalue()  # type: ignore[attr-defined]  # redirected StringIO
                return real(config, **kwargs)

            with mock.patch.object(cache_growth, "run_cache_growth", checking):
                code, out, _ = run_cli("cache", "--csv", str(path), *self.FLAGS)
            self.assertEqual(code, 0)
            meta = json.loads(Path(f"{path}.meta.json").read_text(encoding="utf-8"))
        self.assertEqual(seen["meta"]["status"], "running")
        self.assertEqual(
            seen["meta"]["prediction"]["bytes_per_position"], {"dynamic": 192, "preallocated": 64}
        )
        self.assertEqual(seen["meta"]["prediction"]["probe_bytes"], 1024)
        self.assertIn("Prediction (written", seen["stdout"])
        self.assertNotIn("Prediction against measurement", seen["stdout"])
        self.assertEqual(CachePrediction.from_json(meta["prediction"]).to_json(), meta["prediction"])
        self.assertEqual(
            [v["name"] for v in meta["prediction_outcome"]["verdicts"]],
            ["dynamic slope", "preallocated slope", "dynamic / preallocated"],
        )
        self.assertLess(out.index("N-step total time ratio"), out.index("Prediction against measurement"))

    def run_with(self, probe_ms: float, dynamic: float, preallocated: float) -> tuple[str, dict[str, Any]]:
        """A run whose probe reads 1,024 bytes in probe_ms and whose steps lie on the given slopes."""

        def fake_run(config: CacheGrowthConfig, *, samples: list[CacheStepSample], **_: Any) -> None:
            samples.extend(
                on_a_line("dynamic", dynamic, 16, 2) + on_a_line("preallocated", preallocated, 16, 2)
            )

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "cache.csv")
            with (
                mock.patch.object(cache_prediction, "read_probe", return_value=[probe_ms]),
                mock.patch.object(cache_growth, "run_cache_growth", fake_run),
            ):
                code, out, _ = run_cli("cache", "--csv", str(path), *self.FLAGS)
            self.assertEqual(code, 0)
            return out, json.loads(Path(f"{path}.meta.json").read_text(encoding="utf-8"))

    def test_slopes_that_match_the_bytes_hold(self) -> None:
        # Probe: 1,024 bytes in 1 ms. Predicted: 64 / 1,024 = 0.0625 and 192 / 1,024 = 0.1875 ms/position.
        out, meta = self.run_with(1.0, dynamic=0.1875, preallocated=0.0625)
        self.assertIn("62.5000 us/position", out)
        self.assertTrue(all(v["held"] for v in meta["prediction_outcome"]["verdicts"]))

    def test_a_wrong_slope_is_reported_as_failed(self) -> None:
        # The Dynamic step grows 4x faster than its bytes predict; the Preallocated one as predicted.
        out, meta = self.run_with(1.0, dynamic=0.75, preallocated=0.0625)
        self.assertIn("failed: measured 750.0000, predicted 187.5000 us/position", out)
        self.assertRegex(out, r"dynamic slope\s+FAILED")
        held = {v["name"]: v["held"] for v in meta["prediction_outcome"]["verdicts"]}
        self.assertEqual(
            held, {"dynamic slope": False, "preallocated slope": True, "dynamic / preallocated": False}
        )


if __name__ == "__main__":
    unittest.main()
