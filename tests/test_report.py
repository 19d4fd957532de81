"""The report recomputes from hand-made raw files with known percentiles, and survives bad files."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from attention_kv_caceh import cli
from attention_kv_caceh.experiments.cache_growth import CacheGrowthConfig
from attention_kv_caceh.experiments.cache_growth_stats import CacheMemoryRow, CacheStepSample
from attention_kv_caceh.experiments.views import VIEW_TABLE_COLUMNS, run_views
from attention_kv_caceh.files import write_csv_atomic, write_json_atomic
from attention_kv_caceh.harness.records import STATUS_OK, RequestRecord
from attention_kv_caceh.report import (
    FileProblem,
    build_report,
    classify_header,
    flag_outliers,
    parse_rows,
    planned_plots,
)
from attention_kv_caceh.report import build as report
from attention_kv_caceh.report.views import views_markdown
from attention_kv_caceh.timing import Sample

SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(Sample))
ENV = {"environment": {"cpu_model": "Test CPU", "numpy": "9.9", "blas": [], "thread_env": {}}}

# B -> raw samples (ms). B=1: 1..20 -> P50 10.5, P95 19.05. B=2: 2, 4, ..., 40 -> P50 21, P95 38.1.
# B=4: nineteen 1.0 and one 100.0 -> P50 1, P95 = 1 + 0.05 * 99 = 5.95; 100 > 2 x 5.95 is an outlier.
SCAN = {
    1: [float(i) for i in range(1, 21)],
    2: [2.0 * i for i in range(1, 21)],
    4: [1.0] * 19 + [100.0],
}


def write_scan(folder: Path, name: str = "benchmark.csv", meta: bool = True) -> Path:
    rows = [
        dataclasses.asdict(Sample(batch_size=b, sequence_length=128, elapsed_ms=v, repeat=i))
        for b, values in SCAN.items()
        for i, v in enumerate(values)
    ]
    path = write_csv_atomic(folder / name, rows, SAMPLE_FIELDS)
    if meta:
        write_json_atomic(
            Path(f"{path}.meta.json"),
            {
                **ENV,
                "config": {},
                "probe_samples_ms": {"1": [1.0, 1.0], "2": [2.0], "4": [4.0]},
                "kv_bytes_per_step": {"1": 1_000_000, "2": 2_000_000, "4": 4_000_000},
            },
        )
    return path


def write_cache(folder: Path) -> None:
    """Timed rows on exact lines (dynamic 0.1 + 0.01 T ms, preallocated 0.1 + 0.002 T) and memory rows."""
    n = 64
    params = CacheGrowthConfig(steps=n, batch_size=1, num_heads=1, num_kv_heads=1, head_dim=4).params()
    timed = [
        CacheStepSample(
            cache=kind,
            step=t - 1,
            sequence_length=t,
            elapsed_ms=0.1 + slope * t,
            repeat=r,
            **params,
        )
        for kind, slope in (("dynamic", 0.01), ("preallocated", 0.002))
        for r in range(2)
        for t in range(1, n + 1)
    ]
    memory_params = {k: v for k, v in params.items() if k != "warmup"}
    memory = [
        CacheMemoryRow(
            cache=kind,
            step=t - 1,
            sequence_length=t,
            new_buffer_bytes=32 * t if kind == "dynamic" else 0,
            append_peak_bytes=16 * t if kind == "dynamic" else 500,
            step_peak_bytes=16 * t + 100,
            retained_bytes=32,
            traced_bytes=32 * t,
            cache_nbytes=32 * t if kind == "dynamic" else 32 * n,
            theoretical_bytes=32 * t,
            **memory_params,
        )
        for kind in ("dynamic", "preallocated")
        for t in range(1, n + 1)
    ]
    path = write_csv_atomic(
        folder / "growth.csv",
        (dataclasses.asdict(s) for s in timed),
        [f.name for f in dataclasses.fields(CacheStepSample)],
    )
    write_json_atomic(Path(f"{path}.meta.json"), {**ENV, "config": {}})
    write_csv_atomic(
        folder / "growth-mem.csv",
        (dataclasses.asdict(m) for m in memory),
        [f.name for f in dataclasses.fields(CacheMemoryRow)],
    )


def section(text: str, name: str) -> str:
    """The report's section of the raw file `name` (from its `### ... `name`` heading to the next)."""
    start = re.search(rf"^### .*`{re.escape(name)}`", text, re.MULTILINE).start()  # type: ignore[union-attr]
    end = text.find("\n### ", start)
    return text[start : end if end >= 0 else len(text)]


