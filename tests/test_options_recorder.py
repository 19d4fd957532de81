"""The one flag builder (`options.option`, `cli.flags`) and the run recorder (`recorder.RunRecorder`)."""

from __future__ import annotations

import csv
import json
import tempfile
import unittest
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from attention_kv_caceh.cli.common import OneLineParser, UsageError
from attention_kv_caceh.cli.flags import add_options, config_from_args
from attention_kv_caceh.options import ConfigError, check_options, flag_of, option
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.recorder import RunRecorder


def _lengths(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


@dataclass(frozen=True)
class _Config:
    seq_len: int = option(128, help="positions", minimum=1)
    rate: float = option(1.5, help="requests/s", minimum=0.0, maximum=100.0)
    cache: str = option("dynamic", help="layout", choices=("dynamic", "preallocated"))
    sizes: tuple[int, ...] = option((1, 2), help="sizes", parse=_lengths, flag="--batch-sizes", minimum=1)
    prefix_caching: bool = option(True, help="turn prefix caching off", flag="--no-prefix-caching")
    verbose: bool = option(False, help="say more")
    blocks: int | None = option(None, help="blocks", exclusive="kv", minimum=1, default_text="from memory")
    memory: int | None = option(None, help="bytes", exclusive="kv", minimum=1)
    note: str = "not an option"

    def __post_init__(self) -> None:
        check_options(self)
        if self.seq_len % 2:
            raise ConfigError("seq_len", f"must be even, got {self.seq_len}")


def _parse(argv: list[str]) -> _Config:
    parser = OneLineParser(prog="t")
    add_options(parser, _Config)
    return config_from_args(_Config, parser.parse_args(argv))


class OptionsTest(unittest.TestCase):
    def test_defaults_are_the_fields(self) -> None:
        self.assertEqual(_parse([]), _Config())

    def test_flags_set_fields(self) -> None:
        c = _parse(["--seq-len", "64", "--rate", "2", "--cache", "preallocated", "--batch-sizes", "4,8"])
        self.assertEqual((c.seq_len, c.rate, c.cache, c.sizes), (64, 2.0, "preallocated", (4, 8)))
        self.assertFalse(_parse(["--no-prefix-caching"]).prefix_caching)
        self.assertTrue(_parse(["--verbose"]).verbose)
        self.assertEqual(_parse(["--blocks", "6"]).blocks, 6)

    def test_bounds_name_the_flag_from_the_cli_and_the_field_from_the_library(self) -> None:
        for argv, flag, value in (
            (["--seq-len", "0"], "--seq-len", "0"),
            (["--rate", "101"], "--rate", "101.0"),
            (["--batch-sizes", "2,0"], "--batch-sizes", "0"),
            (["--seq-len", "3"], "--seq-len", "3"),
            (["--blocks", "0"], "--blocks", "0"),
        ):
            with self.subTest(argv=argv), self.assertRaises(UsageError) as ctx:
                _parse(argv)
            self.assertTrue(str(ctx.exception).startswith(flag + ":"), str(ctx.exception))
            self.assertIn(value, str(ctx.exception))
        with self.assertRaises(ConfigError) as lib:
            _Config(seq_len=0)
        self.assertEqual(lib.exception.field, "seq_len")
        self.assertTrue(str(lib.exception).startswith("seq_len:"))

    def test_text_that_is_no_value_is_a_usage_error(self) -> None:
        for argv in (["--seq-len", "x"], ["--rate", "fast"], ["--cache", "paged"], ["--batch-sizes", "a"]):
            with self.subTest(argv=argv), self.assertRaises(UsageError) as ctx:
                _parse(argv)
            self.assertIn(argv[0], str(ctx.exception))

    def test_exclusive_flags_refused_together(self) -> None:
        with self.assertRaises(UsageError) as ctx:
            _parse(["--blocks", "2", "--memory", "8"])
        self.assertIn("--memory", str(ctx.exception))

    def test_choices_checked_outside_the_cli_too(self) -> None:
        with self.assertRaises(ConfigError) as ctx:
            _Config(cache="paged")
        self.assertEqual(ctx.exception.field, "cache")

    def test_flag_names(self) -> None:
        self.assertEqual(flag_of(_Config, "sizes"), "--batch-sizes")
        self.assertEqual(flag_of(_Config, "seq_len"), "--seq-len")
        self.assertEqual(flag_of(_Config, "note"), "note")

    def test_help_shows_default_text(self) -> None:
        parser = OneLineParser(prog="t")
        add_options(parser, _Config, only=("blocks",))
        text = parser.format_help()
        self.assertIn("from memory", text)
        self.assertNotIn("--seq-len", text)

    def test_a_command_may_show_its_own_default(self) -> None:
        parser = OneLineParser(prog="t")
        add_options(parser, _Config, only=("blocks",), default_texts={"blocks": "4 here"})
        text = parser.format_help()
        self.assertIn("4 here", text)
        self.assertNotIn("from memory", text)


class RecorderTest(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = Path(tempfile.mkdtemp())
        self.path = self.dir / "run.csv"

    def _meta(self, path: Path) -> dict[str, object]:
        return json.loads(path.with_name(path.name + ".meta.json").read_text())

    def _rows(self) -> list[dict[str, str]]:
        with self.path.open() as f:
            return list(csv.DictReader(f))

    def _recorder(self, side_files: Callable[[RunRecorder], None] | None = None) -> RunRecorder:
        return RunRecorder(
            "test-run",
            self.path,
            ("step", "ms"),
            config={"n": 2},
            environment={"cpu": "x"},
            side_files=side_files,
        )

    def test_running_then_complete_with_every_row(self) -> None:
        with self._recorder() as run:
            self.assertEqual(self._meta(self.path)["status"], "running")
            self.assertEqual(self._rows(), [])
            run.add([{"step": 0, "ms": 1.5}])
            self.assertEqual(len(self._rows()), 1)
            run.add([{"step": 1, "ms": 2.5}])
        meta = self._meta(self.path)
        self.assertEqual((meta["status"], meta["kind"], meta["config"]), ("complete", "test-run", {"n": 2}))
        self.assertEqual([r["ms"] for r in self._rows()], ["1.5", "2.5"])

    def test_each_stop_keeps_the_rows_and_names_its_status(self) -> None:
        for exc, status in (
            (KeyboardInterrupt(), "interrupted"),
            (MemoryError(), "out-of-memory"),
            (OracleMismatch("max error 1"), "oracle-failed"),
            (RuntimeError("disk"), "failed"),
        ):
            with self.subTest(status=status), self.assertRaises(type(exc)), self._recorder() as run:
                run.add([{"step": 0, "ms": 1.0}])
                raise exc
            meta = self._meta(self.path)
            self.assertEqual(meta["status"], status)
            self.assertEqual(len(self._rows()), 1)
            self.assertEqual("error" in meta, status != "interrupted")

    def test_finish_is_final(self) -> None:
        with self.assertRaises(KeyboardInterrupt), self._recorder() as run:
            run.finish("oracle-failed", error="B=4")
            raise KeyboardInterrupt
        self.assertEqual(self._meta(self.path)["status"], "oracle-failed")

    def test_unknown_column_refused(self) -> None:
        with self.assertRaises(ValueError), self._recorder() as run:
            run.add([{"step": 0, "ms": 1.0, "extra": 1}])

    def test_side_files_follow_every_save(self) -> None:
        seen: list[tuple[str, int]] = []

        def side_files(r: RunRecorder) -> None:
            seen.append((r.status, len(r.rows)))

        with self._recorder(side_files) as run:
            run.add([{"step": 0, "ms": 1.0}])
        self.assertEqual(seen, [("running", 0), ("running", 1), ("complete", 1)])

    def test_before_save_updates_the_metadata_each_save_writes(self) -> None:
        recorder = RunRecorder(
            "test-run",
            self.path,
            ("step", "ms"),
            config={},
            environment={},
            before_save=lambda r: r.meta.update(rows=len(r.rows)),
        )
        with self.assertRaises(KeyboardInterrupt), recorder as run:
            self.assertEqual(self._meta(self.path)["rows"], 0)
            run.add([{"step": 0, "ms": 1.0}, {"step": 1, "ms": 2.0}])
            raise KeyboardInterrupt
        self.assertEqual((self._meta(self.path)["rows"], self._meta(self.path)["status"]), (2, "interrupted"))

    def test_rows_added_without_a_save_are_in_the_final_one(self) -> None:
        with self.assertRaises(KeyboardInterrupt), self._recorder() as run:
            run.add([{"step": 0, "ms": 1.0}])
            run.add([{"step": 1, "ms": 2.0}], save=False)
            self.assertEqual(len(self._rows()), 1)
            raise KeyboardInterrupt
        self.assertEqual([r["step"] for r in self._rows()], ["0", "1"])

    def test_jsonl_rows_are_on_disk_one_by_one(self) -> None:
        path = self.dir / "requests.jsonl"
        recorder = RunRecorder("serving", path, None, config={}, environment={})
        with self.assertRaises(KeyboardInterrupt), recorder as run:
            run.add([{"request_id": "a"}])
            run.add([{"request_id": "b"}])
            self.assertEqual(len(path.read_text().splitlines()), 2)
            raise KeyboardInterrupt
        self.assertEqual([json.loads(x)["request_id"] for x in path.read_text().splitlines()], ["a", "b"])
        self.assertEqual(self._meta(path)["status"], "interrupted")

    def test_without_a_save_on_open_the_metadata_waits_for_the_first_save(self) -> None:
        path = self.dir / "requests.jsonl"
        meta = path.with_name(path.name + ".meta.json")
        meta.write_text('{"status": "complete"}\n')  # an earlier run's
        run = RunRecorder("serving", path, None, config={}, environment={}, fsync=False, save_on_open=False)
        self.assertFalse(meta.exists())
        run.add([{"request_id": "a"}], save=False)
        self.assertFalse(meta.exists())
        self.assertEqual(len(path.read_text().splitlines()), 1)  # flushed, not fsynced
        run.finish("interrupted")
        self.assertEqual((self._meta(path)["status"], run.count), ("interrupted", 1))


@dataclass(frozen=True)
class _Negatable:
    smoke_test: bool = option(True, help="send one first", negatable=True)
    block_size: int = option(16, help="tokens per block", flag="--trace-block-size", minimum=1)

    def __post_init__(self) -> None:
        check_options(self)


class FlagExtensionsTest(unittest.TestCase):
    def parse(self, argv: list[str]) -> _Negatable:
        parser = OneLineParser(prog="t")
        add_options(parser, _Negatable, dest_prefix="trace_")
        args = parser.parse_args(argv)
        self.assertFalse(hasattr(args, "block_size"))  # its dest is trace_block_size
        return config_from_args(_Negatable, args, dest_prefix="trace_")

    def test_negatable_switch_and_dest_prefix(self) -> None:
        self.assertEqual(self.parse([]), _Negatable())
        self.assertFalse(self.parse(["--no-smoke-test"]).smoke_test)
        self.assertTrue(self.parse(["--no-smoke-test", "--smoke-test"]).smoke_test)
        self.assertEqual(self.parse(["--trace-block-size", "8"]).block_size, 8)
        with self.assertRaises(UsageError) as ctx:
            self.parse(["--trace-block-size", "0"])
        self.assertTrue(str(ctx.exception).startswith("--trace-block-size:"), str(ctx.exception))


if __name__ == "__main__":
    unittest.main()
