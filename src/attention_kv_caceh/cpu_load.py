"""How many of this process's CPUs other processes keep busy, and how many threads a step should take.

Every parallel region of a step ends in a barrier, so a thread that shares its core with another busy
process (it is descheduled for a time slice while it holds a chunk) holds the whole step back: on two
cores beside one `yes > /dev/null`, two threads run a decode step 1.5 to 2.2x slower than one
(docs/kernels.md, "Threads: one pool through the step"). `LoadGovernor` gives the engine core its
thread count for the next step when `--threads` is left at its default: the usable CPUs, less those
other processes keep busy.

Sources and units:
    /proc/stat (proc(5)): each `cpuN` line gives that CPU's time since boot in USER_HZ jiffies
        (`os.sysconf("SC_CLK_TCK")`, 100 a second on Linux), fields user nice system idle iowait irq
        softirq steal (guest and guest_nice follow; they are already counted in user and nice, so they
        are not added). busy = the eight fields' sum - idle - iowait. The lines of this process's CPU
        set (`os.sched_getaffinity`) are summed; where one is missing the aggregate `cpu` line counts,
        over all the CPUs it covers.
    This process's own CPU time: `os.times()` user + system, seconds, all its threads (its children
        left out), read with each /proc/stat sample.

The rule (`others_busy_cpus`, `decide_threads`): between two readings, the CPUs' worth other processes
kept busy is (busy jiffies / USER_HZ - own CPU seconds) / elapsed seconds, the elapsed time being the
CPUs' total jiffies / (CPUs * USER_HZ), clipped to [0, CPUs]. Thread k (2 <= k <= the limit) keeps
running while the others leave its CPU mostly free: it is dropped when they keep more than
CPUs - k + 0.6 busy, and taken back only when they keep less than CPUs - k + 0.3, so load that hovers
between the two does not flap the count. Thread 1 always runs. On two CPUs: one `yes` (1.0 CPU) ->
1 thread; an idle machine (0.0) -> 2.

A reading is taken at most every `interval_s` (0.5 s) when the count is asked for; between readings
the count stays. A count is a thread count only: the kernels give bit-identical results for every
count (`kernels/threads.py`), so the load changes the step's time, never its tokens.

At start (`measure_others_busy`): two readings `START_WINDOW_S` (0.25 s) apart give the CPUs other
processes keep busy before a command computes anything. `explicit_threads_warning` words the warning a
command prints when an explicit `--threads N` is more than the governor would take from that load, and
`LOAD_WARNING_CPUS` (0.5) is the load above which the batch-size scan says the machine is loaded.

Errors: where /proc/stat cannot be read or parsed (macOS, a sandbox), the governor keeps the limit
(the default count); `parse_proc_stat` raises ValueError for text without the lines it needs.
Niced processes count as busy as any other (/proc/stat cannot tell their weight), so a low-priority
job also lowers the count, at worst to one thread. Left out: vLLM has no counterpart (its CPU worker
binds a fixed thread count, `VLLM_CPU_OMP_THREADS_BIND`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DROP_AT",
    "FOLLOWS_LOAD",
    "INTERVAL_S",
    "LOAD_WARNING_CPUS",
    "PROC_STAT",
    "START_WINDOW_S",
    "TAKE_AT",
    "LoadGovernor",
    "LoadReading",
    "StatTimes",
    "decide_threads",
    "explicit_threads_warning",
    "measure_others_busy",
    "others_busy_cpus",
    "own_cpu_seconds",
    "parse_proc_stat",
]

PROC_STAT = Path("/proc/stat")
INTERVAL_S = 0.5
"""Seconds between two readings at least."""
DROP_AT = 0.6
"""Thread k is dropped when other processes keep more than CPUs - k + DROP_AT CPUs busy."""
TAKE_AT = 0.3
"""Thread k is taken back when other processes keep less than CPUs - k + TAKE_AT CPUs busy."""
FOLLOWS_LOAD = (
    "at most: the default follows the load, one thread fewer per CPU other processes keep busy "
    "(re-read every 0.5 s)"
)
"""What a command adds to its threads line when the count is the governed default."""
START_WINDOW_S = 0.25
"""Seconds between the two readings of `measure_others_busy` (25 jiffies per CPU at USER_HZ 100)."""
LOAD_WARNING_CPUS = 0.5
"""Other processes' busy CPUs from which the batch-size scan warns that its timings share the machine."""


