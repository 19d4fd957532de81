"""The test suite (run: `uv run python -m unittest discover -s tests`).

A suite started as a background job of a non-interactive shell (`cmd &`) inherits SIGINT ignored, and
Python then leaves it ignored, so a Ctrl-C never becomes KeyboardInterrupt, in this process or in the
children it starts. The Ctrl-C tests import `ctrl_c_as_in_a_terminal` to get a terminal's behaviour
either way.

The batch-size scan measures other processes' load before timing and warns on stderr when they keep
half a CPU busy; the modules that run it in-process and count its stderr lines call
`as_on_a_quiet_machine` in setUpModule, so that the suite's own neighbours (a loaded CI machine) do
not add a line.
"""

from __future__ import annotations

import signal
import unittest
from unittest import mock


def ctrl_c_as_in_a_terminal() -> None:
    """Install Python's own SIGINT handler (KeyboardInterrupt); children started later get SIG_DFL."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def as_on_a_quiet_machine() -> None:
    """For the calling test module: `cpu_load.measure_others_busy` reads no load (0.0 busy CPUs) until
    the module's tests end; a test that needs a load patches it again inside."""
    from attention_kv_caceh import cpu_load

    patcher = mock.patch.object(cpu_load, "measure_others_busy", return_value=0.0)
    patcher.start()
    unittest.addModuleCleanup(patcher.stop)
