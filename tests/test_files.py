"""files.py: atomic writes leave either the old file or the new one, never a partial one."""

from __future__ import annotations

import json
import os
import socket
import stat
import tempfile
import unittest
from collections.abc import Callable
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.files import (
    JsonlWriter,
    NotARegularFileError,
    atomic_write_bytes,
    atomic_write_text,
    check_not_inputs,
    check_output_path,
    meta_path,
    strict_json_value,
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


def _kind(path: Path) -> tuple[int, int]:
    """(file type bits, inode) of what is at `path`, symlinks not followed: proves it was left untouched."""
    st = os.lstat(path)
    return stat.S_IFMT(st.st_mode), st.st_ino


class NonRegularTargetTest(unittest.TestCase):
    """Output paths that name a device, FIFO, socket or folder are refused and left as they are."""

    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self._tmp.name)
        self._sockets: list[socket.socket] = []

    def tearDown(self) -> None:
        for sock in self._sockets:
            sock.close()
        self._tmp.cleanup()

    def _targets(self) -> dict[str, Path]:
        """One of each kind of non-regular target (a character device only where mknod is allowed)."""
        targets: dict[str, Path] = {}
        fifo = self.dir / "fifo.json"
        os.mkfifo(fifo)
        targets["fifo"] = fifo
        sock_path = self.dir / "sock.json"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(sock_path))
        self._sockets.append(sock)
        targets["socket"] = sock_path
        folder = self.dir / "folder.json"
        folder.mkdir()
        targets["folder"] = folder
        device = self.dir / "null.json"
        try:  # `mknod X c 1 3`: a /dev/null of our own (needs root and the capability)
            os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
            targets["character device"] = device
        except (PermissionError, OSError):
            pass
        link = self.dir / "link-to-devnull.json"  # a symlink is followed: its target is a device
        link.symlink_to(os.devnull)
        targets["symlink to a device"] = link
        link_fifo = self.dir / "link-to-fifo.json"
        link_fifo.symlink_to(fifo)
        targets["symlink to a FIFO"] = link_fifo
        return targets

    def test_check_output_path_refuses_non_regular_targets_and_leaves_them(self) -> None:
        for name, path in self._targets().items():
            with self.subTest(name):
                before = _kind(path)
                with self.assertRaisesRegex(ValueError, "--summary-json .*(folder|device|FIFO|socket)"):
                    check_output_path(path, "--summary-json")
                with self.assertRaises(ValueError):  # with a suffix check too
                    check_output_path(path, "--summary-json", (".json",))
                self.assertEqual(_kind(path), before)

    def test_writers_refuse_non_regular_targets_and_leave_them(self) -> None:
        writers: dict[str, Callable[[Path], object]] = {
            "write_json_atomic": lambda p: write_json_atomic(p, {"a": 1}),
            "write_csv_atomic": lambda p: write_csv_atomic(p, [{"x": 1}], ["x"]),
            "atomic_write_text": lambda p: atomic_write_text(p, "x"),
            "atomic_write_bytes": lambda p: atomic_write_bytes(p, b"x"),
            "JsonlWriter": lambda p: JsonlWriter(p).close(),
        }
        targets = self._targets()
        names_before = sorted(p.name for p in self.dir.iterdir())
        for target_name, path in targets.items():
            for writer_name, write in writers.items():
                with self.subTest(target=target_name, writer=writer_name):
                    before = _kind(path)
                    with self.assertRaises(NotARegularFileError):
                        write(path)
                    self.assertEqual(_kind(path), before)
        self.assertEqual(sorted(p.name for p in self.dir.iterdir()), names_before)  # no temp, no meta
        self.assertTrue(issubclass(NotARegularFileError, OSError))  # callers' OSError handling covers it

    def test_symlink_to_regular_file_is_written_through_and_kept(self) -> None:
        real = self.dir / "real.json"
        real.write_text("old")
        link = self.dir / "link.json"
        link.symlink_to(real)
        self.assertEqual(check_output_path(link, "--summary-json", (".json",)), link)
        self.assertEqual(write_json_atomic(link, {"a": 1}), link)  # the path as given
        self.assertTrue(link.is_symlink())
        self.assertEqual(json.loads(real.read_text()), {"a": 1})
        with JsonlWriter(link) as out:
            out.write({"b": 2})
        self.assertTrue(link.is_symlink())
        self.assertEqual(real.read_text(), '{"b":2}\n')
        self.assertEqual(sorted(p.name for p in self.dir.iterdir()), ["link.json", "real.json"])

    def test_symlink_loop_is_refused_by_the_check_and_the_writers(self) -> None:
        a, b = self.dir / "a.json", self.dir / "b.json"
        a.symlink_to(b)
        b.symlink_to(a)
        with self.assertRaisesRegex(ValueError, "--summary-json .*a.json.*cannot use this path"):
            check_output_path(a, "--summary-json")
        with self.assertRaises(OSError):
            write_json_atomic(a, {})
        with self.assertRaises(OSError):
            JsonlWriter(a)
        self.assertEqual(sorted(p.name for p in self.dir.iterdir()), ["a.json", "b.json"])
        self.assertTrue(a.is_symlink() and b.is_symlink())

    def test_dangling_symlink_creates_its_target(self) -> None:
        link = self.dir / "link.csv"
        link.symlink_to(self.dir / "sub" / "target.csv")
        self.assertEqual(check_output_path(link, "--csv", (".csv",)), link)
        write_csv_atomic(link, [{"x": 1}], ["x"])
        self.assertTrue(link.is_symlink())
        self.assertEqual((self.dir / "sub" / "target.csv").read_text().splitlines(), ["x", "1"])


