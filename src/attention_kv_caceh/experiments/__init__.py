"""Experiments: each builds its inputs, checks its oracle, times, and returns rows. None prints; the
commands in `cli/` print and write their files."""
