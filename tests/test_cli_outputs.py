"""Every output flag of every command is checked the same way, before any file is touched: an empty
path, a wrong suffix and another run's raw file in the way of a side file are usage errors (exit 2,
one line)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import unittest
from pathlib import Path
from unittest import mock

from attention_kv_caceh import cli
from attention_kv_caceh.experiments import cache_growth, scan_run
from attention_kv_caceh.files import check_output_path
from attention_kv_caceh.report.readers import LAB_MARKDOWN_HEADINGS


def quietly(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


class OutputFlagTestCase(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self._tmp.cleanup)
        self.dir = Path(self._tmp.name)
        cwd = os.getcwd()
        os.chdir(self.dir)
        self.addCleanup(os.chdir, cwd)

    def assert_usage_error(self, argv: list[str], *needles: str) -> str:
        code, _, err = quietly(argv)
        self.assertEqual(code, 2, err)
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertNotIn("internal error", err)
        for needle in needles:
            self.assertIn(needle, err)
        self.assertEqual(sorted(os.listdir(self.dir)), [], "a usage error touched a file")
        return err


class EmptyOutputPathTest(OutputFlagTestCase):
    def test_an_empty_path_is_refused_for_every_output_flag_naming_the_flag(self) -> None:
        cases: list[tuple[list[str], str]] = [
            (["--csv", ""], "--csv"),
            (["--csv", "x.csv", "--plot", ""], "--plot"),
            (["cache", "--csv", ""], "--csv"),
            (["cache", "--plot", ""], "--plot"),
            (["report", "--results", ".", "--out", ""], "--out"),
            (["views", "--csv", ""], "--csv"),
            (["views", "--md", ""], "--md"),
            (["harness", "--backend", "simulated", "--jsonl", ""], "--jsonl"),
            (["harness", "--backend", "simulated", "--summary-json", ""], "--summary-json"),
            (["harness", "--backend", "simulated", "--plot", ""], "--plot"),
            (["overhead", "--json", ""], "--json"),
        ]
        for argv, flag in cases:
            with self.subTest(argv=argv):
                err = self.assert_usage_error(argv, flag, "empty path")
                self.assertNotIn("'.'", err)

    def test_an_empty_results_folder_is_a_usage_error(self) -> None:
        self.assert_usage_error(["report", "--results", "", "--out", "r.md"], "--results", "empty")

    def test_check_output_path_refuses_the_empty_string(self) -> None:
        with self.assertRaisesRegex(ValueError, "--csv: empty path"):
            check_output_path("", "--csv", (".csv",))


class SuffixTest(OutputFlagTestCase):
    def test_harness_and_overhead_outputs_need_their_lower_case_suffix(self) -> None:
        cases: list[tuple[list[str], str]] = [
            (["harness", "--backend", "simulated", "--jsonl", "X.JSONL"], "use .jsonl"),
            (["harness", "--backend", "simulated", "--jsonl", "h.txt"], ".jsonl"),
            (["harness", "--backend", "simulated", "--summary-json", "H.JSON"], "use .json"),
            (["harness", "--backend", "simulated", "--summary-json", "h3.txt"], ".json"),
            (["overhead", "--json", "o.txt"], ".json"),
        ]
        for argv, needle in cases:
            with self.subTest(argv=argv):
                self.assert_usage_error(argv, argv[-2], needle)


if __name__ == "__main__":
    unittest.main()


class SideFilesOfOneRunTest(OutputFlagTestCase):
    """The summary is rewritten whenever the raw file is: an interrupted run with no sample leaves a
    header-only summary, never the previous run's rows beside its own raw file and metadata."""

    def rows(self, path: Path) -> list[str]:
        return path.read_text(encoding="utf-8").splitlines()[1:]

    def test_scan_interrupted_before_any_sample_leaves_no_old_summary(self) -> None:
        from tests.test_cli_prediction import SATURATES_AT_2, fake_batches

        csv = self.dir / "x.csv"
        with mock.patch.object(scan_run, "run_batch", fake_batches(SATURATES_AT_2)):
            code, _, _ = quietly(
                ["--csv", str(csv), "--batch-sizes", "1,2", "--repeats", "2", "--warmup", "0"]
            )
        self.assertEqual(code, 0)
        summary = self.dir / "x-summary.csv"
        self.assertEqual(len(self.rows(summary)), 2)  # B = 1, 2

        def interrupted(*_: object) -> object:
            raise KeyboardInterrupt

        with mock.patch.object(scan_run, "run_batch", interrupted):
            code, _, _ = quietly(
                ["--csv", str(csv), "--batch-sizes", "4,8", "--repeats", "2", "--warmup", "0"]
            )
        self.assertEqual(code, 130)
        meta = json.loads((self.dir / "x.csv.meta.json").read_text(encoding="utf-8"))
        self.assertEqual((meta["status"], meta["config"]["batch_sizes"]), ("interrupted", [4, 8]))
        self.assertEqual(meta["files"]["summary_csv"], str(summary))
        self.assertEqual(self.rows(csv), [])
        self.assertEqual(self.rows(summary), [])  # header-only: the B = 1, 2 rows are gone

    def test_cache_interrupted_leaves_no_old_summary(self) -> None:
        flags = ["--steps", "8", "--batch-size", "1", "--num-heads", "2", "--num-kv-heads", "1"]
        flags += ["--head-dim", "8", "--repeats", "2", "--warmup", "0"]
        csv = self.dir / "c.csv"
        code, _, _ = quietly(["cache", "--csv", str(csv), *flags])
        self.assertEqual(code, 0)
        summary = self.dir / "c-summary.csv"
        self.assertEqual(len(self.rows(summary)), 2)  # one row per cache kind

        def interrupted(*_: object, **__: object) -> None:
            raise KeyboardInterrupt

        with mock.patch.object(cache_growth, "run_cache_growth", interrupted):
            code, _, _ = quietly(["cache", "--csv", str(csv), *flags])
        self.assertEqual(code, 130)
        for path in (csv, self.dir / "c-memory.csv", summary):
            with self.subTest(path=path.name):
                self.assertEqual(self.rows(path), [])


