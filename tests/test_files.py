"""files.py: atomic writes leave either the old file or the new one, never a partial one."""

from __future__ import annotations

import json
import os
import tempfile
import unittest
from pathlib import Path

from attention_kv_caceh.files import (
    JsonlWriter,
    check_output_path,
    meta_path,
    write_csv_atomic,
    write_json_atomic,
)


class AtomicWriteTest(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self._tmp.name)

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def test_csv_creates_parents_and_writes_rows(self) -> None:
        path = self.dir / "a" / "b" / "x.csv"
        write_csv_atomic(path, [{"x": 1, "y": 2}, {"x": 3, "y": 4}], ["x", "y"])
        self.assertEqual(path.read_text().splitlines(), ["x,y", "1,2", "3,4"])
        self.assertEqual([p.name for p in path.parent.iterdir()], ["x.csv"])  # no temp file left

    def test_failed_write_keeps_old_file_and_leaves_no_temp(self) -> None:
        path = self.dir / "x.csv"
        write_csv_atomic(path, [{"x": 1}], ["x"])

        def rows():  # type: ignore[no-untyped-def]
            yield {"x": 2}
            raise KeyboardInterrupt

        with self.assertRaises(KeyboardInterrupt):
            write_csv_atomic(path, rows(), ["x"])
        self.assertEqual(path.read_text().splitlines(), ["x", "1"])
        self.assertEqual(len(list(self.dir.iterdir())), 1)

    def test_written_files_get_umask_permissions_not_0600(self) -> None:
        old = os.umask(0o022)
        try:
            path = write_csv_atomic(self.dir / "x.csv", [{"x": 1}], ["x"])
        finally:
            os.umask(old)
        self.assertEqual(path.stat().st_mode & 0o777, 0o644)

    def test_check_output_path(self) -> None:
        (self.dir / "file.txt").write_text("x")
        with self.assertRaisesRegex(ValueError, "--csv .*file.txt is not a folder"):
            check_output_path(self.dir / "file.txt" / "x.csv", "--csv")
        with self.assertRaisesRegex(ValueError, "is a folder"):
            check_output_path(self.dir, "--csv")
        with self.assertRaisesRegex(ValueError, r"must end in \.png"):
            check_output_path(self.dir / "x.jpg", "--plot", (".png",))
        before = sorted(self.dir.iterdir())
        self.assertEqual(check_output_path(self.dir / "new" / "x.csv", "--csv"), self.dir / "new" / "x.csv")
        self.assertEqual(sorted(self.dir.iterdir()), before)  # nothing created, not even the folder
        self.assertEqual(meta_path(self.dir / "x.csv").name, "x.csv.meta.json")

    def test_unknown_column_raises(self) -> None:
        with self.assertRaises(ValueError):
            write_csv_atomic(self.dir / "x.csv", [{"x": 1, "z": 2}], ["x"])
        self.assertFalse((self.dir / "x.csv").exists())

    def test_json_and_jsonl(self) -> None:
        write_json_atomic(self.dir / "m.json", {"a": [1, 2]})
        self.assertEqual(json.loads((self.dir / "m.json").read_text()), {"a": [1, 2]})
        with JsonlWriter(self.dir / "r.jsonl") as out:
            out.write({"id": 1})
            out.write({"id": 2, "v": None})
            self.assertEqual(len((self.dir / "r.jsonl").read_text().splitlines()), 2)  # flushed per line
        lines = [json.loads(line) for line in (self.dir / "r.jsonl").read_text().splitlines()]
        self.assertEqual(lines, [{"id": 1}, {"id": 2, "v": None}])


if __name__ == "__main__":
    unittest.main()
