"""The `attention-kv-caceh` command: the only part of the package that parses flags, prints, and maps
errors to exit codes.

    attention-kv-caceh --csv results/benchmark.csv     # no subcommand: the batch-size scan
    attention-kv-caceh SUBCOMMAND --help               # cache, views, report, harness, sweep,
                                                       # overhead, make-model, generate, bench-engine, serve

Convention (every subcommand follows it, so adding one is adding a module and a line in SUBCOMMANDS):

- `cli/<name>.py` exposes `HELP: str` (one line, shown in the command's --help),
  `add_arguments(parser: argparse.ArgumentParser) -> None` and `run(args: argparse.Namespace) -> int`.
- `add_arguments` declares the fields of the command's config dataclasses as flags (`cli/flags.py`
  builds each from the field's `options.option` metadata: flag, help, bounds); defaults are shown by
  `common.HelpFormatter`. `run` builds the configs (`flags.config_from_args`: a field's refusal is a
  UsageError naming its flag), then the library runs and `report/` writes the text that is printed.
- `run` checks everything else that can be checked up front (flag combinations, every output path with
  `common.check_outputs`, the memory estimate with `common.check_memory`) and raises `common.UsageError`
  before touching any file; after work has started it raises `common.CommandFailed` (or returns 1 after
  printing one line); it returns 0 when done and 130 when it caught a Ctrl-C and saved what it had.
  Heavy imports (NumPy, the experiments, aiohttp, matplotlib) stay inside `run` or module level of the
  subcommand module, which `main` imports only when that subcommand is chosen.

Exit codes, mapped here and nowhere else: 0 done; 1 a failure after work started (`CommandFailed`, an
`OSError` from a file, an oracle mismatch), one line on stderr; 2 bad usage (`UsageError`, a run too
large for this machine's memory and a word that is no subcommand included), one line on stderr, no file
touched; 130 Ctrl-C, 143 SIGTERM (treated like Ctrl-C: one line, every file complete, metadata `status:
interrupted`). Any other exception is a bug: one line saying so, then its traceback, exit 1. A closed
stdout (`| head`) exits 1 quietly (stdout pointed at os.devnull, as CPython's documentation of SIGPIPE
recommends); the commands write their files before printing their results.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any, cast

from attention_kv_caceh.cli.common import (
    PROG,
    CommandFailed,
    HelpFormatter,
    OneLineParser,
    UsageError,
    stdout_closed,
)

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

# name -> module under attention_kv_caceh.cli; "" is the default command (no subcommand given).
SUBCOMMANDS: dict[str, str] = {
    "": "scan",
    "cache": "cache",
    "views": "views",
    "report": "report",
    "harness": "harness",
    "sweep": "sweep",
    "overhead": "overhead",
    "make-model": "make_model",
    "generate": "generate",
    "bench-engine": "bench_engine",
    "serve": "serve",
}

_EXIT_SIGTERM = 143  # 128 + SIGTERM, as shells report it


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"attention_kv_caceh.cli.{SUBCOMMANDS[name]}")


class _DefaultParser(OneLineParser):
    """The scan's parser; its --help lists the subcommands (their modules are imported only then)."""

    def format_help(self) -> str:
        self.epilog = "subcommands (each has --help):\n" + "\n".join(
            f"  {name:<10} {_module(name).HELP}" for name in SUBCOMMANDS if name
        )
        return super().format_help()


def build_parser(name: str = "") -> argparse.ArgumentParser:
    """The parser of subcommand `name` ("" for the default scan), flags declared by its module."""
    module = _module(name)
    cls = _DefaultParser if not name else OneLineParser
    parser = cls(
        prog=f"{PROG} {name}".rstrip(),
        description=module.HELP,
        formatter_class=HelpFormatter,
    )
    module.add_arguments(parser)
    return parser


def _sigint_ignored_at_start(signum: int, frame: FrameType | None) -> None:
    """Stands for a SIGINT ignored when the process started (a background job, `nohup`): still ignored,
    but told apart from the SIG_IGN of a final save (`files.ignoring_sigint`)."""


class _Terminated:
    """SIGTERM handling: note it, then stop the command the way a Ctrl-C does (its save, `status:
    interrupted`, one line). During a final save (SIGINT ignored) it waits for the save to finish."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.seen = True
        current = signal.getsignal(signal.SIGINT)
        if current is _sigint_ignored_at_start:
            raise KeyboardInterrupt
        if current is not signal.SIG_IGN:
            signal.raise_signal(signal.SIGINT)


def _run(argv: list[str]) -> int:
    name = argv[0] if argv and argv[0] in SUBCOMMANDS and argv[0] else ""
    if argv and not name and not argv[0].startswith("-"):  # the scan takes no positional argument
        import difflib

        close = difflib.get_close_matches(argv[0], [n for n in SUBCOMMANDS if n], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UsageError(
            f"{argv[0]!r} is not a subcommand ({hint}subcommands: {', '.join(n for n in SUBCOMMANDS if n)})"
        )
    rest = argv[1:] if name else argv
    parser = build_parser(name)
    args = parser.parse_args(rest)
    run = cast(Callable[[argparse.Namespace], int], _module(name).run)
    return int(run(args))


def main(argv: list[str] | None = None) -> int:
    """Entry point of `attention-kv-caceh`; returns the exit code (see the module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    terminated = _Terminated()
    previous: Any = None
    previous_sigint: Any = None
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:
        previous = signal.signal(signal.SIGTERM, terminated)
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            previous_sigint = signal.signal(signal.SIGINT, _sigint_ignored_at_start)
    try:
        code = _run(args)
        sys.stdout.flush()  # a closed pipe is found here, not in the interpreter's exit
        return _EXIT_SIGTERM if terminated.seen and code == 130 else code
    except BrokenPipeError:  # stdout's reader left (`| head`); the command wrote its files before printing
        stdout_closed()
        return 1
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except (CommandFailed, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # commands that keep samples handle it themselves; the rest stop here
        print(f"{PROG}: {'terminated' if terminated.seen else 'interrupted'}", file=sys.stderr)
        return _EXIT_SIGTERM if terminated.seen else 130
    except Exception as exc:
        print(
            f"{PROG}: internal error (a bug, please report it): {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        traceback.print_exc()
        return 1
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
            if previous_sigint is not None:
                signal.signal(signal.SIGINT, previous_sigint)
