"""Sweeps: the knee by the scan's rule, the SLO search against a known threshold, and the command end to
end (files per run, the CSV, the plot, prefix-cache resets, Ctrl-C keeping finished points, usage
errors)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import tempfile
import unittest
from pathlib import Path
from typing import Any
from unittest import mock

from attention_kv_caceh import cli
from attention_kv_caceh.experiments.scan_stats import saturation_point
from attention_kv_caceh.harness import run as harness_run
from attention_kv_caceh.harness.scripted_server import scripted_server_process
from attention_kv_caceh.harness.sweep import find_knee, pareto_points, search_slo_rate

FAST = ["--prefill-ms", "5", "--per-token-ms", "1", "--output-len", "4", "--num-requests", "6"]


def quietly(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["sweep", *argv])
    return code, out.getvalue(), err.getvalue()


def rows_of(points: list[tuple[float, float]], repeats: int = 1) -> list[dict[str, Any]]:
    return [
        {"value": x, "repeat": r, "output_throughput": y * (1 + 0.01 * (r - (repeats - 1) / 2))}
        for x, y in points
        for r in range(repeats)
    ]


class KneeTest(unittest.TestCase):
    def test_knee_is_the_scans_saturation_point_on_the_same_curve(self) -> None:
        curves = [
            [(1, 100.0), (2, 195.0), (4, 380.0), (8, 400.0), (16, 405.0)],
            [(1, 100.0), (2, 200.0), (4, 400.0)],
            [(1, 100.0), (4, 150.0), (16, 300.0)],
        ]
        for curve in curves:
            with self.subTest(curve=curve):
                table = [{"batch_size": x, "positions_per_s": y} for x, y in curve]
                knee = find_knee(rows_of(curve, repeats=3), "concurrency")
                self.assertEqual(knee.value, saturation_point(table))

    def test_rate_axis_leaves_out_inf_and_takes_fractions(self) -> None:
        knee = find_knee(
            rows_of([(0.5, 10.0), (1.0, 20.0), (2.0, 21.0), (float("inf"), 22.0)]), "request_rate"
        )
        self.assertEqual(knee.value, 1.0)


class SloSearchTest(unittest.TestCase):
    def search(self, threshold: float, **kwargs: Any) -> Any:
        tried: list[float] = []

        def try_rate(rate: float) -> tuple[float, dict[str, Any]]:
            tried.append(rate)
            return (1.0 if rate <= threshold else 0.5), {"rate": rate}

        result = search_slo_rate(try_rate, **kwargs)
        self.assertEqual([t.rate for t in result.tries], tried)
        return result

    def test_bisects_to_the_threshold_within_max_runs(self) -> None:
        for threshold, start in ((5.3, 1.0), (0.3, 1.0), (40.0, 2.0)):
            with self.subTest(threshold=threshold):
                result = self.search(threshold, start=start, max_runs=12)
                self.assertEqual(len(result.tries), 12)
                assert result.best_rate is not None and result.lowest_failing_rate is not None
                self.assertLessEqual(result.best_rate, threshold)
                self.assertGreater(result.lowest_failing_rate, threshold)
                self.assertLess(result.lowest_failing_rate - result.best_rate, 0.02 * threshold)
                for t in result.tries:
                    self.assertEqual(t.passed, t.rate <= threshold)

    def test_bracket_and_no_passing_rate(self) -> None:
        result = self.search(3.0, bracket=(2.0, 4.0), max_runs=3)
        self.assertEqual([t.rate for t in result.tries], [2.0, 4.0, 3.0])
        self.assertEqual(result.best_rate, 3.0)
        none = self.search(0.0, start=1.0, max_runs=3)
        self.assertIsNone(none.best_rate)
        self.assertEqual([t.rate for t in none.tries], [1.0, 0.5, 0.25])

    def test_bad_arguments(self) -> None:
        for kwargs in ({"max_runs": 0}, {"start": float("inf")}, {"bracket": (4.0, 2.0)}):
            with self.subTest(kwargs=kwargs), self.assertRaises(ValueError):
                search_slo_rate(lambda r: (1.0, {}), **kwargs)


class ParetoTest(unittest.TestCase):
    def test_the_frontier_is_the_points_no_other_beats_on_both_axes(self) -> None:
        # (value, median TPOT ms -> 1000/TPOT per user, total output tokens/s), two repeats each
        points = {1: (5.0, 190.0), 2: (6.0, 330.0), 4: (10.0, 400.0), 8: (20.0, 390.0), 16: (25.0, 500.0)}
        rows = [
            {"value": v, "repeat": r, "median_tpot_ms": tpot, "output_throughput": total + (10 if r else -10)}
            for v, (tpot, total) in points.items()
            for r in (0, 1)
        ]
        rows.append({"value": 32, "repeat": 0, "median_tpot_ms": None, "output_throughput": 600.0})  # no TPOT
        got = {p.value: p for p in pareto_points(rows)}
        self.assertEqual(sorted(got), [1, 2, 4, 8, 16])
        self.assertAlmostEqual(got[4].per_user, 100.0)
        self.assertAlmostEqual(got[4].total, 400.0)  # the mean of the repeats
        self.assertEqual({v for v, p in got.items() if p.frontier}, {1, 2, 4, 16})  # 8 is beaten by 4
        # brute force: a point is on the frontier iff none is >= on both and > on one
        for p in got.values():
            beaten = any(
                q.per_user >= p.per_user
                and q.total >= p.total
                and (q.per_user > p.per_user or q.total > p.total)
                for q in got.values()
            )
            self.assertEqual(p.frontier, not beaten)

    def test_a_tie_keeps_both_points_on_the_frontier(self) -> None:
        rows = [
            {"value": 1, "repeat": 0, "median_tpot_ms": 10.0, "output_throughput": 100.0},
            {"value": 2, "repeat": 0, "median_tpot_ms": 10.0, "output_throughput": 100.0},
        ]
        self.assertEqual([p.frontier for p in pareto_points(rows)], [True, True])


class SweepCommandTest(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.out = Path(self._tmp.name) / "sweep"

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def read_csv(self) -> list[dict[str, str]]:
        with (self.out / "sweep.csv").open() as f:
            return list(csv.DictReader(f))

    def test_simulated_grid_writes_every_run_and_names_the_knee(self) -> None:
        code, out, _ = quietly(
            [
                *FAST,
                "--server-slots",
                "2",
                "--concurrency",
                "1",
                "2",
                "4",
                "--repeats",
                "2",
                "--out-dir",
                str(self.out),
            ]
        )
        self.assertEqual(code, 0, out)
        rows = self.read_csv()
        self.assertEqual([(r["value"], r["repeat"]) for r in rows], [(c, k) for c in "124" for k in "01"])
        for row in rows:
            name = f"c{row['value']}-r{row['repeat']}"
            self.assertEqual(row["jsonl"], f"{name}.jsonl")
            summary = json.loads((self.out / f"{name}.summary.json").read_text())
            self.assertEqual(summary["config"]["concurrency"], int(row["value"]))
            self.assertEqual(len((self.out / f"{name}.jsonl").read_text().splitlines()), 6)
        doc = json.loads((self.out / "sweep.json").read_text())
        self.assertIn("knee", doc)
        self.assertTrue((self.out / "sweep.png").stat().st_size > 0)
        self.assertEqual((self.out / "pareto.png").read_bytes()[:8], b"\x89PNG\r\n\x1a\n")
        self.assertEqual([p["value"] for p in doc["pareto"]], [1, 2, 4])  # one point per grid value
        self.assertTrue(any(p["frontier"] for p in doc["pareto"]))

    def test_each_point_is_the_harness_run_of_its_settings(self) -> None:
        code, _, _ = quietly([*FAST, "--concurrency", "2", "3", "--seed", "7", "--out-dir", str(self.out)])
        self.assertEqual(code, 0)
        single = Path(self._tmp.name) / "single.jsonl"
        with contextlib.redirect_stdout(io.StringIO()):
            self.assertEqual(
                cli.main(["harness", *FAST, "--concurrency", "3", "--seed", "7", "--jsonl", str(single)]), 0
            )

        def requests(path: Path) -> list[tuple[Any, ...]]:
            lines = [json.loads(x) for x in path.read_text().splitlines()]
            return sorted((x["request_id"], x["requested_prompt_tokens"], x["output_tokens"]) for x in lines)

        self.assertEqual(requests(self.out / "c3-r0.jsonl"), requests(single))
        meta = json.loads((self.out / "c3-r0.jsonl.meta.json").read_text())
        single_meta = json.loads(single.with_name("single.jsonl.meta.json").read_text())
        drop = {"label", "smoke_test"}
        self.assertEqual(
            {k: v for k, v in meta["config"].items() if k not in drop},
            {k: v for k, v in single_meta["config"].items() if k not in drop},
        )

    def test_interrupt_keeps_finished_points(self) -> None:
        real = harness_run.run_harness
        calls = [0]

        async def second_interrupts(config: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 2:
                raise KeyboardInterrupt
            return await real(config, **kwargs)

        with mock.patch("attention_kv_caceh.harness.sweep_run.run_harness", second_interrupts):
            code, _, err = quietly([*FAST, "--concurrency", "1", "2", "4", "--out-dir", str(self.out)])
        self.assertEqual(code, 130)
        self.assertIn("interrupted", err)
        self.assertEqual([r["value"] for r in self.read_csv()], ["1"])
        self.assertTrue((self.out / "c1-r0.summary.json").is_file())
        self.assertTrue(json.loads((self.out / "sweep.json").read_text())["interrupted"])

    def test_interrupt_keeps_the_records_the_interrupted_point_finished(self) -> None:
        real = harness_run.run_harness
        calls = [0]

        async def second_interrupted_after_its_records(config: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            result = await real(config, **kwargs)
            if calls[0] == 2:
                raise KeyboardInterrupt  # Ctrl-C once the point's requests finished, before it ends
            return result

        with mock.patch(
            "attention_kv_caceh.harness.sweep_run.run_harness", second_interrupted_after_its_records
        ):
            code, _, err = quietly([*FAST, "--concurrency", "1", "2", "4", "--out-dir", str(self.out)])
        self.assertEqual(code, 130)
        lines = (self.out / "c2-r0.jsonl").read_text().splitlines()
        meta = json.loads((self.out / "c2-r0.jsonl.meta.json").read_text())
        self.assertEqual((meta["status"], meta["records"]), ("interrupted", len(lines)))
        self.assertGreater(len(lines), 0)
        self.assertTrue(json.loads((self.out / "c2-r0.summary.json").read_text())["interrupted"])
        self.assertIn(str(len(lines)), err)
        doc = json.loads((self.out / "sweep.json").read_text())
        self.assertEqual(doc["interrupted_run"], {"jsonl": "c2-r0.jsonl", "records": len(lines)})

    def test_usage_errors_exit_2_before_any_file(self) -> None:
        for argv in (
            ["--concurrency", "1", "2", "--request-rate", "1", "2"],
            ["--slo", "ttft:100", "--goodput", "ttft:100"],
            ["--slo", "ttfx:100"],
            ["--repeats", "0"],
            ["--slo", "ttft:100", "--repeats", "2"],
            ["--workload", "multi-turn", "--turns", "4", "--num-requests", "6"],
            ["--concurrency", "1", "2", "1"],  # a point given twice: its runs would share file names
            ["--request-rate", "1", "1"],
            ["--slo", "ttft:100", "--request-rate", "5", "1"],  # LOW HIGH with LOW > HIGH
            ["--slo", "ttft:100", "--request-rate", "2", "2"],
        ):
            with self.subTest(argv=argv):
                code, _, err = quietly([*argv, "--out-dir", str(self.out)])
                self.assertEqual(code, 2)
                self.assertEqual(len(err.strip().splitlines()), 1)
                self.assertFalse(self.out.exists())

    def test_empty_out_dir_is_a_usage_error(self) -> None:
        sweep = mock.Mock(side_effect=AssertionError("the sweep started"))
        with mock.patch("attention_kv_caceh.cli.sweep._sweep", sweep):
            code, _, err = quietly([*FAST, "--out-dir", ""])
        self.assertEqual(code, 2)
        self.assertEqual(len(err.strip().splitlines()), 1)
        sweep.assert_not_called()

    def test_closed_stdout_stops_quietly_and_keeps_the_finished_points(self) -> None:
        class ClosedAfterFirstPoint(io.StringIO):
            def write(self, s: str) -> int:
                if "c2-r0" in s or getattr(self, "tripped", False):
                    self.tripped = True
                    raise BrokenPipeError
                return super().write(s)

        err = io.StringIO()
        with contextlib.redirect_stdout(ClosedAfterFirstPoint()), contextlib.redirect_stderr(err):
            code = cli.main(["sweep", *FAST, "--concurrency", "1", "2", "4", "--out-dir", str(self.out)])
        self.assertEqual((code, err.getvalue()), (1, ""))
        self.assertEqual([r["value"] for r in self.read_csv()], ["1", "2"])
        self.assertEqual(
            [r["value"] for r in json.loads((self.out / "sweep.json").read_text())["rows"]], [1, 2]
        )
        self.assertFalse((self.out / "c4-r0.jsonl").exists())

    def test_slo_search_on_the_simulated_server(self) -> None:
        # 2 slots of 5 + 3 * 1 ms a request: ~250 req/s at most; a TTFT objective of 15 ms fails when queues grow
        code, out, _ = quietly(
            [*FAST, "--num-requests", "20", "--server-slots", "2", "--concurrency", "64", "--slo", "ttft:15",
             "--request-rate", "20", "--max-runs", "4", "--out-dir", str(self.out)]
        )  # fmt: skip
        self.assertEqual(code, 0, out)
        slo = json.loads((self.out / "sweep.json").read_text())["slo"]
        self.assertEqual(len(slo["tries"]), 4)
        self.assertEqual(len(self.read_csv()), 4)
        passing = [t["rate"] for t in slo["tries"] if t["passed"]]
        failing = [t["rate"] for t in slo["tries"] if not t["passed"]]
        self.assertEqual(slo["best_rate"], max(passing) if passing else None)
        self.assertEqual(slo["lowest_failing_rate"], min(failing) if failing else None)
        for t in slo["tries"]:
            self.assertEqual(t["passed"], t["good_fraction"] >= 0.99)

    def test_scripted_server_resets_and_counters_per_point(self) -> None:
        with scripted_server_process(2.0, 0.5) as url:
            code, out, _ = quietly(
                ["--backend", "openai-completions", "--base-url", url, "--num-requests", "8", "--output-len", "3",
                 "--workload", "shared-prefix", "--num-prefixes", "2", "--prefix-len", "8", "--concurrency", "1", "2",
                 "--server-metrics-interval", "0", "--out-dir", str(self.out)]
            )  # fmt: skip
        self.assertEqual(code, 0, out)
        rows = self.read_csv()
        self.assertEqual([r["prefix_cache_reset"] for r in rows], ["yes", "yes"])
        # the cache is emptied before each point, so both points find the same hits
        self.assertEqual(rows[0]["prefix_cache_hits"], rows[1]["prefix_cache_hits"])
        self.assertGreater(int(rows[0]["prefix_cache_hits"]), 0)


if __name__ == "__main__":
    unittest.main()