class SideFileIsAnotherRunsRawFileTest(OutputFlagTestCase):
    SCAN = ("--batch-sizes", "1,2", "--repeats", "2", "--warmup", "0")
    CACHE = (
        "--steps",
        "8",
        "--batch-size",
        "1",
        "--num-heads",
        "2",
        "--num-kv-heads",
        "1",
        "--head-dim",
        "8",
    )

    def scan(self, csv: str) -> tuple[int, str, str]:
        from tests.test_cli_prediction import SATURATES_AT_2, fake_batches

        with mock.patch.object(scan_run, "run_batch", fake_batches(SATURATES_AT_2)):
            return quietly(["--csv", csv, *self.SCAN])

    def assert_refused_and_untouched(self, argv: list[str], victim: Path) -> None:
        before = victim.read_bytes()
        code, out, err = quietly(argv)
        self.assertEqual((code, out), (2, ""), err)
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertIn("another run's raw file", err)
        self.assertIn(str(victim.relative_to(self.dir)), err)
        self.assertEqual(victim.read_bytes(), before)

    def test_scan_refuses_to_write_its_summary_over_another_scans_raw_file(self) -> None:
        self.assertEqual(self.scan("d/a-summary.csv")[0], 0)
        victim = self.dir / "d" / "a-summary.csv"
        self.assert_refused_and_untouched(["--csv", "d/a.csv", *self.SCAN], victim)
        self.assertFalse((self.dir / "d" / "a.csv").exists())

    def test_a_raw_header_without_metadata_is_refused_too(self) -> None:
        self.assertEqual(self.scan("d/a-summary.csv")[0], 0)
        os.remove(self.dir / "d" / "a-summary.csv.meta.json")
        self.assert_refused_and_untouched(["--csv", "d/a.csv", *self.SCAN], self.dir / "d" / "a-summary.csv")

    def test_cache_refuses_to_write_its_memory_rows_over_another_caches_raw_file(self) -> None:
        self.assertEqual(quietly(["cache", "--csv", "d/b-memory.csv", *self.CACHE, "--repeats", "1"])[0], 0)
        victim = self.dir / "d" / "b-memory.csv"
        self.assert_refused_and_untouched(["cache", "--csv", "d/b.csv", *self.CACHE], victim)

    def test_rerunning_the_same_command_replaces_its_own_side_files(self) -> None:
        self.assertEqual(self.scan("d/a.csv")[0], 0)
        self.assertEqual(self.scan("d/a.csv")[0], 0)
        argv = ["cache", "--csv", "d/b.csv", *self.CACHE, "--repeats", "1"]
        self.assertEqual(quietly(argv)[0], 0)
        self.assertEqual(quietly(argv)[0], 0)


