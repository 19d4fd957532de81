# stub: replaced by the layout branch at merge
"""Errors the CLI maps to exit codes."""

from __future__ import annotations


class UsageError(Exception):
    """Bad command-line input, found before anything loads."""


class CommandFailed(Exception):
    """The command ran and failed."""
