"""cpu_load: /proc/stat parsed, other processes' busy CPUs estimated, the thread count decided with hysteresis.

Every reading is scripted (a fake /proc/stat text, CPU time and clock), so the decisions are checked
against hand-computed loads, never against the machine's: a busy other process gives fewer threads, an
idle machine all of them, load that hovers between the thresholds keeps the count, this process's own
time is never counted as another's (also with its real CPU time while it spins), and where /proc/stat
cannot be read the count is the default. An explicit --threads is never governed, but a count the
governor would lower at start gets one warning (measured over a scripted window).
"""

from __future__ import annotations

import tempfile
import unittest
from pathlib import Path

from attention_kv_caceh.cpu_load import (
    DROP_AT,
    TAKE_AT,
    LoadGovernor,
    LoadReading,
    StatTimes,
    decide_threads,
    explicit_threads_warning,
    measure_others_busy,
    others_busy_cpus,
    own_cpu_seconds,
    parse_proc_stat,
)
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.kernels.threads import current_threads
from attention_kv_caceh.model_executor.model import Model
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint
from tests.test_engine_model import FakeRequest, FakeSchedulerOutput

TICKS = 100  # USER_HZ of the scripted readings

STAT = """cpu  300 10 50 600 20 5 5 10 7 0
cpu0 100 5 20 400 10 2 3 0 7 0
cpu1 200 5 30 200 10 3 2 10 0 0
intr 12345 0 0
ctxt 999
procs_running 3
"""


def stat_text(busy: list[int], idle: list[int]) -> str:
    """A /proc/stat of len(busy) CPUs: CPU i spent busy[i] jiffies in user and idle[i] idle."""
    lines = [f"cpu  {sum(busy)} 0 0 {sum(idle)} 0 0 0 0 0 0"]
    lines += [f"cpu{i} {b} 0 0 {d} 0 0 0 0 0 0" for i, (b, d) in enumerate(zip(busy, idle, strict=True))]
    return "\n".join(lines) + "\nctxt 1\n"


class FakeMachine:
    """CPUs whose jiffies advance as scripted: each `advance(seconds, others, own)` adds `others` +
    `own` CPUs' worth of busy time spread over the CPUs, the rest idle, and `own` CPUs' worth to this
    process's CPU time; `read_stat`, `own_time` and `clock` are the governor's readers."""

    def __init__(self, cpus: int = 2) -> None:
        self.busy = [0] * cpus
        self.idle = [0] * cpus
        self.own_s = 0.0
        self.now = 0.0
        self.reads = 0

    def advance(self, seconds: float, others: float, own: float = 0.0) -> None:
        cpus = len(self.busy)
        per_cpu = seconds * TICKS
        busy = (others + own) * per_cpu / cpus
        for i in range(cpus):
            self.busy[i] += round(busy)
            self.idle[i] += round(per_cpu - busy)
        self.own_s += own * seconds
        self.now += seconds

    def read_stat(self) -> str:
        self.reads += 1
        return stat_text(self.busy, self.idle)

    def own_time(self) -> float:
        return self.own_s

    def clock(self) -> float:
        return self.now

    def governor(self, limit: int, cpu_ids: tuple[int, ...] | None = (0, 1)) -> LoadGovernor:
        return LoadGovernor(
            limit,
            cpu_ids,
            read_stat=self.read_stat,
            own_time=self.own_time,
            clock=self.clock,
            ticks_per_s=TICKS,
        )


class ParseTest(unittest.TestCase):
    def test_busy_is_the_first_eight_fields_less_idle_and_iowait(self) -> None:
        # cpu0: 100+5+20+400+10+2+3+0 = 540 total, busy 540-400-10 = 130 (guest 7 not added again)
        self.assertEqual(parse_proc_stat(STAT, [0]), StatTimes(busy=130, total=540, cpus=1))
        self.assertEqual(parse_proc_stat(STAT, [1]), StatTimes(busy=250, total=460, cpus=1))
        self.assertEqual(parse_proc_stat(STAT, [0, 1]), StatTimes(busy=380, total=1000, cpus=2))

    def test_the_aggregate_line_counts_without_a_cpu_set_or_when_one_of_it_is_missing(self) -> None:
        aggregate = StatTimes(busy=300 + 10 + 50 + 5 + 5 + 10, total=1000, cpus=2)
        self.assertEqual(parse_proc_stat(STAT), aggregate)
        self.assertEqual(parse_proc_stat(STAT, [0, 5]), aggregate)

    def test_old_kernels_four_fields_are_refused_and_five_accepted(self) -> None:
        self.assertEqual(parse_proc_stat("cpu 1 2 3 4 5\ncpu0 1 2 3 4 5\n"), StatTimes(6, 15, 1))
        for bad in ("", "intr 1 2\n", "cpu 1 2 3 4\n", "cpu 1 2 x 4 5\n"):
            with self.subTest(text=bad), self.assertRaises(ValueError):
                parse_proc_stat(bad)

    def test_this_machines_proc_stat_parses_where_there_is_one(self) -> None:
        path = Path("/proc/stat")
        if not path.exists():
            self.skipTest("no /proc/stat")
        times = parse_proc_stat(path.read_text())
        self.assertGreaterEqual(times.cpus, 1)
        self.assertTrue(0 <= times.busy <= times.total)


