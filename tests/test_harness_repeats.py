"""Repeats with confidence intervals: Student's t quantile against its density integrated in float64 and
the printed tables, the interval formula against a direct computation, `harness --repeats` keeping every
run, and `report` stating the same intervals from the repeats' files."""

from __future__ import annotations

import contextlib
import io
import json
import math
import statistics
import tempfile
import unittest
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.harness.repeats import (
    HEADLINE_METRICS,
    MAX_REPEATS,
    confidence_interval,
    repeat_intervals,
    t_central_probability,
    t_quantile,
)

# t_{0.975, df}, two-sided 95 %, from the standard printed tables
TABLE = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    9: 2.262,
    10: 2.228,
    20: 2.086,
    30: 2.042,
    120: 1.980,
}


def _density(t: float, df: int) -> float:
    """Student's t density, float64 (the oracle of the series)."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    return c * (1 + t * t / df) ** (-(df + 1) / 2)


def _central_by_simpson(t: float, df: int, steps: int = 20_000) -> float:
    h = t / steps
    total = _density(0, df) + _density(t, df)
    total += sum((4 if k % 2 else 2) * _density(k * h, df) for k in range(1, steps))
    return 2 * total * h / 3


class StudentTTest(unittest.TestCase):
    def test_quantiles_match_the_printed_table(self) -> None:
        for df, expected in TABLE.items():
            with self.subTest(df=df):
                self.assertAlmostEqual(t_quantile(0.975, df), expected, places=3)

    def test_central_probability_equals_the_integrated_density(self) -> None:
        for df in (1, 2, 3, 6, 7, 15):
            for t in (0.3, 1.0, 2.5, 8.0):
                with self.subTest(df=df, t=t):
                    self.assertAlmostEqual(t_central_probability(t, df), _central_by_simpson(t, df), places=9)

    @settings(max_examples=40, deadline=None)
    @given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=2, max_size=30))
    def test_interval_is_mean_plus_minus_t_s_over_root_n(self, values: list[float]) -> None:
        ci = confidence_interval(values)
        n = len(values)
        half = t_quantile(0.975, n - 1) * statistics.stdev(values) / math.sqrt(n)
        self.assertAlmostEqual(ci["mean"], statistics.fmean(values), delta=1e-9 * max(1.0, abs(ci["mean"])))
        self.assertAlmostEqual(ci["half_width"], half, delta=1e-6 * max(1.0, half))
        self.assertLessEqual(ci["low"], ci["mean"])
        self.assertGreaterEqual(ci["high"], ci["mean"])

    def test_one_value_has_no_interval_and_bad_input_is_refused(self) -> None:
        ci = confidence_interval([3.0])
        self.assertEqual((ci["mean"], ci["low"], ci["half_width"]), (3.0, None, None))
        with self.assertRaisesRegex(ValueError, "finite"):
            confidence_interval([1.0, math.inf])
        with self.assertRaisesRegex(ValueError, "degrees of freedom"):
            t_central_probability(1.0, 0)

    def test_metrics_undefined_in_a_run_are_left_out(self) -> None:
        runs = [{"request_throughput": 2.0, "request_goodput": None}, {"request_throughput": 4.0}]
        intervals = repeat_intervals(runs)
        self.assertEqual(list(intervals), ["request_throughput"])
        self.assertEqual(intervals["request_throughput"]["mean"], 3.0)


class RepeatsCommandTest(unittest.TestCase):
    def test_three_repeats_print_and_save_intervals_and_report_renders_them(self) -> None:
        from attention_kv_caceh import cli
        from attention_kv_caceh.report import build_report

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            argv = ["harness", "--num-requests", "6", "--concurrency", "3", "--prefill-ms", "2",
                    "--per-token-ms", "1", "--output-len", "4", "--repeats", "3", "--goodput", "ttft:1000",
                    "--jsonl", str(out / "x.jsonl"), "--summary-json", str(out / "x.json")]  # fmt: skip
            with contextlib.redirect_stdout(io.StringIO()) as printed:
                self.assertEqual(cli.main(argv), 0)
            text = printed.getvalue()
            doc = json.loads((out / "x.json").read_text())
            self.assertEqual(doc["kind"], "serving-harness-repeats")
            self.assertEqual(len(doc["runs"]), 3)
            self.assertEqual(set(doc["intervals"]), set(HEADLINE_METRICS))  # every headline metric
            for metric, ci in doc["intervals"].items():
                values = [run[metric] for run in doc["runs"]]
                self.assertEqual(ci["values"], values)
                self.assertAlmostEqual(ci["half_width"], confidence_interval(values)["half_width"])
                self.assertIn(metric, text)
            self.assertEqual(text.count("repeat "), 3 + 0)  # one line a repeat
            for i in range(3):
                meta = json.loads((out / f"x-r{i}.jsonl.meta.json").read_text())
                self.assertEqual(meta["repeat"], {"index": i, "count": 3, "of": "x.jsonl"})
                self.assertEqual(len((out / f"x-r{i}.jsonl").read_text().splitlines()), 6)
            self.assertFalse((out / "x.jsonl").exists())
            report = build_report(tmp, out / "REPORT.md", plot=False).markdown
            # a repeat cut short by Ctrl-C (its metadata says so) is left out of the intervals
            meta_file = out / "x-r1.jsonl.meta.json"
            meta = json.loads(meta_file.read_text())
            meta_file.write_text(json.dumps(meta | {"status": "interrupted"}))
            cut = build_report(tmp, out / "REPORT2.md", plot=False).markdown
        self.assertIn("### Repeats of `x.jsonl`: 3 of 3 repeats", report)
        ci = doc["intervals"]["request_throughput"]
        self.assertIn(
            f"| request_throughput | 3 | {ci['mean']:.4g} | [{ci['low']:.4g}, {ci['high']:.4g}]", report
        )
        heading = next(line for line in cut.splitlines() if line.startswith("### Repeats of"))
        self.assertIn("2 of 3 repeats", heading)
        self.assertIn("1 left out", heading)
        kept = [doc["runs"][0]["request_throughput"], doc["runs"][2]["request_throughput"]]
        two = confidence_interval(kept)
        self.assertIn(f"| request_throughput | 2 | {two['mean']:.4g} |", cut)

    def test_repeats_out_of_range_exit_2(self) -> None:
        from attention_kv_caceh import cli

        # one rule for harness and sweep: 1 to MAX_REPEATS
        with tempfile.TemporaryDirectory() as tmp:
            for command in (["harness"], ["sweep", "--out-dir", str(Path(tmp) / "sw")]):
                for repeats in (0, MAX_REPEATS + 1):
                    with self.subTest(command=command[0], repeats=repeats):
                        with contextlib.redirect_stderr(io.StringIO()) as err:
                            self.assertEqual(cli.main([*command, "--repeats", str(repeats)]), 2)
                        self.assertIn(f"[1, {MAX_REPEATS}]", err.getvalue())
            self.assertFalse((Path(tmp) / "sw").exists())


if __name__ == "__main__":
    unittest.main()