class MarkdownBesideTheCsvTest(OutputFlagTestCase):
    """The `<stem>.md` a lab command writes beside its raw CSV never replaces a user's Markdown file."""

    SCAN = SideFileIsAnotherRunsRawFileTest.SCAN
    CACHE = SideFileIsAnotherRunsRawFileTest.CACHE
    scan = SideFileIsAnotherRunsRawFileTest.scan

    NOTES = b"# My notes on the benchmark\n\nkept as written\n"

    def argv(self, command: str, csv: str) -> list[str]:
        return {
            "scan": ["--csv", csv, *self.SCAN],
            "cache": ["cache", "--csv", csv, *self.CACHE, "--repeats", "1"],
            "views": ["views", "--csv", csv],
        }[command]

    def run_command(self, command: str, csv: str) -> tuple[int, str, str]:
        return self.scan(csv) if command == "scan" else quietly(self.argv(command, csv))

    def test_a_users_markdown_is_refused_up_front_and_kept(self) -> None:
        (self.dir / "d").mkdir()
        notes = self.dir / "d" / "a.md"
        for command in ("scan", "cache", "views"):
            for content in (self.NOTES, b"", b"\xff\xfe not text"):
                with self.subTest(command=command, content=content):
                    notes.write_bytes(content)
                    code, out, err = self.run_command(command, "d/a.csv")
                    self.assertEqual((code, out), (2, ""), err)
                    self.assertEqual(len(err.strip().splitlines()), 1, err)
                    self.assertIn("--csv", err)
                    self.assertIn(str(Path("d", "a.md")), err)
                    self.assertEqual(notes.read_bytes(), content)
                    self.assertEqual(sorted(os.listdir(self.dir / "d")), ["a.md"])

    def test_each_commands_own_markdown_is_replaced_on_a_rerun(self) -> None:
        for command in ("scan", "cache", "views"):
            with self.subTest(command=command):
                csv = f"{command}/a.csv"
                self.assertEqual(self.run_command(command, csv)[0], 0)
                written = (self.dir / command / "a.md").read_text(encoding="utf-8")
                self.assertTrue(written.startswith(LAB_MARKDOWN_HEADINGS), written.splitlines()[0])
                self.assertIn("`a.csv`", written.splitlines()[0])
                (self.dir / command / "a.md").write_text(written + "\nstale line\n", encoding="utf-8")
                self.assertEqual(self.run_command(command, csv)[0], 0)
                self.assertNotIn("stale line", (self.dir / command / "a.md").read_text(encoding="utf-8"))


class SmallMessagesTest(OutputFlagTestCase):
    def test_cache_steps_below_two_has_one_message_from_the_flag_type(self) -> None:
        for steps in ("0", "1"):
            with self.subTest(steps=steps):
                self.assert_usage_error(["cache", "--steps", steps], "argument --steps: must be >= 2", steps)

    def test_a_dataset_that_is_a_fifo_is_not_called_missing(self) -> None:
        os.mkfifo(self.dir / "fifo")
        code, _, err = quietly(["harness", "--backend", "simulated", "--dataset", str(self.dir / "fifo")])
        self.assertEqual(code, 2, err)
        self.assertIn("not a regular file", err)
        self.assertNotIn("no such file", err)


class SaturationWithOneBatchSizeTest(OutputFlagTestCase):
    def test_a_saturation_prediction_with_one_batch_size_asks_for_two(self) -> None:
        for value in ("1", "none"):
            with self.subTest(value=value):
                err = self.assert_usage_error(
                    ["--csv", "x.csv", "--batch-sizes", "1", "--predict-saturation", value],
                    "--predict-saturation",
                    "at least two batch sizes",
                )
                self.assertNotIn("one of []", err)


class SetupCardTest(unittest.TestCase):
    def test_impl_all_without_torch_names_torch_sdpa_as_skipped_and_not_as_run(self) -> None:
        from attention_kv_caceh.experiments.scan import ScanConfig
        from attention_kv_caceh.experiments.scan_impls import resolve_impls
        from attention_kv_caceh.report.scan_text import setup_card
        from attention_kv_caceh.timing import capture_environment

        impls = resolve_impls("all", torch_available=False)
        card = setup_card(ScanConfig(batch_sizes=(1, 2)), capture_environment(), impls, ["torch-sdpa"])
        impl_line = next(line for line in card.splitlines() if line.strip().startswith("impls"))
        self.assertNotIn("torch-sdpa", impl_line)
        self.assertIn("fused: 1 thread", impl_line)
        self.assertIn("torch-sdpa: skipped (torch not importable)", card)


