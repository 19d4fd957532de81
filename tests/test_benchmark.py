"""The batch-size scan and its command (`cli/scan.py`, the default of `attention-kv-caceh`): files,
table, verdict, oracle gate, usage errors, interrupts (Ctrl-C and SIGTERM)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import signal
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path
from unittest import mock

import numpy as np

from attention_kv_caceh import benchmark, recorder
from attention_kv_caceh.experiments import scan, scan_impls, scan_run
from attention_kv_caceh.experiments.scan import ScanConfig
from attention_kv_caceh.experiments.scan_stats import scan_table
from attention_kv_caceh.report.verdicts import saturation_verdict
from attention_kv_caceh.timing import Sample
from tests import as_on_a_quiet_machine, ctrl_c_as_in_a_terminal

ctrl_c_as_in_a_terminal()  # the Ctrl-C tests also pass as a background job (tests/__init__.py)


def setUpModule() -> None:
    as_on_a_quiet_machine()  # the scan's load warning would add a stderr line


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = benchmark.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


class ScanCliTest(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self._tmp.name)
        self.csv = self.dir / "results" / "benchmark.csv"

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def test_default_scan_writes_120_rows_summary_and_metadata(self) -> None:
        code, out, _ = run_cli("--csv", str(self.csv))
        self.assertEqual(code, 0)
        rows = read_csv(self.csv)
        self.assertEqual(len(rows), 120)
        self.assertEqual(sorted({int(r["batch_size"]) for r in rows}), [1, 2, 4, 8])
        for r in rows:
            self.assertEqual(
                (r["sequence_length"], r["head_dim"], r["dtype"], r["seed"], r["warmup"]),
                ("128", "64", "float32", "42", "3"),
            )
        self.assertEqual(sorted(int(r["repeat"]) for r in rows if r["batch_size"] == "4"), list(range(30)))
        summary = read_csv(self.dir / "results" / "benchmark-summary.csv")
        self.assertEqual([r["batch_size"] for r in summary], ["1", "2", "4", "8"])
        meta = json.loads((self.dir / "results" / "benchmark.csv.meta.json").read_text())
        self.assertEqual(meta["status"], "complete")
        self.assertEqual(meta["config"]["seed"], 42)
        self.assertEqual(len(meta["probe_samples_ms"]["8"]), 30)
        self.assertEqual(meta["kv_bytes_per_step"]["1"], 2 * 1 * 129 * 64 * 4)
        for key in ("python", "numpy", "blas", "cpu_model", "thread_env", "start_time_utc"):
            self.assertIn(key, meta["environment"])
        self.assertIn("Saturation:", out)
        self.assertIn("positions/s", out)
        last = json.loads(out.strip().splitlines()[-1])  # one JSON object on the last line
        self.assertEqual(last["rows"], 120)

    def test_a_loaded_machine_is_said_once_before_timing_and_recorded_in_the_metadata(self) -> None:
        from attention_kv_caceh import cpu_load

        for others, warns, recorded in ((1.0, True, 1.0), (0.49, False, 0.49), (None, False, None)):
            with (
                self.subTest(others=others),
                mock.patch.object(cpu_load, "measure_others_busy", return_value=others) as measure,
            ):
                code, _, err = run_cli("--csv", str(self.csv), "--batch-sizes", "1", "--repeats", "2")
                self.assertEqual(code, 0, err)
                measure.assert_called_once()
                lines = [line for line in err.splitlines() if "other processes keep" in line]
                self.assertEqual(len(lines), 1 if warns else 0, err)
                if warns:
                    self.assertIn("keep 1.0 CPUs busy (measured over 0.25 s before timing)", lines[0])
                env = json.loads(self.csv.with_name("benchmark.csv.meta.json").read_text())["environment"]
                self.assertEqual(env["others_busy_cpus"], recorded)
                self.assertEqual(env["others_busy_window_s"], 0.25)

    def test_summary_is_recomputable_from_raw_rows(self) -> None:
        code, _, _ = run_cli(
            "--csv", str(self.csv), "--batch-sizes", "1,3", "--repeats", "5", "--warmup", "0"
        )
        self.assertEqual(code, 0)
        raw = read_csv(self.csv)
        summary = {r["batch_size"]: r for r in read_csv(self.dir / "results" / "benchmark-summary.csv")}
        for b in ("1", "3"):
            values = np.array([float(r["elapsed_ms"]) for r in raw if r["batch_size"] == b])
            self.assertAlmostEqual(float(summary[b]["p50_ms"]), float(np.percentile(values, 50)))
            self.assertAlmostEqual(float(summary[b]["p95_ms"]), float(np.percentile(values, 95)))
            self.assertAlmostEqual(
                float(summary[b]["positions_per_s"]), int(b) * 128 / (float(np.median(values)) / 1000)
            )

    def test_model_preset_and_preallocated_cache(self) -> None:
        code, out, _ = run_cli(
            "--csv", str(self.csv), "--model", "llama-3-8b", "--batch-sizes", "2", "--seq-len", "16",
            "--repeats", "2", "--warmup", "1", "--cache", "preallocated", "--dtype", "float64",
        )  # fmt: skip
        self.assertEqual(code, 0)
        row = read_csv(self.csv)[0]
        self.assertEqual(
            (
                row["num_heads"],
                row["num_kv_heads"],
                row["head_dim"],
                row["cache"],
                row["model"],
                row["dtype"],
            ),
            ("32", "8", "128", "preallocated", "llama-3-8b", "float64"),
        )
        self.assertIn("KiB per token", out)

    def test_plot_is_written(self) -> None:
        png = self.dir / "plots" / "scan.png"
        code, _, _ = run_cli(
            "--csv", str(self.csv), "--batch-sizes", "1,2", "--repeats", "2", "--plot", str(png)
        )
        self.assertEqual(code, 0)
        self.assertEqual(png.read_bytes()[:8], b"\x89PNG\r\n\x1a\n")

    def test_usage_errors_exit_2_with_one_line_and_touch_no_file(self) -> None:
        self.csv.parent.mkdir(parents=True)
        self.csv.write_text("keep me\n")
        (self.dir / "file.txt").write_text("a file, not a folder\n")
        # Each case names the flag (or the size that does not fit); the wording is argparse's or ours.
        cases = [
            (["--batch-sizes", "0,2"], "--batch-sizes"),
            (["--batch-sizes", "a,b"], "--batch-sizes"),
            (["--batch-sizes", "1,,2"], "--batch-sizes"),
            (["--seed", "-1"], "--seed"),
            (["--head-dim", "0"], "--head-dim"),
            (["--repeats", "1000000000000"], "GiB"),
            (["--csv", str(self.dir / "file.txt" / "x.csv")], "file.txt is not a folder"),
            (["--seq-len", "-1"], "--seq-len"),
            (["--num-heads", "3", "--num-kv-heads", "2"], "--num-kv-heads"),
            (["--dtype", "float16"], "--dtype"),
            (["--repeats", "0"], "--repeats"),
            (["--model", "gpt-5"], "--model"),
            (["--no-such-flag"], "--no-such-flag"),
            (["--blas-threads", "0"], "--blas-threads"),
            (["--plot", str(self.dir / "x.jpg")], "--plot"),
            (["--batch-sizes", "4096", "--seq-len", "1000000"], "GiB"),
        ]
        for extra, message in cases:
            with self.subTest(extra=extra):
                code, out, err = run_cli("--csv", str(self.csv), *extra)
                self.assertEqual(code, 2)
                self.assertEqual(len(err.strip().splitlines()), 1, err)
                self.assertIn(message, err)
                self.assertEqual(out, "")
                self.assertEqual(self.csv.read_text(), "keep me\n")
        code, _, err = run_cli("--csv", str(self.dir / "b.csv.meta.json"))
        self.assertEqual((code, err.count("\n")), (2, 1))
        self.assertIn("must end in .csv", err)
        (self.dir / "folder.csv").mkdir()
        code, _, err = run_cli("--csv", str(self.dir / "folder.csv"))
        self.assertEqual(code, 2)
        self.assertIn("is a folder", err)

    def test_every_output_is_checked_before_the_first_sample(self) -> None:
        # The summary and metadata files beside the CSV are outputs too: a folder in their place is a
        # usage error up front, not a failure after the scan.
        for beside in ("x-summary.csv", "x.csv.meta.json"):
            with self.subTest(beside=beside), tempfile.TemporaryDirectory() as tmp:
                (Path(tmp) / beside).mkdir()
                code, out, err = run_cli("--csv", str(Path(tmp) / "x.csv"), "--repeats", "1")
                self.assertEqual((code, out), (2, ""), err)
                self.assertIn(beside, err)
                self.assertEqual(sorted(p.name for p in Path(tmp).iterdir()), [beside])

    def test_console_usage_error_has_no_traceback(self) -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "attention_kv_caceh.benchmark", "--batch-sizes", "-4"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        self.assertEqual(proc.returncode, 2)
        self.assertNotIn("Traceback", proc.stderr)
        self.assertEqual(len(proc.stderr.strip().splitlines()), 1, proc.stderr)

    def test_oracle_failure_aborts_before_timing(self) -> None:
        real = scan_impls.multihead_decode_step

        def leaky_step(q_t, k_t, v_t, cache):  # type: ignore[no-untyped-def]
            out, w = real(q_t, k_t, v_t, cache)
            return out.mean(axis=0, keepdims=True) + 0 * out, w  # mixes sequences across the batch

        with mock.patch.object(scan_impls, "multihead_decode_step", leaky_step):
            code, _, err = run_cli("--csv", str(self.csv), "--repeats", "2")
        self.assertEqual(code, 1)
        self.assertIn("oracle check failed at B=2", err)  # B=1 passes: a batch of one cannot leak
        rows = read_csv(self.csv)
        self.assertEqual({r["batch_size"] for r in rows}, {"1"})
        meta = json.loads((self.csv.parent / "benchmark.csv.meta.json").read_text())
        self.assertEqual(meta["status"], "oracle-failed")

    def test_interrupt_keeps_every_finished_sample(self) -> None:
        real = scan.run_batch

        def interrupted(config, inputs, b, impls=("numpy",)):  # type: ignore[no-untyped-def]
            if b == 4:
                raise KeyboardInterrupt
            return real(config, inputs, b, impls)

        with mock.patch.object(scan_run, "run_batch", interrupted):
            code, _, err = run_cli("--csv", str(self.csv), "--repeats", "3")
        self.assertEqual(code, 130)
        self.assertIn("6 samples kept", err)
        self.assertEqual(len(read_csv(self.csv)), 6)
        meta = json.loads((self.csv.parent / "benchmark.csv.meta.json").read_text())
        self.assertEqual(meta["status"], "interrupted")

    def test_interrupt_mid_batch_keeps_the_samples_of_that_batch_size(self) -> None:
        real = scan.measure
        timed_steps = 0

        def cut_at_third_call(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal timed_steps
            if fn is np.dot:
                return real(fn, *args, **kwargs)
            timed_steps += 1
            if timed_steps < 2:  # B = 1 runs whole; B = 2 is cut after its second timed call
                return real(fn, *args, **kwargs)
            calls = 0

            def step(*a):  # type: ignore[no-untyped-def]
                nonlocal calls
                calls += 1
                if calls == 3:
                    raise KeyboardInterrupt
                return fn(*a)

            return real(step, *args, **kwargs)

        with mock.patch.object(scan, "measure", cut_at_third_call):
            code, _, err = run_cli(
                "--csv", str(self.csv), "--batch-sizes", "1,2", "--repeats", "5", "--warmup", "0"
            )
        self.assertEqual(code, 130)
        self.assertIn("7 samples kept", err)
        rows = read_csv(self.csv)
        self.assertEqual([r["batch_size"] for r in rows], ["1"] * 5 + ["2"] * 2)
        self.assertEqual([r["repeat"] for r in rows[5:]], ["0", "1"])
        meta = json.loads((self.csv.parent / "benchmark.csv.meta.json").read_text())
        self.assertEqual(meta["incomplete_batch"], {"batch_size": 2, "samples": 2, "cut_during": "numpy"})
        summary = read_csv(self.csv.parent / "benchmark-summary.csv")
        self.assertEqual([r["batch_size"] for r in summary], ["1"])  # the incomplete B is not summarised

    def test_interrupt_in_the_read_probe_says_the_samples_are_whole(self) -> None:
        real = scan.measure
        probes = 0

        def cut_second_probe(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal probes
            if fn is np.dot:
                probes += 1
                if probes == 2:  # B = 2: every timed step taken, then Ctrl-C in its read probe
                    raise KeyboardInterrupt
            return real(fn, *args, **kwargs)

        with mock.patch.object(scan, "measure", cut_second_probe):
            code, _, _ = run_cli(
                "--csv", str(self.csv), "--batch-sizes", "1,2", "--repeats", "3", "--warmup", "0"
            )
        self.assertEqual(code, 130)
        rows = read_csv(self.csv)
        self.assertEqual([r["batch_size"] for r in rows], ["1"] * 3 + ["2"] * 3)
        meta = json.loads((self.csv.parent / "benchmark.csv.meta.json").read_text())
        self.assertEqual(meta["incomplete_batch"], {"batch_size": 2, "samples": 3, "cut_during": "probe"})


class SigtermTest(unittest.TestCase):
    def test_sigterm_saves_like_ctrl_c_and_exits_143(self) -> None:
        real = scan.run_batch

        def terminated(config, inputs, b, impls=("numpy",)):  # type: ignore[no-untyped-def]
            if b == 2:
                signal.raise_signal(signal.SIGTERM)  # as `kill PID` or a job scheduler sends it
            return real(config, inputs, b, impls)

        with tempfile.TemporaryDirectory() as tmp:
            csv_path = Path(tmp) / "b.csv"
            with mock.patch.object(scan_run, "run_batch", terminated):
                code, _, err = run_cli("--csv", str(csv_path), "--repeats", "2")
            self.assertEqual(code, 143)
            self.assertEqual(len(err.strip().splitlines()), 1, err)
            meta = json.loads((Path(tmp) / "b.csv.meta.json").read_text())
            self.assertEqual(meta["status"], "interrupted")
            self.assertEqual(len(read_csv(csv_path)), 2)  # B=1's two samples, complete
        self.assertIs(signal.getsignal(signal.SIGTERM), signal.SIG_DFL)  # main restores the handler


class SecondInterruptTest(unittest.TestCase):
    def test_second_ctrl_c_during_the_final_save_is_ignored(self) -> None:
        real_run, real_write = scan.run_batch, recorder.write_json_atomic

        def interrupted(config, inputs, b, impls=("numpy",)):  # type: ignore[no-untyped-def]
            if b == 2:
                raise KeyboardInterrupt
            return real_run(config, inputs, b, impls)

        def write_with_second_sigint(path, obj):  # type: ignore[no-untyped-def]
            if obj.get("status") == "interrupted":
                signal.raise_signal(signal.SIGINT)  # as when uv forwards the terminal's Ctrl-C
            return real_write(path, obj)

        with tempfile.TemporaryDirectory() as tmp:
            csv_path = Path(tmp) / "b.csv"
            with (
                mock.patch.object(scan_run, "run_batch", interrupted),
                mock.patch.object(recorder, "write_json_atomic", write_with_second_sigint),
            ):
                code, _, _ = run_cli("--csv", str(csv_path), "--repeats", "2")
            self.assertEqual(code, 130)
            meta = json.loads((Path(tmp) / "b.csv.meta.json").read_text())
            self.assertEqual(meta["status"], "interrupted")
            self.assertEqual(len(read_csv(csv_path)), 2)


def samples_for(b: int, values: list[float]) -> list[Sample]:
    return [Sample(batch_size=b, sequence_length=100, elapsed_ms=v, repeat=i) for i, v in enumerate(values)]


class ScanTableTest(unittest.TestCase):
    def test_table_from_hand_made_samples(self) -> None:
        samples = samples_for(1, [1.0, 2.0, 3.0]) + samples_for(2, [2.0, 2.0, 2.0, 10.0])
        table = scan_table(samples, {1: [0.5, 0.5], 2: [1.0]}, {1: 1_000_000, 2: 2_000_000})
        b1, b2 = table
        self.assertEqual((b1["p50_ms"], b1["min_ms"], b1["max_ms"]), (2.0, 1.0, 3.0))
        self.assertAlmostEqual(b1["p95_ms"], 2.9)
        self.assertEqual(b1["positions_per_s"], 1 * 100 / 0.002)
        self.assertEqual(b2["per_sequence_ms"], 1.0)
        self.assertEqual(b2["speedup"], 2.0)
        self.assertAlmostEqual(b1["kv_read_gb_s"], 1e6 / 0.002 / 1e9)
        self.assertAlmostEqual(b1["probe_read_gb_s"], 1e6 / 0.0005 / 1e9)
        self.assertAlmostEqual(b1["bandwidth_ratio"], 0.25)

    def test_saturation_verdicts(self) -> None:
        def table(pos: dict[int, float]) -> list[dict[str, float]]:
            return [{"batch_size": float(b), "positions_per_s": p} for b, p in pos.items()]

        self.assertTrue(
            saturation_verdict(table({1: 100, 2: 190, 4: 300, 8: 320})).startswith("Saturated at B = 4")
        )
        self.assertTrue(saturation_verdict(table({1: 100, 2: 105, 4: 400})).startswith("Saturated at B = 1"))
        verdict = saturation_verdict(table({1: 100, 2: 200, 4: 400}))
        self.assertTrue(verdict.startswith("Not reached"), verdict)
        # B 1 -> 4 is two doublings: x1.1 overall is about 4.9 % per doubling.
        self.assertTrue(saturation_verdict(table({1: 100, 4: 110})).startswith("Saturated at B = 1"))

    def test_config_validation(self) -> None:
        for kwargs, message in [
            ({"batch_sizes": ()}, "must not be empty"),
            ({"batch_sizes": (2, 2)}, "distinct"),
            ({"cache": "paged"}, "cache: must be one of"),
            ({"warmup": -1}, "warmup"),
        ]:
            with self.subTest(kwargs=kwargs), self.assertRaisesRegex(ValueError, message):
                ScanConfig(**kwargs)  # type: ignore[arg-type]


if __name__ == "__main__":
    unittest.main()
