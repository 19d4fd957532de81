"""The command layer (`cli/`): one shape resolver for every command, each `--help` default shown once,
one exit code per cause, and a Ctrl-C before the command starts is one line."""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
import unittest
import unittest.mock

from attention_kv_caceh import cli, memory
from attention_kv_caceh.cli import cache as cache_cli
from attention_kv_caceh.cli import scan as scan_cli
from attention_kv_caceh.cli.common import CommandFailed, UsageError
from attention_kv_caceh.memory import format_bytes
from attention_kv_caceh.presets import MODEL_PRESETS, kv_cache_bytes, resolve_shape


def quietly(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


class ShapeResolverTest(unittest.TestCase):
    CASES: tuple[tuple[list[str], tuple[int, int, int]], ...] = (
        (["--model", "llama-3-8b"], (32, 8, 128)),
        (["--model", "LLAMA-3-8B"], (32, 8, 128)),
        (["--model", "llama-3-8b", "--num-heads", "16"], (16, 8, 128)),
        (["--model", "Llama-3-8B", "--num-kv-heads", "4", "--head-dim", "64"], (32, 4, 64)),
        (["--num-heads", "4"], (4, 4, None)),  # no preset: H_kv = H; D the command's default
    )

    def test_scan_and_cache_resolve_the_same_shape(self) -> None:
        for flags, (h, h_kv, d) in self.CASES:
            with self.subTest(flags=flags):
                scan = scan_cli.scan_config(cli.build_parser("").parse_args(flags))
                cache = cache_cli.cache_config(cli.build_parser("cache").parse_args(flags))
                for config in (scan, cache):
                    self.assertEqual((config.num_heads, config.num_kv_heads), (h, h_kv))
                    if d is not None:
                        self.assertEqual(config.head_dim, d)
                self.assertEqual(scan.model, cache.model)

    def test_precedence_explicit_then_preset_then_default(self) -> None:
        shape = resolve_shape(None, None, None, None, default_num_heads=3, default_head_dim=5)
        self.assertEqual((shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.model), (3, 3, 5, ""))
        for name, preset in MODEL_PRESETS.items():
            shape = resolve_shape(name.upper(), None, None, None, default_num_heads=1, default_head_dim=1)
            self.assertEqual(
                (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.model),
                (preset.num_heads, preset.num_kv_heads, preset.head_dim, name),
            )
        with self.assertRaisesRegex(ValueError, "unknown model preset 'gpt-5'"):
            resolve_shape("gpt-5", None, None, None, default_num_heads=1, default_head_dim=1)

    def test_kv_cache_bytes_against_a_counted_buffer(self) -> None:
        import numpy as np

        for b, h_kv, t, d, dtype in ((1, 1, 1, 1, np.float32), (2, 8, 129, 128, np.float64)):
            k = np.zeros((b, h_kv, t, d), dtype=dtype)  # [B, H_kv, T, D]
            self.assertEqual(kv_cache_bytes(b, h_kv, t, d, k.itemsize), 2 * k.nbytes)  # K and V
        llama = MODEL_PRESETS["llama-3-8b"]
        self.assertEqual(llama.kv_bytes_per_token(np.float16), 32 * kv_cache_bytes(1, 8, 1, 128, 2))


class MemoryCheckTest(unittest.TestCase):
    def test_format_bytes_units(self) -> None:
        cases = {0: "0 B", 1023: "1023 B", 1024: "1.00 KiB", 3 * 2**19: "1.50 MiB", 2**31: "2.00 GiB"}
        for n, text in cases.items():
            self.assertEqual(format_bytes(n), text)

    def test_one_fraction_of_the_process_limit(self) -> None:
        with unittest.mock.patch.object(memory, "memory_limit_bytes", return_value=2**30):
            self.assertEqual(memory.memory_budget_bytes(), int(2**30 * memory.MEMORY_FRACTION))
            memory.check_memory(int(2**30 * memory.MEMORY_FRACTION), "a run", "--x")  # at the budget: fits
            with self.assertRaisesRegex(memory.MemoryBudgetError, "a run needs about .* lower --x"):
                memory.check_memory(int(2**30 * memory.MEMORY_FRACTION) + 1, "a run", "--x")
        with unittest.mock.patch.object(memory, "memory_limit_bytes", return_value=None):
            memory.check_memory(2**62, "a run", "--x")  # unknown machine: no check


class HelpTest(unittest.TestCase):
    def test_every_flag_of_every_command_shows_its_default_once(self) -> None:
        for name in cli.SUBCOMMANDS:
            parser = cli.build_parser(name)
            formatter = parser._get_formatter()  # the one HelpFormatter every command uses
            for action in parser._actions:
                if not action.option_strings or isinstance(action, argparse._HelpAction):
                    continue
                if action.help == argparse.SUPPRESS:  # a refused flag kept out of the help (serve --api-key)
                    continue
                with self.subTest(command=name or "(scan)", flag=action.option_strings[0]):
                    text = formatter._expand_help(action)
                    self.assertEqual(text.count("(default:"), 1, text)
                    self.assertNotIn("(default: None)", text)

    def test_scan_help_lists_every_subcommand(self) -> None:
        text = cli.build_parser("").format_help()
        for name in cli.SUBCOMMANDS:
            self.assertIn(name, text)


class ExitCodeTest(unittest.TestCase):
    def run_with(self, raised: BaseException) -> tuple[int, str]:
        def run(args: argparse.Namespace) -> int:
            raise raised

        original = scan_cli.run
        scan_cli.run = run  # type: ignore[assignment]
        try:
            code, _, err = quietly(["--repeats", "1"])
        finally:
            scan_cli.run = original
        return code, err

    def test_each_cause_has_its_code_and_one_line(self) -> None:
        for raised, code in (
            (UsageError("bad"), 2),
            (CommandFailed("broke"), 1),
            (OSError("disk full"), 1),
            (KeyboardInterrupt(), 130),
        ):
            with self.subTest(raised=type(raised).__name__):
                got, err = self.run_with(raised)
                self.assertEqual(got, code)
                self.assertEqual(len(err.strip().splitlines()), 1, err)

    def test_a_word_that_is_no_subcommand_is_refused_with_the_nearest_one(self) -> None:
        for word, hint in (("harnes", "'harness'"), ("serv", "'serve'"), ("qqq", "subcommands: cache")):
            with self.subTest(word=word):
                code, out, err = quietly([word])
                self.assertEqual((code, out), (2, ""))
                self.assertEqual(len(err.splitlines()), 1, err)
                self.assertIn(repr(word), err)
                self.assertIn(hint, err)

    def test_a_value_error_after_work_started_is_a_bug_not_a_usage_error(self) -> None:
        code, err = self.run_with(ValueError("surprise"))
        self.assertEqual(code, 1)
        first = err.splitlines()[0]
        self.assertIn("internal error", first)
        self.assertIn("ValueError: surprise", first)
        self.assertIn("Traceback", err)


class InterruptAtStartTest(unittest.TestCase):
    def test_the_entry_point_imports_nothing_heavy_before_main(self) -> None:
        # So a Ctrl-C while NumPy, aiohttp or matplotlib load lands inside `main`, which catches it.
        code = "import sys, attention_kv_caceh.benchmark; print(sorted({'numpy', 'aiohttp', 'matplotlib'} & set(sys.modules)))"
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
        )
        self.assertEqual(proc.stdout.strip(), "[]")

    def test_ctrl_c_while_the_command_imports_is_one_line(self) -> None:
        def interrupted(name: str) -> object:
            raise KeyboardInterrupt

        with unittest.mock.patch.object(cli.importlib, "import_module", interrupted):
            code, out, err = quietly(["cache", "--steps", "4"])
        self.assertEqual((code, out), (130, ""))
        self.assertEqual(err, "attention-kv-caceh: interrupted\n")


if __name__ == "__main__":
    unittest.main()
