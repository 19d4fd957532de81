"""The console entry point (`attention_kv_caceh.benchmark:main`, the `attention-kv-caceh` command): re-exports `cli.main`.

The command itself (the batch-size scan and the subcommands) lives in `attention_kv_caceh.cli`.
`measure`, `summarize_samples` and `Sample` (the lab's first scripts import them from here) are re-exported lazily,
so starting the command imports nothing heavy before `main` can catch a Ctrl-C.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from attention_kv_caceh.cli import main

if TYPE_CHECKING:
    from attention_kv_caceh.timing import Sample, measure, summarize_samples

__all__ = ["Sample", "main", "measure", "summarize_samples"]


def __getattr__(name: str) -> Any:
    if name in ("Sample", "measure", "summarize_samples"):
        from attention_kv_caceh import timing

        return getattr(timing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    sys.exit(main())