@dataclass(frozen=True)
class StatTimes:
    """Jiffies since boot over `cpus` CPUs of /proc/stat: `busy` (total - idle - iowait) and `total`."""

    busy: int
    total: int
    cpus: int


@dataclass(frozen=True)
class LoadReading:
    """One sample: /proc/stat's `times` and this process's CPU seconds (`own_s`) at `at` (monotonic s)."""

    times: StatTimes
    own_s: float
    at: float


def _fields(line: str) -> tuple[int, int]:
    """(busy, total) jiffies of one `cpu` line. ValueError for fewer than 5 fields or a non-integer."""
    parts = line.split()
    try:
        values = [int(v) for v in parts[1:9]]
    except ValueError:
        raise ValueError(f"/proc/stat line {line!r} has a field that is not an integer") from None
    if len(values) < 5:
        raise ValueError(f"/proc/stat line {line!r} has fewer than user nice system idle iowait")
    total = sum(values)
    return total - values[3] - values[4], total


def parse_proc_stat(text: str, cpu_ids: Iterable[int] | None = None) -> StatTimes:
    """/proc/stat's text -> busy and total jiffies of the CPUs `cpu_ids` (the sum of their `cpuN`
    lines), or of the aggregate `cpu` line (all CPUs, counted by their `cpuN` lines) when `cpu_ids` is
    None or one of them has no line. ValueError when the lines needed are absent or malformed."""
    lines: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("cpu"):  # the long intr line is not split
            lines[line.split(maxsplit=1)[0]] = line
    ids = None if cpu_ids is None else sorted(set(cpu_ids))
    if ids and all(f"cpu{i}" in lines for i in ids):
        busy = total = 0
        for i in ids:
            b, t = _fields(lines[f"cpu{i}"])
            busy, total = busy + b, total + t
        return StatTimes(busy, total, len(ids))
    if "cpu" not in lines:
        raise ValueError("/proc/stat has no aggregate 'cpu' line")
    busy, total = _fields(lines["cpu"])
    count = sum(1 for name in lines if name[3:].isdigit())
    return StatTimes(busy, total, max(1, count))


def others_busy_cpus(before: LoadReading, after: LoadReading, ticks_per_s: float) -> float | None:
    """CPUs' worth other processes kept busy between two readings: (busy jiffies / ticks_per_s - own
    CPU seconds) / elapsed seconds (total jiffies / (CPUs * ticks_per_s)), clipped to [0, CPUs]. None
    when no jiffy elapsed or the CPU set changed between them."""
    b, a = before.times, after.times
    if a.cpus != b.cpus or a.total <= b.total:
        return None
    elapsed_s = (a.total - b.total) / (a.cpus * ticks_per_s)
    others_s = (a.busy - b.busy) / ticks_per_s - (after.own_s - before.own_s)
    return min(float(a.cpus), max(0.0, others_s / elapsed_s))


def decide_threads(
    current: int, others: float, cpus: int, limit: int, drop_at: float = DROP_AT, take_at: float = TAKE_AT
) -> int:
    """The thread count after `current` (clipped to [1, limit]) given `others` CPUs' worth busy with
    other processes on `cpus` CPUs: thread k (k >= 2) is dropped while others > cpus - k + drop_at and
    taken back while others < cpus - k + take_at (drop_at > take_at: between them the count stays).
    ValueError for limit < 1, cpus < 1 or take_at >= drop_at."""
    if limit < 1 or cpus < 1 or take_at >= drop_at:
        raise ValueError(
            f"need limit >= 1, cpus >= 1, take_at < drop_at; got {limit}, {cpus}, {take_at}, {drop_at}"
        )
    n = min(max(1, current), limit)
    while n > 1 and others > cpus - n + drop_at:
        n -= 1
    while n < limit and others < cpus - (n + 1) + take_at:
        n += 1
    return n


def own_cpu_seconds() -> float:
    """This process's CPU time so far, user + system of all its threads, seconds (`os.times()`)."""
    t = os.times()
    return t.user + t.system


def _read_proc_stat() -> str:
    return PROC_STAT.read_text()


def _ticks_per_s() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100.0


