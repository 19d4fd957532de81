"""What the report refuses or lists: names in another case, FIFOs, files above the cap, files that mix
runs or repeat rows, zero times, requests whose timestamps run backwards, runs where nothing completed,
and the prediction a run's metadata records (rebuilt against the raw rows)."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import os
import re
import tempfile
import threading
import tracemalloc
import unittest
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from attention_kv_caceh import cli
from attention_kv_caceh.experiments import scan_run
from attention_kv_caceh.experiments.cache_prediction import make_cache_prediction
from attention_kv_caceh.experiments.calibration import Calibration
from attention_kv_caceh.experiments.prediction import make_scan_prediction
from attention_kv_caceh.experiments.scan import ScanConfig
from attention_kv_caceh.files import write_csv_atomic, write_json_atomic
from attention_kv_caceh.harness.records import STATUS_OK, RequestRecord
from attention_kv_caceh.report import build_report, planned_plots
from attention_kv_caceh.report import sources as report_sources
from attention_kv_caceh.report.verdicts import VERDICT_MARK
from attention_kv_caceh.timing import Sample
from tests import test_cli_prediction as cli_prediction
from tests.test_report import ENV, SAMPLE_FIELDS, write_cache, write_scan

MS = 1_000_000


def ok_record(i: int, arrival: int = 0, sent: int = MS) -> dict[str, Any]:
    first = sent + 10 * MS
    return RequestRecord(
        request_id=i,
        arrival_ns=arrival,
        prompt_tokens=4,
        sent_ns=sent,
        first_token_ns=first,
        token_times_ns=[first, first + MS],
        tokens_per_event=[1, 1],
        finish_ns=first + MS,
        stream_end_ns=first + MS,
        output_tokens=2,
        status=STATUS_OK,
    ).to_json()


class Folder(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.folder = Path(self._tmp.name, "results")
        self.folder.mkdir()
        self.out = self.folder / "REPORT.md"

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def report(self) -> tuple[str, dict[str, str]]:
        result = build_report(self.folder, self.out, plot=False)
        self.sources = result.sources  # the raw files reported
        return result.markdown, {Path(p.path).name: p.problem for p in result.problems}

    def rewrite_rows(
        self, path: Path, change: Callable[[list[dict[str, str]]], list[dict[str, str]]]
    ) -> None:
        """Apply `change(rows)` to a CSV's rows (dicts of strings) and write it back."""
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            rows = list(reader)
        write_csv_atomic(path, change(rows), header)