def md_rows(text: str) -> list[list[str]]:
    """Every row of every Markdown table in `text` (header rows included, `| --- |` rules left out)."""
    rows = [
        [c.strip() for c in line.strip()[1:-1].split(" | ")]
        for line in text.splitlines()
        if line.startswith("| ")
    ]
    return [r for r in rows if any(c.strip("- ") for c in r)]


def md_table(text: str, first_header: str, having: str = "") -> list[dict[str, str]]:
    """The rows of the first table in `text` whose header starts with `first_header` (and has a column
    `having`, when given), as header -> cell."""
    rows = md_rows(text)
    i = next(i for i, r in enumerate(rows) if r[0] == first_header and (not having or having in r))
    header, out = rows[i], []
    for row in rows[i + 1 :]:
        if len(row) != len(header) or row[0] == first_header:
            break
        out.append(dict(zip(header, row, strict=True)))
    return out


class HelpersTest(unittest.TestCase):
    def test_classify_header_by_columns_not_name(self) -> None:
        self.assertEqual(classify_header(list(reversed(SAMPLE_FIELDS))), "scan")
        self.assertEqual(classify_header(list(VIEW_TABLE_COLUMNS)), "views")
        self.assertEqual(classify_header([f.name for f in dataclasses.fields(CacheStepSample)]), "cache")
        self.assertEqual(
            classify_header(["batch_size", "p50_ms", "per_sequence_ms", "positions_per_s"]),
            "derived:scan summary",
        )
        self.assertIsNone(classify_header([*SAMPLE_FIELDS, "extra"][1:]))
        self.assertIsNone(classify_header([]))

    def test_flag_outliers(self) -> None:
        self.assertEqual(flag_outliers(SCAN[4]), [19])
        self.assertEqual(flag_outliers(SCAN[1]), [])
        self.assertEqual(flag_outliers([]), [])

    def test_parse_rows_names_row_and_column(self) -> None:
        good = {name: "1" for name in SAMPLE_FIELDS} | {"dtype": "float32", "cache": "dynamic", "model": ""}
        parsed = parse_rows(Sample, [good])
        self.assertEqual(parsed[0].elapsed_ms, 1.0)
        with self.assertRaisesRegex(ValueError, r"row 2: column 'elapsed_ms': 'fast' is not a number"):
            parse_rows(Sample, [good, good | {"elapsed_ms": "fast"}])
        with self.assertRaisesRegex(ValueError, r"row 1: column 'repeat': '1.5' is not an integer"):
            parse_rows(Sample, [good | {"repeat": "1.5"}])
        with self.assertRaisesRegex(ValueError, "not finite"):
            parse_rows(Sample, [good | {"elapsed_ms": "nan"}])

    def test_the_environment_card_gives_the_load_measured_at_start(self) -> None:
        from attention_kv_caceh.report.environment import environment_card

        card = environment_card(
            {
                "a.csv.meta.json": {"environment": {"others_busy_cpus": 1.25}},
                "b.csv.meta.json": {"environment": {"others_busy_cpus": None}},
                "c.csv.meta.json": {"environment": {}},
            }
        )
        row = next(line for line in card.splitlines() if "busy CPUs at start" in line)
        self.assertEqual([c.strip() for c in row.strip("|").split("|")][1:], ["1.25", "not measured", "?"])