class LoadGovernor:
    """The thread count of the next step: `limit` (the usable CPUs) less the CPUs other processes keep
    busy on `cpu_ids` (this process's CPU set), re-read at most every `interval_s` seconds.

    `threads()` returns the count to use now (1 .. limit). `last_others` holds the latest estimate of
    other processes' busy CPUs (None before two readings, or where /proc/stat cannot be read: then
    the count stays `limit`). The readers are arguments so tests can script them: `read_stat` returns
    /proc/stat's text (OSError: unavailable), `own_time` this process's CPU seconds, `clock`
    monotonic seconds. ValueError for limit < 1 or interval_s < 0.
    """

    def __init__(
        self,
        limit: int,
        cpu_ids: Iterable[int] | None = None,
        *,
        interval_s: float = INTERVAL_S,
        read_stat: Callable[[], str] = _read_proc_stat,
        own_time: Callable[[], float] = own_cpu_seconds,
        clock: Callable[[], float] = time.monotonic,
        ticks_per_s: float | None = None,
    ) -> None:
        if limit < 1 or interval_s < 0:
            raise ValueError(f"need limit >= 1 and interval_s >= 0, got {limit}, {interval_s}")
        self.limit = limit
        self.cpu_ids = None if cpu_ids is None else tuple(cpu_ids)
        self.interval_s = interval_s
        self._read_stat, self._own_time, self._clock = read_stat, own_time, clock
        self.ticks_per_s = _ticks_per_s() if ticks_per_s is None else ticks_per_s
        self.current = limit
        self.last_others: float | None = None
        self.available = True
        self._last: LoadReading | None = None
        self._last_at: float | None = None

    def _reading(self, now: float) -> LoadReading | None:
        try:
            times = parse_proc_stat(self._read_stat(), self.cpu_ids)
        except (OSError, ValueError):
            return None
        return LoadReading(times, self._own_time(), now)

    def threads(self) -> int:
        """The count for the step about to run: re-read /proc/stat when `interval_s` has passed since
        the last reading (the first call takes the baseline), else the count of the last decision."""
        if not self.available:
            return self.current
        now = self._clock()
        if self._last_at is not None and now - self._last_at < self.interval_s:
            return self.current
        self._last_at = now
        reading = self._reading(now)
        if reading is None:
            self.available, self.current, self.last_others = False, self.limit, None
            return self.current
        before, self._last = self._last, reading
        if before is None:
            return self.current
        others = others_busy_cpus(before, reading, self.ticks_per_s)
        if others is not None:
            self.last_others = others
            self.current = decide_threads(self.current, others, reading.times.cpus, self.limit)
        return self.current


def measure_others_busy(
    cpu_ids: Iterable[int] | None = None,
    window_s: float = START_WINDOW_S,
    *,
    read_stat: Callable[[], str] = _read_proc_stat,
    own_time: Callable[[], float] = own_cpu_seconds,
    sleep: Callable[[float], None] = time.sleep,
    ticks_per_s: float | None = None,
) -> float | None:
    """CPUs' worth other processes keep busy now, on the CPUs `cpu_ids` (None: all): two readings of
    /proc/stat and this process's CPU time, `window_s` seconds apart (`others_busy_cpus`), the caller
    sleeping in between. None where /proc/stat cannot be read or parsed, or no jiffy elapsed. The
    readers are arguments so tests can script them. ValueError for window_s <= 0."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    ids = None if cpu_ids is None else tuple(cpu_ids)
    ticks = _ticks_per_s() if ticks_per_s is None else ticks_per_s
    try:
        before = LoadReading(parse_proc_stat(read_stat(), ids), own_time(), 0.0)
        sleep(window_s)
        after = LoadReading(parse_proc_stat(read_stat(), ids), own_time(), window_s)
    except (OSError, ValueError):
        return None
    return others_busy_cpus(before, after, ticks)


def explicit_threads_warning(
    threads: int, others: float | None, cpus: int, flag: str = "--threads"
) -> str | None:
    """The warning for an explicit thread count (`flag` THREADS) on `cpus` CPUs while other processes
    keep `others` CPUs' worth busy, or None: None when `others` is None (not measured) or the governor
    would keep all `threads` (`decide_threads` from `threads` with that load). Otherwise it names the
    count, the busy CPUs, what the default would take now and that the default follows the load."""
    if others is None or threads < 2:
        return None
    governed = decide_threads(threads, others, max(cpus, 1), threads)
    if governed >= threads:
        return None
    return (
        f"warning: {flag} {threads} on {cpus} CPU{'s' if cpus != 1 else ''} while other processes keep "
        f"{others:.1f} of them busy: a thread that shares its CPU holds every step back at a barrier "
        "(it can run many times slower than one thread; docs/kernels.md, Threads); "
        f"the default (no {flag}) follows the load and would compute on {governed} now. "
        "The count given is kept."
    )