class NotAnInputTest(unittest.TestCase):
    """check_not_inputs: an output that would write a file the command reads is refused, however it is
    spelled (the same path, a symlink, a hard link, a file inside an input folder)."""

    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self._tmp.name)
        self.data = self.dir / "d.jsonl"
        self.data.write_text('{"prompt": "x"}\n')

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def refused(self, output: Path, inputs: list[tuple[str, str | os.PathLike[str] | None]]) -> str:
        with self.assertRaises(ValueError) as caught:
            check_not_inputs([("--out", output)], inputs)
        return str(caught.exception)

    def test_every_spelling_of_an_input_is_refused_naming_both_flags(self) -> None:
        (self.dir / "hard.jsonl").hardlink_to(self.data)
        (self.dir / "sym.jsonl").symlink_to(self.data)
        (self.dir / "dangling.jsonl").symlink_to(self.dir / "new.jsonl")
        sub = self.dir / "sub"
        sub.mkdir()
        spellings = [
            self.data,
            self.dir / "." / "d.jsonl",
            sub / ".." / "d.jsonl",
            self.dir / "hard.jsonl",
            self.dir / "sym.jsonl",
        ]
        for output in spellings:
            message = self.refused(output, [("--dataset", self.data)])
            self.assertIn("--out", message)
            self.assertIn("--dataset", message)
            self.assertNotIn("\n", message)
        # a dangling symlink writes its target: refused when the target is an input path
        self.refused(self.dir / "dangling.jsonl", [("--dataset", self.dir / "new.jsonl")])

    def test_a_file_inside_an_input_folder_is_an_input(self) -> None:
        model = self.dir / "model"
        model.mkdir()
        (model / "config.json").write_text("{}")
        message = self.refused(model / "config.json", [("--model", model)])
        self.assertIn("config.json", message)
        check_not_inputs([("--out", model / "results.json")], [("--model", model)])  # a new file: fine

    def test_other_files_and_absent_inputs_pass(self) -> None:
        check_not_inputs([("--out", self.dir / "out.jsonl")], [("--dataset", self.data)])
        check_not_inputs([("--out", self.dir / "out.jsonl")], [("--dataset", None)])
        check_not_inputs([("--out", None)], [("--dataset", self.data)])
        check_not_inputs([("--out", self.dir / "a.json")], [("--dataset", self.dir / "missing.jsonl")])


class SuffixTest(unittest.TestCase):
    def test_suffixes_are_exact_and_lower_case(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            for name in ("B.CSV", "B.Csv", "up/B.CSV"):
                with self.subTest(name), self.assertRaisesRegex(ValueError, r"--csv .*use \.csv"):
                    check_output_path(Path(tmp) / name, "--csv", (".csv",))
            with self.assertRaisesRegex(ValueError, r"must end in \.png$"):
                check_output_path(Path(tmp) / "x.jpg", "--plot", (".png",))
            self.assertEqual(check_output_path(Path(tmp) / "B.csv", "--csv", (".csv",)).name, "B.csv")


def _refuse_constant(token: str) -> object:
    raise AssertionError(f"non-strict JSON token {token} written")


def _expected(obj: object) -> object:
    """The oracle for strict_json_value, written independently: what a strict parser must read back."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: _expected(v) for k, v in obj.items()}  # type: ignore[union-attr]
    if isinstance(obj, list | tuple):
        return [_expected(v) for v in obj]  # type: ignore[union-attr]
    return obj


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.sampled_from([float("nan"), float("inf"), -float("inf")])  # often, not by chance
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)


class StrictJsonTest(unittest.TestCase):
    @settings(max_examples=60, deadline=None)
    @given(value=json_values)
    def test_written_json_never_holds_nan_or_infinity(self, value: object) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            doc = {"value": value}
            path = write_json_atomic(Path(tmp) / "m.json", doc)
            read = json.loads(path.read_text(), parse_constant=_refuse_constant)
            self.assertEqual(read, _expected(doc))
            with JsonlWriter(Path(tmp) / "r.jsonl", fsync=False) as out:
                out.write(doc)
            line = (Path(tmp) / "r.jsonl").read_text()
            self.assertEqual(json.loads(line, parse_constant=_refuse_constant), _expected(doc))

    def test_non_finite_numpy_and_python_floats_become_null(self) -> None:
        doc = {
            "nan": float("nan"),
            "inf": [float("inf"), -float("inf")],
            "np": (np.float32("nan"), np.float64("inf"), np.float32(1.5)),
            "finite": 2.5,
        }
        self.assertEqual(
            strict_json_value(doc),
            {"nan": None, "inf": [None, None], "np": [None, None, 1.5], "finite": 2.5},
        )
        with tempfile.TemporaryDirectory() as tmp:
            text = write_json_atomic(Path(tmp) / "m.json", doc).read_text()
        for token in ("NaN", "Infinity"):
            self.assertNotIn(token, text)

    def test_unencodable_objects_still_raise_type_error(self) -> None:
        with tempfile.TemporaryDirectory() as tmp, self.assertRaises(TypeError):
            write_json_atomic(Path(tmp) / "m.json", {"x": object()})


if __name__ == "__main__":
    unittest.main()