class EstimateTest(unittest.TestCase):
    def reading(self, busy: int, total: int, own_s: float, cpus: int = 2) -> LoadReading:
        return LoadReading(StatTimes(busy, total, cpus), own_s, 0.0)

    def test_others_are_the_busy_cpus_less_this_process_over_the_elapsed_time(self) -> None:
        # 1 s on 2 CPUs = 200 jiffies; 150 busy = 1.5 CPUs, of which this process 0.5 s -> others 1.0
        before, after = self.reading(1000, 5000, 3.0), self.reading(1150, 5200, 3.5)
        self.assertAlmostEqual(others_busy_cpus(before, after, TICKS) or -1, 1.0)

    def test_the_estimate_is_clipped_to_the_cpus(self) -> None:
        before = self.reading(0, 0, 0.0)
        self.assertEqual(others_busy_cpus(before, self.reading(100, 200, 2.0), TICKS), 0.0)  # own > busy
        self.assertEqual(others_busy_cpus(before, self.reading(900, 200, 0.0), TICKS), 2.0)

    def test_no_estimate_without_elapsed_jiffies_or_across_a_change_of_cpu_set(self) -> None:
        before = self.reading(10, 100, 0.0)
        self.assertIsNone(others_busy_cpus(before, self.reading(10, 100, 0.0), TICKS))
        self.assertIsNone(others_busy_cpus(before, self.reading(20, 300, 0.0, cpus=3), TICKS))


class DecideTest(unittest.TestCase):
    def test_on_two_cpus_one_busy_process_leaves_one_thread_and_an_idle_machine_two(self) -> None:
        self.assertEqual(decide_threads(2, 1.0, cpus=2, limit=2), 1)
        self.assertEqual(decide_threads(1, 0.0, cpus=2, limit=2), 2)
        self.assertEqual(decide_threads(2, 0.0, cpus=2, limit=2), 2)
        self.assertEqual(decide_threads(2, 2.0, cpus=2, limit=2), 1)  # never below one

    def test_each_thread_has_its_own_thresholds(self) -> None:
        # 8 CPUs: thread k is dropped above 8 - k + 0.6 busy, taken back below 8 - k + 0.3
        self.assertEqual(decide_threads(8, 2.7, cpus=8, limit=8), 5)  # 2.7 > 2.6 drops the 6th too
        self.assertEqual(decide_threads(8, 2.5, cpus=8, limit=8), 6)
        self.assertEqual(decide_threads(5, 2.25, cpus=8, limit=8), 6)  # < 2.3 takes the 6th back
        self.assertEqual(decide_threads(5, 2.4, cpus=8, limit=8), 5)

    def test_a_limit_below_the_cpus_keeps_threads_while_others_fill_the_rest(self) -> None:
        # a quota of 2 CPUs on 4: two other processes leave two CPUs free
        self.assertEqual(decide_threads(2, 2.0, cpus=4, limit=2), 2)
        self.assertEqual(decide_threads(2, 3.0, cpus=4, limit=2), 1)
        self.assertEqual(decide_threads(1, 0.0, cpus=4, limit=2), 2)

    def test_readings_that_hover_between_the_thresholds_do_not_flap(self) -> None:
        count, seen = 2, []
        for others in (0.0, 0.65, 0.5, 0.35, 0.55, 0.31, 0.59, 0.25, 0.45, 0.58, 0.4):
            count = decide_threads(count, others, cpus=2, limit=2)
            seen.append(count)
        self.assertEqual(seen, [2, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2])

    def test_bad_arguments_are_refused(self) -> None:
        for args in ((2, 0.0, 2, 0), (2, 0.0, 0, 2)):
            with self.subTest(args=args), self.assertRaises(ValueError):
                decide_threads(*args)
        with self.assertRaises(ValueError):
            decide_threads(2, 0.0, 2, 2, drop_at=TAKE_AT, take_at=DROP_AT)


