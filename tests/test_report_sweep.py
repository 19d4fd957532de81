"""The report over a sweep's folder: sweep.csv recognised and read strictly, its table, the knee the sweep
named, an SLO search's tries judged again, and bad rows listed as problems."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import tempfile
import unittest
from pathlib import Path
from typing import Any

from attention_kv_caceh import cli
from attention_kv_caceh.files import write_csv_atomic, write_json_atomic
from attention_kv_caceh.harness.sweep import CSV_FIELDS, Axis, sweep_row
from attention_kv_caceh.report import build_report
from tests.test_report import md_table, section

FAST = ["--prefill-ms", "5", "--per-token-ms", "1", "--output-len", "4", "--num-requests", "6"]


def summary(output_throughput: float, good: int | None = None) -> dict[str, Any]:
    """A harness summary with the keys `sweep_row` reads (10 requests, all completed)."""
    out: dict[str, Any] = {key: 1.5 for key in CSV_FIELDS if key.endswith("_ms")}
    out.update(
        completed=10,
        failed=0,
        duration=2.0,
        num_requests=10,
        good_requests=good,
        request_throughput=5.0,
        output_throughput=output_throughput,
    )
    return out


def row(
    axis: Axis, value: float, throughput: float, repeat: int = 0, good: int | None = None
) -> dict[str, Any]:
    concurrency, rate = (int(value), float("inf")) if axis == "concurrency" else (4, value)
    name = f"p{value:g}-r{repeat}.jsonl"
    return sweep_row(axis, concurrency, rate, repeat, summary(throughput, good), reset="-", jsonl=name)


class SweepReportTest(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.folder = Path(self._tmp.name) / "sweep"
        self.folder.mkdir()
        self.out = Path(self._tmp.name) / "report.md"

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def report(self) -> tuple[str, dict[str, str]]:
        result = build_report(self.folder, self.out, plot=False)
        return result.markdown, {Path(p.path).name: p.problem for p in result.problems}

    def write(self, rows: list[dict[str, Any]], doc: dict[str, Any] | None = None) -> None:
        write_csv_atomic(self.folder / "sweep.csv", rows, CSV_FIELDS)
        if doc is not None:
            write_json_atomic(self.folder / "sweep.json", doc)

    def test_every_column_is_read(self) -> None:
        from attention_kv_caceh.report import sweep as report_sweep

        self.assertEqual(set(report_sweep._COLUMNS), set(CSV_FIELDS))  # pyright: ignore[reportPrivateUsage]

    def test_sweep_command_output_is_reported_with_its_knee(self) -> None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            argv = [*FAST, "--server-slots", "2", "--concurrency", "1", "2", "4", "--repeats", "2"]
            code = cli.main(["sweep", *argv, "--out-dir", str(self.folder)])
        self.assertEqual(code, 0, out.getvalue())
        markdown, problems = self.report()
        self.assertNotIn("sweep.csv", problems)
        self.assertNotIn("sweep.json", problems)
        text = section(markdown, "sweep.csv")
        table = md_table(text, "concurrency")
        with (self.folder / "sweep.csv").open() as f:
            written = list(csv.DictReader(f))
        self.assertEqual(
            [(r["concurrency"], r["repeat"]) for r in table], [(r["value"], r["repeat"]) for r in written]
        )
        knee = json.loads((self.folder / "sweep.json").read_text())["knee"]
        self.assertIn(knee["verdict"], text)  # the same rule over the same rows
        sources = next(line for line in markdown.splitlines() if line.startswith("Recomputed"))
        self.assertIn("`sweep.csv`", sources)

    def test_slo_tries_are_judged_again(self) -> None:
        rows = [row("request_rate", r, 100.0, good=g) for r, g in ((1, 10), (2, 10), (4, 5), (3, 9))]
        slo: dict[str, Any] = {"objectives_ms": {"ttft": 100.0}, "pass_fraction": 0.9, "best_rate": 3.0}
        self.write(rows, {"kind": "serving-sweep", "axis": "request_rate", "slo": slo})
        markdown, problems = self.report()
        self.assertEqual(problems, {})
        tries = md_table(section(markdown, "sweep.csv"), "try")
        self.assertEqual(
            [(r["rate (req/s)"], r["verdict"]) for r in tries],
            [("1", "pass"), ("2", "pass"), ("4", "fail"), ("3", "pass")],
        )
        # a summary that disagrees with its rows is named
        self.write(rows, {"kind": "serving-sweep", "axis": "request_rate", "slo": {**slo, "best_rate": 4.0}})
        self.assertIn("sweep.json", self.report()[1])

    def test_bad_rows_are_problems_of_the_file(self) -> None:
        good = [row("concurrency", c, 10.0 * c) for c in (1, 2, 4)]
        cases: dict[str, list[dict[str, Any]]] = {
            "not a number": [good[0], {**good[1], "failed": "x"}],
            "negative count": [good[0], {**good[1], "completed": -1}],
            "fraction above 1": [good[0], {**good[1], "good_fraction": 1.5}],
            "unknown axis": [good[0], {**good[1], "axis": "prompt_len"}],
            "value not its axis'": [good[0], {**good[1], "value": 3}],
            "two axes": [good[0], row("request_rate", 2.0, 10.0)],
            "duplicate": [good[0], dict(good[0])],
            "nan latency": [good[0], {**good[1], "p99_ttft_ms": float("nan")}],
        }
        for why, rows in cases.items():
            with self.subTest(why):
                self.write(rows)
                markdown, problems = self.report()
                self.assertIn("row 2", problems.get("sweep.csv", ""))
                self.assertNotIn("### Sweep", markdown)
        self.write(good)
        markdown, problems = self.report()
        self.assertEqual(problems, {})
        self.assertIn("### Sweep", markdown)


if __name__ == "__main__":
    unittest.main()