class ReportTest(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.folder = Path(self._tmp.name, "results")
        self.folder.mkdir()
        self.out = self.folder / "REPORT.md"

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def report(self, plot: bool = False) -> tuple[str, list[FileProblem]]:
        result = build_report(self.folder, self.out, plot=plot)
        self.sources = result.sources  # the raw files reported
        return result.markdown, result.problems

    def test_scan_percentiles_recomputed_from_raw_samples(self) -> None:
        write_scan(self.folder)
        # A summary file with wrong numbers: it must be named and ignored.
        write_csv_atomic(
            self.folder / "benchmark-summary.csv",
            [{"batch_size": 1, "p50_ms": 777.0, "per_sequence_ms": 777.0, "positions_per_s": 1.0}],
            ["batch_size", "p50_ms", "per_sequence_ms", "positions_per_s"],
        )
        text, problems = self.report()
        self.assertEqual(problems, [])
        table = {int(r["B"]): r for r in md_table(section(text, "benchmark.csv"), "B")}
        self.assertEqual(sorted(table), sorted(SCAN))
        for b, values in SCAN.items():
            p50, p95 = np.percentile(values, [50, 95])
            expected = {"n": 20, "P50 ms": p50, "P95 ms": p95, "min ms": min(values), "max ms": max(values)}
            expected |= {"per-seq ms": p50 / b, "positions/s": b * 128 / (p50 / 1000)}
            for column, value in expected.items():
                self.assertTrue(math.isclose(float(table[b][column]), value, rel_tol=1e-3), (b, column))
        # KV GB/s at B=1: 1e6 bytes / 10.5 ms = 0.09524 GB/s; probe 1e6 / 1 ms = 1 GB/s.
        self.assertEqual(
            [table[1][c] for c in ("KV GB/s", "probe GB/s", "KV / probe")], ["0.09524", "1", "0.09524"]
        )
        self.assertNotIn("777", text)
        self.assertIn("`benchmark-summary.csv`", text.split("## Summary files not used")[1])
        # the outlier is flagged with its B, repeat and time, and kept: max is 100
        self.assertEqual(re.findall(r"B=(\d+) repeat (\d+): ([\d.]+) ms", text), [("4", "19", "100")])
        self.assertEqual(re.findall(r"Saturated at B = (\d+)", text), ["1"])
        # every request waits for the whole step: B = 2's step is 21 / 10.5 = 2x the B = 1 step
        self.assertEqual(re.findall(r"waits ([\d.]+)x", text), ["2.00", "0.10"])
        card = md_rows(text.split("## Environment")[1].split("## Results")[0])
        self.assertIn(["CPU", "Test CPU"], card)

    def test_cache_run_fits_and_memory(self) -> None:
        write_cache(self.folder)
        text, problems = self.report()
        self.assertEqual(problems, [])
        fits = {r["cache"]: r for r in md_table(text, "cache", having="slope us/position")}
        for kind, slope in (("dynamic", 10.0), ("preallocated", 2.0)):  # exact lines: R^2 = 1
            row = fits[kind]
            self.assertEqual(
                [float(row[c]) for c in ("slope us/position", "intercept ms", "R^2")], [slope, 0.1, 1]
            )
        # totals: sum over T=1..64 of 0.1 + 0.01 T = 6.4 + 20.8 = 27.2 ms; 6.4 + 4.16 = 10.56 ms.
        self.assertEqual(re.findall(r"\*\*([\d.]+)x\*\*", text), [f"{27.2 / 10.56:.2f}"])
        self.assertIn("The Dynamic cache's slope is 5.0x", text)
        self.assertIn("from T = 17", text)
        memory = {r["cache"]: r for r in md_table(text, "cache", having="B/position (traced)")}
        # append_peak_bytes = 16 T, new_buffer_bytes = 32 T (write_cache)
        self.assertEqual(float(memory["dynamic"]["B/position (traced)"]), 16)
        self.assertEqual(float(memory["dynamic"]["new buffers B/position"]), 32)
        self.assertIn("Outliers (> 2 x the P95 of its cache in windows of 1 positions): none.", text)

    def test_a_cache_pass_cut_part_way_is_named(self) -> None:
        write_cache(self.folder)
        growth = self.folder / "growth.csv"
        lines = growth.read_text(encoding="utf-8").splitlines(keepends=True)
        growth.write_text("".join(lines[:-10]), encoding="utf-8")  # the last pass lost 10 steps
        text, problems = self.report()
        self.assertEqual(problems, [])
        self.assertIn("cut part-way (rows kept, left out of the N-step totals): preallocated repeat 1.", text)

    def test_views_round_trip(self) -> None:
        rows = run_views()
        path = write_csv_atomic(
            self.folder / "v.csv", (dataclasses.asdict(r) for r in rows), VIEW_TABLE_COLUMNS
        )
        write_json_atomic(Path(f"{path}.meta.json"), ENV)
        text, _ = self.report()
        self.assertIn(views_markdown(rows), text)

    def test_serving_jsonl_summarized(self) -> None:
        ms = 1_000_000
        records: list[dict[str, Any]] = []
        for i in range(3):  # TTFT 10, 20, 30 ms; two gaps of 1 and 3 ms each
            first = (1 + 10 * (i + 1)) * ms
            record = RequestRecord(
                request_id=i,
                arrival_ns=0,
                prompt_tokens=4,
                sent_ns=1 * ms,
                first_token_ns=first,
                token_times_ns=[first, first + 1 * ms, first + 4 * ms],
                tokens_per_event=[1, 1, 1],
                finish_ns=first + 4 * ms,
                stream_end_ns=first + 4 * ms,
                output_tokens=3,
                status=STATUS_OK,
            )
            records.append(record.to_json())
        failed = RequestRecord(request_id=3, arrival_ns=0, prompt_tokens=4, status="http_error")
        lines = [json.dumps(r) for r in [*records, failed.to_json()]] + ["{broken", '{"ttft_ms": 1}']
        (self.folder / "serve.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        text, problems = self.report()
        self.assertIn("4 request(s), 3 completed, failures: http_error: 1", text)
        metrics = {r["metric"]: r for r in md_table(text, "metric")}
        self.assertEqual([metrics["TTFT (first token - sent)"][c] for c in ("n", "P50 ms")], ["3", "20"])
        self.assertEqual([metrics["ITL"][c] for c in ("n", "P50 ms")], ["6", "2"])  # gaps 1, 3 ms x 3
        self.assertEqual([re.match(r"line (\d+):", p.problem)[1] for p in problems], ["5", "6"])  # type: ignore[index]

    def test_bad_files_are_named_and_the_rest_reported(self) -> None:
        write_scan(self.folder, "good.csv")
        bad = write_scan(self.folder, "bad.csv")
        lines = bad.read_text(encoding="utf-8").splitlines()
        lines[3] = lines[3].replace(",128,", ",128x,")
        bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
        write_scan(self.folder, "nometa.csv", meta=False)
        (self.folder / "unknown.csv").write_text("x,y\n1,2\n", encoding="utf-8")
        (self.folder / "empty.csv").write_text("", encoding="utf-8")
        header_only = ",".join(SAMPLE_FIELDS) + "\n"
        (self.folder / "header-only.csv").write_text(header_only, encoding="utf-8")
        (self.folder / "ragged.csv").write_text(header_only + "1,2\n", encoding="utf-8")
        (self.folder / "good.csv.meta.json").write_text("{not json", encoding="utf-8")

        text, problems = self.report()
        by_file = {Path(p.path).name: p.problem for p in problems}
        expected = ["bad.csv", "nometa.csv.meta.json", "good.csv.meta.json", "unknown.csv", "empty.csv"]
        self.assertEqual(sorted(by_file), sorted([*expected, "header-only.csv", "ragged.csv"]))
        # each problem names the row and column at fault where there is one
        self.assertRegex(by_file["bad.csv"], r"\brow 3\b.*'sequence_length'.*'128x'")
        self.assertRegex(by_file["ragged.csv"], r"\brow 1\b.*'elapsed_ms'")
        # The good files are still reported, and every problem is listed in the report itself.
        self.assertIn("good.csv", self.sources)
        self.assertIn("nometa.csv", self.sources)
        self.assertNotIn("bad.csv", self.sources)
        self.assertIn("## Problems with files", text)
        for name in by_file:
            self.assertIn(name, text.split("## Problems with files")[1])

    def test_truncated_last_row_keeps_the_complete_rows(self) -> None:
        path = write_scan(self.folder, "cut.csv")
        text = path.read_text(encoding="utf-8")
        path.write_text(text[: text.rstrip().rindex(",")], encoding="utf-8")  # cut inside the last row
        report, problems = self.report()
        rows = 3 * 20
        self.assertEqual(
            [p.problem for p in problems],
            [f"row {rows} is incomplete (truncated file?); {rows - 1} complete rows used"],
        )
        self.assertIn("cut.csv", self.sources)
        counts = {r["B"]: int(r["n"]) for r in md_table(report, "B")}
        self.assertEqual(counts, {"1": 20, "2": 20, "4": 19})  # the B = 4 group lost its last sample
        self.assertIn("truncated file?", report.split("## Problems with files")[1])

    def test_a_short_row_before_the_last_still_rejects_the_file(self) -> None:
        path = write_scan(self.folder, "cut.csv")
        lines = path.read_text(encoding="utf-8").splitlines()
        lines[5] = lines[5][: lines[5].rindex(",")]
        path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:10], encoding="utf-8")
        _report, problems = self.report()
        self.assertEqual(len(problems), 1)
        self.assertIn("row 5: column", problems[0].problem)
        self.assertEqual(self.sources, [])

    def test_a_last_row_without_its_line_break_is_cut_even_when_it_parses(self) -> None:
        path = write_scan(self.folder, "cut.csv")
        lines = path.read_text(encoding="utf-8").splitlines()
        lines[-1] = lines[-1].rsplit(",", 1)[0] + ",12"
        path.write_text("\n".join(lines)[:-1], encoding="utf-8")  # `...,12` cut to `...,1`
        report, problems = self.report()
        rows = 3 * 20
        self.assertEqual(
            [p.problem for p in problems],
            [f"row {rows} is incomplete (truncated file?); {rows - 1} complete rows used"],
        )
        self.assertEqual({r["B"]: int(r["n"]) for r in md_table(report, "B")}, {"1": 20, "2": 20, "4": 19})

    def test_out_of_range_values_reject_the_file_and_the_rest_is_reported(self) -> None:
        write_scan(self.folder, "good.csv")
        for name, old, new in (
            ("zero-batch.csv", "4,128,", "0,128,"),  # B = 0 divided the per-sequence cost by zero
            ("negative-time.csv", ",1.0,", ",-2.475,"),
            ("zero-length.csv", "1,128,", "1,0,"),
        ):
            path = write_scan(self.folder, name)
            text = path.read_text(encoding="utf-8")
            path.write_text(text.replace(old, new, 1), encoding="utf-8")
        write_cache(self.folder)
        growth = self.folder / "growth.csv"
        lines = growth.read_text(encoding="utf-8").splitlines()
        header = lines[0].split(",")
        cells = lines[2].split(",")
        cells[header.index("repeat")] = "-1"
        lines[2] = ",".join(cells)
        growth.write_text("\n".join(lines) + "\n", encoding="utf-8")
        text, problems = self.report()
        by_file = {Path(p.path).name: p.problem for p in problems}
        self.assertEqual(
            by_file,
            {
                "zero-batch.csv": "malformed scan CSV: row 41: column 'batch_size': '0' must be >= 1",
                "negative-time.csv": "malformed scan CSV: row 1: column 'elapsed_ms': '-2.475' must be > 0",
                "zero-length.csv": "malformed scan CSV: row 1: column 'sequence_length': '0' must be >= 1",
                "growth.csv": "malformed cache CSV: row 2: column 'repeat': '-1' must be >= 0",
            },
        )
        self.assertIn("good.csv", self.sources)
        self.assertEqual(text.count("### Batch-size scan"), 1)
        with self.assertRaisesRegex(ValueError, "row 1: column 'head_dim': '0' must be >= 1"):
            parse_rows(Sample, [{**dataclasses.asdict(Sample(1, 1, 1.0, 0)), "head_dim": "0"}])

    def test_an_unexpected_error_in_one_file_is_listed_and_the_rest_reported(self) -> None:
        write_scan(self.folder, "a.csv")
        write_scan(self.folder, "b.csv")
        write_cache(self.folder)
        real = report.scan_run_markdown

        def scan_run_markdown(name: str, *args: Any) -> Any:
            if name == "a.csv":
                raise ZeroDivisionError("float division by zero")
            return real(name, *args)

        def cache_run_markdown(*_: Any) -> Any:
            raise KeyError("dynamic")

        with (
            mock.patch.object(report, "scan_run_markdown", scan_run_markdown),
            mock.patch.object(report, "cache_run_markdown", cache_run_markdown),
        ):
            _text, problems = self.report()
        self.assertEqual(
            [(Path(p.path).name, p.problem) for p in problems],
            [
                ("a.csv", "cannot report this scan CSV: ZeroDivisionError: float division by zero"),
                ("growth.csv", "cannot summarize the cache run: KeyError: 'dynamic'"),
            ],
        )
        self.assertIn("b.csv", self.sources)

    def test_a_byte_order_mark_before_the_header_is_ignored(self) -> None:
        path = write_scan(self.folder, "excel.csv")
        path.write_text(path.read_text(encoding="utf-8"), encoding="utf-8-sig")
        self.assertTrue(path.read_bytes().startswith(b"\xef\xbb\xbf"))
        _text, problems = self.report()
        self.assertEqual(problems, [])
        self.assertIn("excel.csv", self.sources)
        self.assertEqual([p.name for p in planned_plots(self.folder, self.out)], ["REPORT-excel.png"])

    def test_broken_links_and_folders_named_like_raw_files_are_listed(self) -> None:
        write_scan(self.folder, "good.csv")
        (self.folder / "broken.csv").symlink_to(self.folder / "nowhere.csv")
        (self.folder / "sub.csv").mkdir()
        (self.folder / "runs.jsonl").mkdir()
        text, problems = self.report()
        self.assertEqual(
            [(Path(p.path).name, p.problem) for p in problems],
            [
                ("broken.csv", "skipped: a broken symbolic link"),
                ("runs.jsonl", "skipped: a folder"),
                ("sub.csv", "skipped: a folder"),
            ],
        )
        self.assertIn("good.csv", self.sources)
        self.assertIn("sub.csv`: skipped: a folder", text)

    def test_serving_metadata_in_the_card(self) -> None:
        ms = 1_000_000
        record = RequestRecord(
            request_id=0,
            arrival_ns=0,
            prompt_tokens=4,
            sent_ns=ms,
            first_token_ns=10 * ms,
            token_times_ns=[10 * ms, 12 * ms],
            tokens_per_event=[1, 1],
            finish_ns=12 * ms,
            stream_end_ns=12 * ms,
            output_tokens=2,
            status=STATUS_OK,
        )
        for name in ("a.jsonl", "b.jsonl"):
            (self.folder / name).write_text(json.dumps(record.to_json()) + "\n", encoding="utf-8")
        serving_env = {"environment": {**ENV["environment"], "cpu_model": "Serving CPU"}, "config": {}}
        write_json_atomic(self.folder / "a.jsonl.meta.json", serving_env)
        text, problems = self.report()
        card = text.split("## Environment")[1].split("## Results")[0]
        self.assertIn("| a.jsonl |", card)
        self.assertIn("| Serving CPU |", card)
        self.assertIn("No metadata for `b.jsonl`", card)
        self.assertEqual(problems, [])

    def test_plots_beside_the_report(self) -> None:
        write_scan(self.folder)
        write_cache(self.folder)
        result = build_report(self.folder, self.out)
        self.assertEqual(sorted(p.name for p in result.plots), ["REPORT-benchmark.png", "REPORT-growth.png"])
        for p in result.plots:
            self.assertEqual(p.read_bytes()[:4], b"\x89PNG")
            self.assertIn(f"]({p.name})", result.markdown)

    def test_invalid_arguments(self) -> None:
        with self.assertRaisesRegex(ValueError, "not a folder"):
            build_report(self.folder / "missing", self.out)
        with self.assertRaisesRegex(ValueError, r"\.md"):
            build_report(self.folder, self.folder / "report.txt")