class GovernorTest(unittest.TestCase):
    def test_a_busy_other_process_drops_a_thread_and_its_end_gives_it_back(self) -> None:
        m = FakeMachine()
        g = m.governor(limit=2)
        self.assertEqual(g.threads(), 2)  # the baseline: no estimate yet
        self.assertIsNone(g.last_others)
        seen = []
        for others in (0.0, 1.0, 1.0, 0.9, 0.0, 0.0):
            m.advance(0.5, others, own=1.0)  # this process busy on one CPU throughout
            seen.append(g.threads())
        self.assertEqual(seen, [2, 1, 1, 1, 2, 2])
        self.assertEqual(g.last_others, 0.0)

    def test_it_reads_at_most_every_interval(self) -> None:
        m = FakeMachine()
        g = m.governor(limit=2)
        g.threads()
        for _ in range(10):
            m.advance(0.04, others=1.0)  # 0.4 s: no new reading yet
            self.assertEqual(g.threads(), 2)
        self.assertEqual(m.reads, 1)
        m.advance(0.1, others=1.0)
        self.assertEqual(g.threads(), 1)
        self.assertEqual(m.reads, 2)
        self.assertAlmostEqual(g.last_others or -1, 1.0)

    def test_this_process_busy_on_every_cpu_keeps_every_thread(self) -> None:
        m = FakeMachine()
        g = m.governor(limit=2)
        g.threads()
        for _ in range(8):
            m.advance(0.5, others=0.0, own=2.0)
            self.assertEqual(g.threads(), 2)

    def test_this_process_spinning_for_real_is_not_counted_as_another(self) -> None:
        # the CPU time is this process's own (os.times) while it spins; the scripted /proc/stat shows
        # the machine's busy time as exactly that (nothing else running): the count must stay
        own0, clock = own_cpu_seconds(), [0.0]

        def read_stat() -> str:
            busy = round((own_cpu_seconds() - own0) * TICKS)
            return stat_text([busy, 0], [round(clock[0] * TICKS) - busy, round(clock[0] * TICKS)])

        g = LoadGovernor(2, (0, 1), read_stat=read_stat, clock=lambda: clock[0], ticks_per_s=TICKS)
        g.threads()
        for _ in range(4):
            start = own_cpu_seconds()
            while own_cpu_seconds() - start < 0.05:  # spin until a few ticks of CPU time pass
                pass
            clock[0] += max(0.5, own_cpu_seconds() - start)
            self.assertEqual(g.threads(), 2)
            self.assertLessEqual(g.last_others or 0.0, 0.05)

    def test_without_proc_stat_the_count_is_the_default(self) -> None:
        def missing() -> str:
            raise FileNotFoundError("/proc/stat")

        now = [0.0]
        g = LoadGovernor(4, (0, 1, 2, 3), read_stat=missing, clock=lambda: now[0])
        for _ in range(3):
            now[0] += 1.0
            self.assertEqual(g.threads(), 4)
        self.assertFalse(g.available)
        self.assertIsNone(g.last_others)
        g = LoadGovernor(3, read_stat=lambda: "not a stat file\n", clock=lambda: now[0])
        self.assertEqual(g.threads(), 3)

    def test_a_real_reading_gives_a_count_in_range(self) -> None:
        if not Path("/proc/stat").exists():
            self.skipTest("no /proc/stat")
        now = [0.0]
        g = LoadGovernor(2, clock=lambda: now[0])
        g.threads()
        now[0] += 1.0
        with tempfile.TemporaryFile() as f:  # some system time between the two readings
            f.write(b"x" * 1_000_000)
        self.assertIn(g.threads(), (1, 2))

    def test_bad_arguments_are_refused(self) -> None:
        with self.assertRaises(ValueError):
            LoadGovernor(0)
        with self.assertRaises(ValueError):
            LoadGovernor(2, interval_s=-1.0)


