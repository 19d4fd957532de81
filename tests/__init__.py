"""The test suite (run: `uv run python -m unittest discover -s tests`).

A suite started as a background job of a non-interactive shell (`cmd &`) inherits SIGINT ignored, and
Python then leaves it ignored, so a Ctrl-C never becomes KeyboardInterrupt, in this process or in the
children it starts. The Ctrl-C tests import `ctrl_c_as_in_a_terminal` to get a terminal's behaviour
either way.
"""

from __future__ import annotations

import signal


def ctrl_c_as_in_a_terminal() -> None:
    """Install Python's own SIGINT handler (KeyboardInterrupt); children started later get SIG_DFL."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
