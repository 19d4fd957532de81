"""scripts/make_trace.py: bad values refused at the command line (exit 2, one line, no traceback), every
row within --max-blocks, and the rows it writes readable as a trace."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from attention_kv_caceh.harness.trace import TraceSettings, read_trace

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "make_trace.py"


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)


class MakeTraceTest(unittest.TestCase):
    def test_bad_values_exit_2_with_one_line_naming_the_flag(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "t.jsonl")
            for argv, flag in (
                (["--block-size", "0"], "--block-size"),
                (["--sessions", "0"], "--sessions"),
                (["--system-prompts", "0"], "--system-prompts"),
                (["--rate", "0"], "--rate"),
                (["--rate", "-1"], "--rate"),
                (["--rate", "nan"], "--rate"),
                (["--rows", "-3"], "--rows"),
                (["--min-output", "10", "--max-output", "2"], "--min-output"),
                (["--max-blocks", "1"], "--max-blocks"),
                (["--system-blocks", "0", "--turn-blocks", "0", "--unique-blocks", "0"], "--system-blocks"),
                (["--out", "/sys/x/t.jsonl"], "--out"),
            ):
                with self.subTest(argv=argv):
                    run = _run("--out", out, *argv)
                    self.assertEqual(run.returncode, 2, run.stderr)
                    self.assertNotIn("Traceback", run.stderr)
                    self.assertIn(flag, run.stderr.strip().splitlines()[-1])
                    self.assertFalse(Path(out).exists())

    def test_every_row_is_within_max_blocks_and_reads_as_a_trace(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "t.jsonl"
            run = _run("--out", str(out), "--rows", "60", "--max-blocks", "13", "--rate", "50")
            self.assertEqual(run.returncode, 0, run.stderr)
            rows = [json.loads(line) for line in out.read_text().splitlines()]
            self.assertEqual(len(rows), 60)
            self.assertLessEqual(max(len(r["hash_ids"]) for r in rows), 13)
            self.assertEqual(max(len(r["hash_ids"]) for r in rows), 12)  # 8 + 2 turns + 2 of its own
            timestamps = [r["timestamp"] for r in rows]
            self.assertEqual(timestamps, sorted(timestamps))
            self.assertGreaterEqual(timestamps[0], 0)
            self.assertEqual(len(read_trace(TraceSettings(str(out), "mooncake", 16, 1.0))), 60)


if __name__ == "__main__":
    unittest.main()
