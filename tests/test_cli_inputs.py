"""No command ever writes over a file it reads: every output path is checked against every input path
(symlinks resolved, hard links included, the files of an input folder) before anything is opened; the
command exits 2 with one line and the input keeps its bytes."""

from __future__ import annotations

import contextlib
import io
import tempfile
import unittest
from pathlib import Path

from attention_kv_caceh import cli
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint

_DATASET = "".join(f'{{"prompt": "hello there number {i}", "output_len": 4}}\n' for i in range(4))


class OutputNeverReplacesAnInputTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        cls.root = Path(cls._tmp.name)
        cls.model = write_random_checkpoint(cls.root / "model", "llama", "tiny", seed=1)

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def setUp(self) -> None:
        self.dir = Path(tempfile.mkdtemp(dir=self.root))

    def refuse(self, argv: list[str], victim: Path) -> str:
        """Run the command; it must exit 2 with one stderr line and leave `victim` as it was."""
        before = victim.read_bytes()
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
        lines = [line for line in err.getvalue().splitlines() if not line.startswith("warning:")]
        self.assertEqual(code, 2, err.getvalue())
        self.assertEqual(len(lines), 1, err.getvalue())
        self.assertNotIn("Traceback", err.getvalue())
        self.assertEqual(victim.read_bytes(), before)
        return lines[0]

    def dataset(self, name: str) -> Path:
        path = self.dir / name
        path.write_text(_DATASET)
        return path

    def test_harness_jsonl_over_its_dataset(self) -> None:
        data = self.dataset("f.jsonl")
        line = self.refuse(
            ["harness", "--dataset", str(data), "--jsonl", str(data), "--num-requests", "2"], data
        )
        self.assertIn("--jsonl", line)
        self.assertIn("--dataset", line)

    def test_harness_summary_json_over_its_dataset(self) -> None:
        data = self.dataset("f.json")
        argv = ["harness", "--dataset", str(data), "--summary-json", str(data), "--num-requests", "2"]
        self.assertIn("--summary-json", self.refuse(argv, data))

    def test_harness_jsonl_over_a_hard_link_of_its_dataset(self) -> None:
        data = self.dataset("f.jsonl")
        link = self.dir / "other.jsonl"
        link.hardlink_to(data)
        self.refuse(["harness", "--dataset", str(data), "--jsonl", str(link), "--num-requests", "2"], data)

    def test_harness_engine_summary_over_the_checkpoint_config(self) -> None:
        config = self.model / "config.json"
        argv = ["harness", "--backend", "engine", "--model", str(self.model), "--summary-json", str(config)]
        self.assertIn("--model", self.refuse(argv, config))

    def test_harness_summary_over_the_tokenizer_file(self) -> None:
        tokenizer = self.model / "tokenizer.json"
        argv = ["harness", "--tokenizer", str(self.model), "--summary-json", str(tokenizer)]
        self.assertIn("--tokenizer", self.refuse(argv, tokenizer))

    def test_generate_output_over_its_prompts_file(self) -> None:
        prompts = self.dir / "prompts.jsonl"
        prompts.write_text("one prompt\nanother\n")
        argv = [
            "generate",
            "--model",
            str(self.model),
            "--prompts-file",
            str(prompts),
            "--output",
            str(prompts),
        ]
        self.assertIn("--prompts-file", self.refuse([*argv, "--max-tokens", "2"], prompts))

    def test_bench_engine_json_over_the_checkpoint_config(self) -> None:
        config = self.model / "config.json"
        self.refuse(["bench-engine", "--model", str(self.model), "--json", str(config)], config)

    def test_sweep_point_file_over_its_dataset(self) -> None:
        out = self.dir / "out"
        out.mkdir()
        data = out / "c1-r0.jsonl"  # the name the sweep gives its first point's records
        data.write_text(_DATASET)
        argv = ["sweep", "--dataset", str(data), "--out-dir", str(out), "--concurrency", "1", "2"]
        self.assertIn("--dataset", self.refuse([*argv, "--num-requests", "2"], data))

    def test_report_out_through_a_symlink_to_a_raw_file(self) -> None:
        results = self.dir / "results"
        results.mkdir()
        raw = results / "requests.jsonl"
        raw.write_text("{}\n")
        link = self.dir / "report.md"
        link.symlink_to(raw)
        self.assertIn(
            "--results", self.refuse(["report", "--results", str(results), "--out", str(link)], raw)
        )


if __name__ == "__main__":
    unittest.main()