class StartMeasurementTest(unittest.TestCase):
    """`measure_others_busy` over a scripted window, and the warning for an explicit count."""

    def measure(self, machine: FakeMachine, others: float, own: float = 0.0) -> float | None:
        return measure_others_busy(
            (0, 1),
            0.25,
            read_stat=machine.read_stat,
            own_time=machine.own_time,
            sleep=lambda s: machine.advance(s, others, own),
            ticks_per_s=TICKS,
        )

    def test_one_busy_process_reads_as_one_cpu_and_this_process_is_left_out(self) -> None:
        m = FakeMachine()
        self.assertAlmostEqual(self.measure(m, 1.0) or 0.0, 1.0, places=6)
        self.assertAlmostEqual(self.measure(m, 0.0, own=1.0) or 0.0, 0.0, places=6)
        self.assertEqual(m.reads, 4)

    def test_without_proc_stat_nothing_is_measured(self) -> None:
        def missing() -> str:
            raise FileNotFoundError("/proc/stat")

        self.assertIsNone(measure_others_busy(read_stat=missing, sleep=lambda s: None))
        self.assertIsNone(measure_others_busy(read_stat=lambda: "no cpu lines\n", sleep=lambda s: None))
        with self.assertRaises(ValueError):
            measure_others_busy(window_s=0.0)

    def test_a_count_the_governor_would_lower_is_warned_about_naming_count_and_load(self) -> None:
        warning = explicit_threads_warning(2, 1.0, 2)
        assert warning is not None
        self.assertIn("--threads 2 on 2 CPUs", warning)
        self.assertIn("keep 1.0 of them busy", warning)
        self.assertIn("the default (no --threads) follows the load and would compute on 1 now", warning)
        self.assertIn("kept", warning)

    def test_no_warning_when_the_governor_would_keep_every_thread(self) -> None:
        self.assertIsNone(explicit_threads_warning(2, 0.0, 2))
        self.assertIsNone(explicit_threads_warning(2, DROP_AT - 0.01, 2))  # thread 2 kept below DROP_AT
        self.assertIsNone(explicit_threads_warning(1, 2.0, 2))  # one thread always runs
        self.assertIsNone(explicit_threads_warning(2, None, 2))  # not measured
        self.assertIsNone(explicit_threads_warning(2, 1.5, 4))  # two of four CPUs free enough
        self.assertIsNotNone(explicit_threads_warning(4, 1.0, 4))


class RunnerTest(unittest.TestCase):
    """The model runner governs only the default count; an explicit one is used as given."""

    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        cls.model = Model.load(write_random_checkpoint(Path(cls._tmp.name) / "m", "llama", "tiny"), "float32")

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def runner(self, threads: int | None) -> ModelRunner:
        return self.runner_of(EngineConfig(threads=threads, block_size=4))

    def runner_of(self, config: EngineConfig) -> ModelRunner:
        return ModelRunner(self.model, config, num_blocks=8)

    def step(self, runner: ModelRunner) -> None:
        req = FakeRequest("a", [1, 2, 3], 0, [0])
        runner.execute_model(FakeSchedulerOutput([req], {"a": 3}))  # pyright: ignore[reportArgumentType]

    def test_an_explicit_count_is_never_changed_by_load(self) -> None:
        runner = self.runner(1)
        self.assertIsNone(runner.governor)
        for _ in range(3):
            self.step(runner)
            self.assertEqual(runner.active_threads, 1)
            self.assertEqual(runner.model.threads, 1)

    def test_a_count_filled_in_as_a_default_follows_the_load(self) -> None:
        runner = self.runner_of(EngineConfig(threads=1, follow_load=True, block_size=4))
        self.assertIsNotNone(runner.governor)
        self.assertEqual(runner.governor.limit if runner.governor else 0, 1)

    def test_the_default_count_follows_the_governor(self) -> None:
        runner = self.runner(None)
        self.assertIsNotNone(runner.governor)
        m = FakeMachine()
        runner.governor = m.governor(limit=runner.threads)
        runner.governor.threads()
        m.advance(0.5, others=float(runner.threads))  # every CPU busy with others
        self.step(runner)
        self.assertEqual(runner.active_threads, 1)
        self.assertEqual(current_threads(), 1)
        m.advance(0.5, others=0.0)
        self.step(runner)
        self.assertEqual(runner.active_threads, runner.threads)
        self.assertEqual(runner.model.threads, runner.threads)


if __name__ == "__main__":
    unittest.main()
