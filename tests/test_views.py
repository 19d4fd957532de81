"""Every observation of the view/copy table, pinned: a change in NumPy's behaviour fails here."""

from __future__ import annotations

import csv
import io
import json
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from attention_kv_caceh import cli
from attention_kv_caceh.experiments.views import VIEW_TABLE_COLUMNS, run_views
from attention_kv_caceh.report import build_report
from attention_kv_caceh.report.views import views_markdown

# experiment -> (same_object, shares_memory, write_propagates, shape, strides, c_contiguous, held)
EXPECTED = {
    "list assignment": (True, True, True, "len 2", "-", "-", True),
    "shallow copy": (False, True, True, "len 2", "-", "-", True),
    "basic slice": (False, True, True, "(2, 2, 4)", "(48, 16, 4)", "False", True),
    # The one prediction that fails: fancy indexing copies into an [index, B, D] buffer, transposed.
    "advanced indexing": (False, False, False, "(2, 2, 4)", "(16, 32, 4)", "False", False),
    "swapaxes": (False, True, True, "(2, 4, 3)", "(48, 4, 16)", "False", True),
    "concatenate": (False, False, False, "(2, 4, 4)", "(64, 16, 4)", "True", True),
}


class ViewTableTest(unittest.TestCase):
    def test_six_experiments_in_order(self) -> None:
        rows = run_views()
        self.assertEqual([r.experiment for r in rows], list(EXPECTED))

    def test_every_observation(self) -> None:
        for row in run_views():
            with self.subTest(experiment=row.experiment):
                observed = (
                    row.same_object,
                    row.shares_memory,
                    row.write_propagates,
                    row.shape,
                    row.strides,
                    row.c_contiguous,
                    row.prediction_held,
                )
                self.assertEqual(observed, EXPECTED[row.experiment])

    def test_views_are_the_ones_that_propagate(self) -> None:
        # Sharing memory and a propagating write go together in every experiment.
        for row in run_views():
            with self.subTest(experiment=row.experiment):
                self.assertEqual(row.shares_memory, row.write_propagates)

    def test_markdown_has_a_row_per_experiment(self) -> None:
        text = views_markdown(run_views())
        lines = text.strip().splitlines()
        self.assertEqual(len(lines), 2 + 6)
        self.assertIn("prediction held", lines[0])
        self.assertEqual(sum("**no**" in line for line in lines), 1)


class ViewsCommandTest(unittest.TestCase):
    def test_writes_csv_and_markdown(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            csv_path, md_path = Path(tmp, "out", "views.csv"), Path(tmp, "views.md")
            out = io.StringIO()
            with redirect_stdout(out):
                code = cli.main(["views", "--csv", str(csv_path), "--md", str(md_path)])
            self.assertEqual(code, 0)
            with csv_path.open(newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                self.assertEqual(tuple(reader.fieldnames or ()), VIEW_TABLE_COLUMNS)
                rows = list(reader)
            self.assertEqual([r["experiment"] for r in rows], list(EXPECTED))
            self.assertEqual(rows[3]["strides"], "(16, 32, 4)")
            self.assertTrue(Path(str(csv_path) + ".meta.json").exists())
            self.assertEqual(md_path.read_text(encoding="utf-8"), views_markdown(run_views()))
            self.assertIn("| basic slice |", out.getvalue())
            beside = csv_path.with_suffix(".md")
            self.assertTrue(out.getvalue().rstrip().endswith(f"{csv_path}.meta.json, {beside}, {md_path}"))
            meta = json.loads(Path(f"{csv_path}.meta.json").read_text(encoding="utf-8"))
            self.assertEqual(meta["status"], "complete")
            # the run's Markdown beside its CSV is the report's section of that CSV
            report = build_report(csv_path.parent, Path(tmp, "REPORT.md"), plot=False)
            self.assertEqual(report.problems, [])
            self.assertIn(beside.read_text(encoding="utf-8"), report.markdown)

    def test_unwritable_output_writes_nothing(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            blocker = Path(tmp, "file.txt")
            blocker.write_text("x", encoding="utf-8")
            Path(tmp, "taken.csv.meta.json").mkdir()
            for argv in (
                ["--csv", f"{tmp}/v.csv", "--md", f"{blocker}/v.md"],
                ["--csv", f"{blocker}/v.csv", "--md", f"{tmp}/v.md"],
                ["--csv", f"{tmp}/taken.csv", "--md", f"{tmp}/v.md"],
            ):
                out, err = io.StringIO(), io.StringIO()
                with self.subTest(argv=argv), redirect_stdout(out), redirect_stderr(err):
                    self.assertEqual(cli.main(["views", *argv]), 2)
                self.assertEqual(len(err.getvalue().strip().splitlines()), 1)
                self.assertEqual(out.getvalue(), "")
            self.assertEqual(sorted(p.name for p in Path(tmp).iterdir()), ["file.txt", "taken.csv.meta.json"])


if __name__ == "__main__":
    unittest.main()