class ReportProblemsTest(OutputFlagTestCase):
    def test_unknown_impl_non_strict_metadata_and_problem_paths_are_consistent(self) -> None:
        from tests.test_cli_prediction import SATURATES_AT_2, fake_batches

        res = self.dir / "res"
        with mock.patch.object(scan_run, "run_batch", fake_batches(SATURATES_AT_2)):
            argv = ["--csv", str(res / "s.csv"), "--batch-sizes", "1,2", "--repeats", "2", "--warmup", "0"]
            self.assertEqual(quietly(argv)[0], 0)
        (res / "s-summary.csv").unlink()
        raw = (res / "s.csv").read_text(encoding="utf-8")
        meta = (res / "s.csv.meta.json").read_text(encoding="utf-8")
        (res / "b.csv").write_text(raw.replace(",numpy\n", ",bogus\n"), encoding="utf-8")
        (res / "b.csv.meta.json").write_text(meta, encoding="utf-8")
        (res / "n.csv").write_text(raw, encoding="utf-8")
        (res / "n.csv.meta.json").write_text('{"status": NaN}', encoding="utf-8")
        (res / "p.csv").write_text(raw, encoding="utf-8")
        (res / "p.csv.meta.json").write_text('{"status": "complete"}', encoding="utf-8")  # no probe

        code, _, err = quietly(["report", "--results", str(res), "--out", str(self.dir / "r.md")])
        self.assertEqual(code, 0, err)
        problems = [
            line.removeprefix("problem: ") for line in err.splitlines() if line.startswith("problem: ")
        ]
        by_file: dict[str, list[str]] = {}
        for line in problems:
            path, _, what = line.partition(": ")
            by_file.setdefault(path, []).append(what)
        for path in by_file:
            self.assertTrue(path.startswith(str(res) + os.sep), f"{path!r} is not named by its path")
        self.assertIn("unknown impl 'bogus'", " ".join(by_file[str(res / "b.csv")]))
        self.assertIn("NaN", " ".join(by_file[str(res / "n.csv.meta.json")]))
        self.assertIn("probe_samples_ms", " ".join(by_file[str(res / "p.csv.meta.json")]))
        self.assertNotIn("b.csv", (self.dir / "r.md").read_text(encoding="utf-8").split("## Problems")[0])


class PredictionWordingTest(OutputFlagTestCase):
    def test_the_text_verdict_does_not_repeat_itself_and_saturation_is_defined(self) -> None:
        from tests.test_cli_prediction import SATURATES_AT_2, fake_batches

        argv = ["--csv", "x.csv", "--batch-sizes", "1,2,4", "--repeats", "2", "--warmup", "0"]
        with mock.patch.object(scan_run, "run_batch", fake_batches(SATURATES_AT_2)):
            code, out, _ = quietly([*argv, "--predict", "saturates at B = 4"])
        self.assertEqual(code, 0)
        line = next(x for x in out.splitlines() if x.startswith("user (text)"))
        self.assertEqual(line.count("not checked"), 1, line)
        self.assertIn("'saturates at B = 4'", line)
        sat = next(x for x in out.splitlines() if "model saturation:" in x)
        self.assertIn("saturation = the first doubling of B that raises positions/s by < 10 %", sat)


class FinishedRunTimelineTest(unittest.TestCase):
    def test_in_flight_is_rebuilt_from_arrivals_and_stream_ends(self) -> None:
        import asyncio

        from attention_kv_caceh.harness.run import HarnessConfig, run_harness
        from attention_kv_caceh.harness.run_files import finished_run

        config = HarnessConfig(backend="simulated", num_requests=3, concurrency=2)
        records = asyncio.run(run_harness(config)).records
        run = finished_run(config, records, {})
        # oracle: after the last event at time t, the requests with sent <= t < stream end
        after_each_time = dict(run.in_flight)  # the last count at each time wins
        for t, count in after_each_time.items():
            expected = sum(1 for r in records if (r.sent_ns or 0) <= t < (r.stream_end_ns or 0))
            self.assertEqual(count, expected, t)
        self.assertEqual(max(after_each_time.values()), 2)  # --concurrency 2, both slots used
        self.assertEqual(run.in_flight[-1][1], 0)
        self.assertEqual(run.start_ns, min(r.sent_ns or 0 for r in records))
        self.assertEqual(run.end_ns, max(r.stream_end_ns or 0 for r in records))