class RecordedKindTest(unittest.TestCase):
    """The run's recorded `kind` decides how a raw CSV is read; the header only when none is recorded."""

    def kind_meta(self, path: Path, kind: str | None) -> None:
        meta = json.loads(Path(f"{path}.meta.json").read_text(encoding="utf-8"))
        meta.pop("kind", None)
        if kind is not None:
            meta["kind"] = kind
        write_json_atomic(Path(f"{path}.meta.json"), meta)

    def test_the_recorded_kind_decides_and_must_agree_with_the_header(self) -> None:
        for kind, reported in (
            ("batch-size-scan", True),
            (None, True),
            ("cache-growth", False),
            ("x", False),
        ):
            with self.subTest(kind=kind), tempfile.TemporaryDirectory() as tmp:
                path = write_scan(Path(tmp))
                self.kind_meta(path, kind)
                result = build_report(tmp, Path(tmp, "r.md"), plot=False)
                self.assertEqual(result.sources == ["benchmark.csv"], reported, result.problems)
                about = [p.problem for p in result.problems if p.path == str(path)]
                self.assertEqual(bool(about), not reported, about)
                if kind is not None and not reported:
                    self.assertIn(repr(kind), about[0])


class ReportCommandTest(unittest.TestCase):
    def test_writes_report_and_lists_problems(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            write_scan(folder)
            (folder / "junk.csv").write_text("a\n1\n", encoding="utf-8")
            out, err = io.StringIO(), io.StringIO()
            with redirect_stdout(out), redirect_stderr(err):
                code = cli.main(["report", "--results", tmp, "--out", f"{tmp}/r/REPORT.md"])
            self.assertEqual(code, 0)
            self.assertIn("junk.csv", err.getvalue())
            self.assertIn("# Results report", Path(tmp, "r", "REPORT.md").read_text(encoding="utf-8"))

    def test_usage_errors_write_nothing(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            for argv in (
                ["report", "--results", f"{tmp}/nope", "--out", f"{tmp}/R.md"],
                ["report", "--results", tmp, "--out", f"{tmp}/R.html"],
            ):
                err = io.StringIO()
                with self.subTest(argv=argv), redirect_stderr(err), redirect_stdout(io.StringIO()):
                    self.assertEqual(cli.main(argv), 2)
                self.assertEqual(len(err.getvalue().strip().splitlines()), 1)
            self.assertEqual(list(Path(tmp).iterdir()), [])

    def test_unwritable_report_or_plot_writes_nothing(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp, "results")
            folder.mkdir()
            write_scan(folder)
            blocker = Path(tmp, "file.txt")
            blocker.write_text("x", encoding="utf-8")
            Path(tmp, "R-benchmark.png").mkdir()  # where the scan's plot would go
            before = sorted(p.name for p in Path(tmp).iterdir())
            for out_path in (f"{blocker}/R.md", f"{tmp}/R.md"):
                err = io.StringIO()
                with self.subTest(out=out_path), redirect_stderr(err), redirect_stdout(io.StringIO()):
                    self.assertEqual(cli.main(["report", "--results", str(folder), "--out", out_path]), 2)
                self.assertEqual(len(err.getvalue().strip().splitlines()), 1)
            self.assertEqual(sorted(p.name for p in Path(tmp).iterdir()), before)


if __name__ == "__main__":
    unittest.main()