class SuffixAndFileKindTest(Folder):
    def test_a_suffix_in_another_case_is_listed_not_silently_ignored(self) -> None:
        write_scan(self.folder, "good.csv")
        write_scan(self.folder, "B.CSV")
        (self.folder / "serve.JSONL").write_text(json.dumps(ok_record(0)) + "\n", encoding="utf-8")
        (self.folder / "good.csv.Meta.Json").write_text("{}", encoding="utf-8")
        text, problems = self.report()
        lower = "not read: suffixes are lower-case"
        self.assertEqual(problems["B.CSV"], f"{lower} (.csv)")
        self.assertEqual(problems["serve.JSONL"], f"{lower} (.jsonl)")
        self.assertEqual(problems["good.csv.Meta.Json"], f"{lower} (.meta.json)")
        self.assertIn("good.csv", self.sources)
        self.assertNotIn("`B.CSV`", text.split("## Problems with files")[0])
        self.assertEqual([p.name for p in planned_plots(self.folder, self.out)], ["REPORT-good.png"])

    def test_a_fifo_named_like_a_raw_or_meta_file_is_listed_and_never_blocks(self) -> None:
        write_scan(self.folder, "good.csv")
        (self.folder / "good.csv.meta.json").unlink()
        fifos = [self.folder / n for n in ("good.csv.meta.json", "pipe.csv", "pipe.jsonl")]
        for fifo in fifos:
            os.mkfifo(fifo)
        result: list[tuple[str, dict[str, str]]] = []
        worker = threading.Thread(target=lambda: result.append(self.report()), daemon=True)
        worker.start()
        worker.join(60)  # a hang guard, not a time bound: a blocked open never returns at all
        if worker.is_alive():  # let a blocked reader go before failing, so no thread is left behind
            for fifo in fifos:
                with contextlib.suppress(OSError):
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            self.fail("the report blocked on a FIFO")
        _text, problems = result[0]
        self.assertEqual(problems["pipe.csv"], "skipped: a FIFO")
        self.assertEqual(problems["pipe.jsonl"], "skipped: a FIFO")
        self.assertEqual(problems["good.csv.meta.json"], "a FIFO, not a regular file: not read")
        self.assertIn("good.csv", self.sources)
        self.assertEqual(planned_plots(self.folder, self.out), [self.out.with_name("REPORT-good.png")])

    def test_open_regular_refuses_a_fifo_without_opening_it(self) -> None:
        fifo = self.folder / "x.csv"
        os.mkfifo(fifo)
        with self.assertRaisesRegex(ValueError, "a FIFO, not a regular file"):
            report_sources.open_regular(fifo)

    def test_a_file_above_the_size_cap_is_refused_with_the_cap_named(self) -> None:
        write_scan(self.folder, "big.csv")
        (self.folder / "big.jsonl").write_text(json.dumps(ok_record(0)) * 10 + "\n", encoding="utf-8")
        write_scan(self.folder, "small.csv")
        cap = (self.folder / "small.csv").stat().st_size
        (self.folder / "big.csv").write_bytes((self.folder / "big.csv").read_bytes() + b"\n" * 10)
        with mock.patch.object(report_sources, "MAX_INPUT_BYTES", cap):
            _text, problems = self.report()
        self.assertRegex(
            problems["big.csv"], r"MiB, above the report's cap of 0 MiB \(report\.sources\.MAX_INPUT"
        )
        self.assertIn("above the report's cap", problems["big.jsonl"])
        self.assertIn("small.csv", self.sources)

    def test_running_out_of_memory_in_one_file_is_a_problem_not_a_traceback(self) -> None:
        write_scan(self.folder, "scan.csv")
        (self.folder / "serve.jsonl").write_text(json.dumps(ok_record(0)) + "\n", encoding="utf-8")
        with mock.patch("csv.reader", side_effect=MemoryError):
            _text, problems = self.report()
        self.assertEqual(problems, {"scan.csv": "out of memory while reading it: not reported"})
        self.assertIn("serve.jsonl", self.sources)

    def test_a_scan_csv_is_streamed_not_held_as_text_and_dicts(self) -> None:
        # About 1 MB of raw samples. Held as text plus a dict of strings per row it took ~22x its size
        # (tracemalloc peak); streamed into slotted Samples it holds ~4.6x and peaks near 7x.
        warm = Path(self._tmp.name, "warm")  # first calls allocate a fixed ~10 MB (lazy set-up): not measured
        warm.mkdir()
        write_scan(warm)
        build_report(warm, warm / "R.md", plot=False)
        rows = (
            dataclasses.asdict(Sample(2 ** (i % 4), 512, 0.1 + (i % 97) * 1e-3, i // 4))
            for i in range(20_000)
        )
        path = write_csv_atomic(self.folder / "big.csv", rows, SAMPLE_FIELDS)
        write_json_atomic(Path(f"{path}.meta.json"), ENV)
        size = path.stat().st_size
        tracemalloc.start()
        try:
            result = build_report(self.folder, self.out, plot=False)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        self.assertIn("20000 raw samples", result.markdown)
        self.assertLess(peak, 10 * size, f"peak {peak} B for a {size} B file")


class OneRunPerFileTest(Folder):
    def test_a_scan_csv_mixing_two_runs_is_rejected_not_reported_as_the_first(self) -> None:
        path = write_scan(self.folder, "mixed.csv")
        write_scan(self.folder, "good.csv")

        def add_second_run(rows: list[dict[str, str]]) -> list[dict[str, str]]:
            return rows + [r | {"head_dim": "128", "cache": "preallocated"} for r in rows]

        self.rewrite_rows(path, add_second_run)
        text, problems = self.report()
        self.assertIn(
            "malformed scan CSV: rows of 2 different runs (head_dim 64 / 128; cache dynamic",
            problems["mixed.csv"],
        )
        self.assertIn("first rows 1, 61)", problems["mixed.csv"])
        self.assertNotIn("### Batch-size scan: `mixed.csv`", text)
        self.assertIn("good.csv", self.sources)

    def test_a_cache_csv_mixing_batch_sizes_is_rejected(self) -> None:
        write_cache(self.folder)
        self.rewrite_rows(
            self.folder / "growth.csv", lambda rows: rows + [r | {"batch_size": "4"} for r in rows]
        )
        text, problems = self.report()
        self.assertIn("rows of 2 different runs (batch_size 1 / 4;", problems["growth.csv"])
        self.assertNotIn("### KV-cache growth", text)

    def test_duplicated_rows_reject_the_file_instead_of_doubling_the_totals(self) -> None:
        write_cache(self.folder)
        self.rewrite_rows(self.folder / "growth.csv", lambda rows: rows + rows[:1])
        _, problems = self.report()
        self.assertEqual(
            problems["growth.csv"],
            "malformed cache CSV: row 257 repeats row 1 (same parameters and cache dynamic, repeat 0, "
            "step 0): a duplicated row would be counted twice in every statistic",
        )

    def test_a_duplicated_scan_sample_rejects_the_file(self) -> None:
        path = write_scan(self.folder, "dup.csv")
        self.rewrite_rows(path, lambda rows: [*rows, rows[5] | {"elapsed_ms": "3.5"}])
        _, problems = self.report()
        self.assertIn(
            "row 61 repeats row 6 (same parameters and batch_size 1, impl numpy, repeat 5)",
            problems["dup.csv"],
        )

    def test_a_cache_row_whose_columns_disagree_rejects_the_file(self) -> None:
        write_cache(self.folder)
        cases = [
            ("sequence_length", "9", "row 3: sequence_length 9 is not step + 1 = 3"),
            ("step", "64", "row 3: sequence_length 3 is not step + 1 = 65"),
            ("cache", "dynamc", "row 3: column 'cache': 'dynamc' is not one of dynamic, preallocated"),
        ]
        for column, value, why in cases:
            with self.subTest(column=column):
                write_cache(self.folder)

                def change(
                    rows: list[dict[str, str]], column: str = column, value: str = value
                ) -> list[dict[str, str]]:
                    rows[2] = rows[2] | {column: value}
                    return rows

                self.rewrite_rows(self.folder / "growth.csv", change)
                _, problems = self.report()
                self.assertEqual(problems["growth.csv"], f"malformed cache CSV: {why}")
        write_cache(self.folder)
        self.rewrite_rows(
            self.folder / "growth-mem.csv",
            lambda rows: [*rows[:-1], rows[-1] | {"step": "64", "sequence_length": "65"}],
        )
        _, problems = self.report()
        self.assertEqual(
            problems["growth-mem.csv"],
            "malformed cache-memory CSV: row 128: step 64 lies outside the run's 64 steps",
        )

    def test_a_zero_elapsed_time_is_an_invalid_row(self) -> None:
        path = write_scan(self.folder, "zero.csv")
        self.rewrite_rows(path, lambda rows: [r | {"elapsed_ms": "0"} for r in rows])
        text, problems = self.report()
        self.assertEqual(
            problems["zero.csv"], "malformed scan CSV: row 1: column 'elapsed_ms': '0' must be > 0"
        )
        self.assertNotIn("ZeroDivisionError", text)

    def test_an_elapsed_time_too_large_for_statistics_is_one_listed_problem(self) -> None:
        path = write_scan(self.folder, "huge.csv")
        self.rewrite_rows(path, lambda rows: [rows[0] | {"elapsed_ms": "1e308"}, *rows[1:]])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a NumPy overflow warning fails the test
            text, problems = self.report()
        self.assertEqual(list(problems), ["huge.csv"])
        self.assertIn("1e+308", problems["huge.csv"])
        self.assertNotIn("### Batch-size scan: `huge.csv`", text)

    def test_two_memory_csvs_of_the_same_parameters_pair_by_the_metadata(self) -> None:
        write_cache(self.folder)
        memory = (self.folder / "growth-mem.csv").read_bytes()
        (self.folder / "other-mem.csv").write_bytes(memory)
        text, problems = self.report()
        self.assertEqual(
            problems["growth.csv"],
            "2 memory CSVs have this run's parameters (growth-mem.csv, other-mem.csv) and its metadata names "
            "none of them: the memory table is left out",
        )
        self.assertIn("No memory CSV with the same run parameters", text)
        write_json_atomic(
            self.folder / "growth.csv.meta.json", {**ENV, "files": {"memory": "x/growth-mem.csv"}}
        )
        text, problems = self.report()
        self.assertEqual(problems, {})
        self.assertIn("| dynamic | 16 B | 1.00 KiB | 16 |", text)


class CacheSectionTest(Folder):
    def test_the_cache_section_says_which_r2_to_trust_and_why_they_differ(self) -> None:
        write_cache(self.folder)
        text, _ = self.report()
        note = text.split("**Which R^2 to trust.**")[1].split("\n")[0]
        self.assertIn("it is the one to read", note)
        self.assertIn("noise", note)


class ServingRecordsTest(Folder):
    def write(self, name: str, records: list[dict[str, Any]]) -> None:
        lines = [json.dumps(r) for r in records]
        (self.folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")

    def test_sent_before_arrival_is_listed_not_a_negative_queue_time(self) -> None:
        self.write("serve.jsonl", [ok_record(0), ok_record(1, arrival=5 * MS, sent=2 * MS), ok_record(2)])
        text, problems = self.report()
        self.assertEqual(
            problems["serve.jsonl"],
            f"line 2: timestamps out of order: sent_ns < arrival_ns ({2 * MS} < {5 * MS}); line skipped",
        )
        self.assertEqual(self.sources, ["serve.jsonl"])
        self.assertEqual(re.findall(r"(\d+) request\(s\), (\d+) completed", text), [("2", "2")])
        self.assertIn("| client queue time | 2 | 1 |", text)

    def test_unknown_keys_are_ignored_and_a_repeated_request_id_is_skipped(self) -> None:
        self.write("serve.jsonl", [ok_record(0) | {"added_later": [1, 2]}, ok_record(0)])
        text, problems = self.report()
        self.assertEqual(problems["serve.jsonl"], "line 2: request_id 0 already on line 1; line skipped")
        self.assertEqual(self.sources, ["serve.jsonl"])
        self.assertEqual(re.findall(r"(\d+) request\(s\), (\d+) completed", text), [("1", "1")])

    def test_a_negative_token_count_is_listed_not_summed_into_throughput(self) -> None:
        for field, value in (("output_tokens", -3), ("prompt_tokens", -1), ("output_tokens", 2.5)):
            with self.subTest(field=field, value=value):
                self.write("serve.jsonl", [ok_record(0), ok_record(1) | {field: value}, ok_record(2)])
                text, problems = self.report()
                self.assertEqual(list(problems), ["serve.jsonl"])
                self.assertRegex(problems["serve.jsonl"], rf"^line 2: {field} .*; line skipped$")
                self.assertEqual(self.sources, ["serve.jsonl"])
                self.assertEqual(re.findall(r"(\d+) request\(s\), (\d+) completed", text), [("2", "2")])

    def test_the_label_goodput_and_server_block_of_the_metadata_are_shown(self) -> None:
        # TTFT is 10 ms for every ok_record; an SLO of 5 ms passes none, one of 20 ms passes all three.
        self.write("serve.jsonl", [ok_record(0), ok_record(1), ok_record(2)])
        server = {"engine_config": {"max_num_seqs": 7}, "engine_steps": {"num_steps": 42}}
        for ttft, good in ((5, 0), (20, 3)):
            with self.subTest(ttft=ttft):
                meta = {**ENV, "config": {"label": "nightly-A", "goodput": {"ttft": ttft}}, "server": server}
                write_json_atomic(self.folder / "serve.jsonl.meta.json", meta)
                text, problems = self.report()
                self.assertEqual(problems, {})
                section = text.split("### Serving run: `serve.jsonl`")[1]
                self.assertTrue(section.startswith(" (nightly-A)"), section[:40])
                self.assertRegex(section, rf"\({good} of 3 completed requests meet ttft <= {ttft} ms\)")
                self.assertIn("| engine_config | max_num_seqs | 7 |", section)
                self.assertIn("| engine_steps | num_steps | 42 |", section)

    def test_a_malformed_goodput_in_the_metadata_is_listed_and_the_run_still_reported(self) -> None:
        self.write("serve.jsonl", [ok_record(0)])
        write_json_atomic(self.folder / "serve.jsonl.meta.json", {**ENV, "config": {"goodput": {"ttft": -1}}})
        text, problems = self.report()
        self.assertEqual(list(problems), ["serve.jsonl.meta.json"])
        self.assertEqual(self.sources, ["serve.jsonl"])
        self.assertEqual(re.findall(r"(\d+) request\(s\), (\d+) completed", text), [("1", "1")])

    def test_a_run_where_every_request_failed_says_so(self) -> None:
        failed = [
            RequestRecord(request_id=i, arrival_ns=0, prompt_tokens=4, status="timeout").to_json()
            for i in range(3)
        ]
        self.write("serve.jsonl", failed)
        text, problems = self.report()
        self.assertEqual(problems, {})
        self.assertIn("3 request(s), **none completed** (failures: timeout: 3): there is no latency", text)
        self.assertNotIn("| metric |", text)


CAL = Calibration("B=1, T=1 (hand)", 1_000, (0.010, 0.011, 0.012), 1_000_000, (0.1, 0.1, 0.1))


class PredictionTest(Folder):
    def scan_with_prediction(self, prediction: Any) -> None:
        path = write_scan(self.folder, "scan.csv")
        meta = json.loads(Path(f"{path}.meta.json").read_text(encoding="utf-8"))
        write_json_atomic(Path(f"{path}.meta.json"), meta | {"prediction": prediction})

    def test_a_scan_prediction_is_rebuilt_and_checked_against_the_raw_samples(self) -> None:
        config = ScanConfig(batch_sizes=(1, 2, 4), seq_len=128)
        p = make_scan_prediction(
            config, CAL, bytes_per_step={1: 10_000, 2: 20_000, 4: 40_000}, written_at_utc="then"
        )
        self.scan_with_prediction(p.to_json())
        text, problems = self.report()
        self.assertEqual(problems, {})
        section = text.split("#### Prediction against measurement")[1]
        self.assertIn("Written then, before any timed sample.", section)
        # Model at B = 1: overhead 0.011 ms - 1_000 B / (1e6 B / 0.1 ms) = 0.0109 ms, plus 10_000 B /
        # 1e7 B/ms = 0.001 ms: 0.0119 ms; the measured P50 is 10.5 ms (882x, outside [1/2, 2]).
        self.assertIn("| 1 | 0.0119 | 10.5000 | 882.35 | call overhead | no |", section)
        self.assertIn("| model P50 | FAILED | failed at B = 1, 2, 4", section)

    def test_a_malformed_scan_prediction_is_listed_and_the_scan_still_reported(self) -> None:
        for bad in ({"user": 3}, [1, 2], {"kind": "scan-roofline"}):
            with self.subTest(prediction=bad):
                self.scan_with_prediction(bad)
                text, problems = self.report()
                self.assertIn("malformed 'prediction'", problems["scan.csv.meta.json"])
                self.assertIn("prediction table left out", problems["scan.csv.meta.json"])
                self.assertIn("scan.csv", self.sources)
                self.assertNotIn("#### Prediction against measurement", text)

    def test_a_cache_prediction_is_rebuilt_against_the_fitted_slopes(self) -> None:
        write_cache(self.folder)
        # Fitted slopes: dynamic 0.01 ms/position, preallocated 0.002. Probe: 1e6 B in 0.1 ms = 1e7 B/ms,
        # so 100_000 and 20_000 B per position predict exactly 0.01 and 0.002 ms: both hold.
        p = make_cache_prediction({"dynamic": 100_000, "preallocated": 20_000}, 1_000_000, [0.1], "then")
        write_json_atomic(self.folder / "growth.csv.meta.json", {**ENV, "prediction": p.to_json()})
        text, problems = self.report()
        self.assertEqual(problems, {})
        section = text.split("#### Prediction against measurement")[1]
        self.assertIn(
            "| dynamic slope | held | held: measured 10.0000, predicted 10.0000 us/position |", section
        )
        self.assertIn("| dynamic / preallocated | held | held: measured 5.00x, predicted 5.00x |", section)
        write_json_atomic(self.folder / "growth.csv.meta.json", {**ENV, "prediction": {"probe_bytes": "x"}})
        text, problems = self.report()
        self.assertIn("malformed 'prediction'", problems["growth.csv.meta.json"])
        self.assertIn("growth.csv", self.sources)


if __name__ == "__main__":
    unittest.main()


class PredictionFromTheCommandsTest(Folder):
    """The report rebuilds, from the files the commands wrote, the verdicts the commands printed."""

    def assert_same_verdicts(self, meta_file: Path) -> None:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        text, problems = self.report()
        self.assertEqual(problems, {})
        # The Markdown the command wrote beside its raw file is the report's section of that file.
        written = meta_file.with_name(meta_file.name.replace(".csv.meta.json", ".md")).read_text("utf-8")
        self.assertIn("Status: complete", written)
        self.assertIn(re.sub(r"\nStatus: complete[.;][^\n]*\n", "", written), text)
        section = text.split("#### Prediction against measurement")[1]
        for v in meta["prediction_outcome"]["verdicts"]:
            mark = VERDICT_MARK[v["held"]]
            self.assertIn(f"| {v['name']} | {mark} | {v['text'].replace('|', chr(92) + '|')} |", section)

    def test_the_scan_commands_prediction(self) -> None:
        csv_path = self.folder / "benchmark.csv"
        with (
            mock.patch.object(
                scan_run, "run_batch", cli_prediction.fake_batches(cli_prediction.SATURATES_AT_2)
            ),
            redirect_all(),
        ):
            code = cli.main(["--csv", str(csv_path), *cli_prediction.SMALL, "--predict-saturation", "2"])
        self.assertEqual(code, 0)
        self.assert_same_verdicts(Path(f"{csv_path}.meta.json"))

    def test_the_cache_commands_prediction(self) -> None:
        csv_path = self.folder / "cache.csv"
        with redirect_all():
            code = cli.main(["cache", "--csv", str(csv_path), *cli_prediction.CachePredictionCliTest.FLAGS])
        self.assertEqual(code, 0)
        self.assert_same_verdicts(Path(f"{csv_path}.meta.json"))


@contextlib.contextmanager
def redirect_all() -> Iterator[None]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield
