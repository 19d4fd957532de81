"""The timeline's server lines show what the server reported, when it reported it; and the run's
limits refuse schedules and benchmarks that could only fail late."""

from __future__ import annotations

import unittest

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from attention_kv_caceh.harness.backends import ServerSample
from attention_kv_caceh.harness.load import arrival_offsets_s
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.run import HarnessConfig, RunResult
from attention_kv_caceh.harness.timeline import draw_timeline

MS = 1_000_000


def result_with_samples(samples: list[ServerSample]) -> RunResult:
    r = RequestRecord(0, 0, 1, sent_ns=0)
    r.add_token_event(10 * MS, 1)
    r.status = "ok"
    return RunResult(
        config=HarnessConfig(),
        records=[r],
        summary={},
        start_ns=0,
        end_ns=100 * MS,
        in_flight=[(0, 1), (10 * MS, 0)],
        server_samples=samples,
        server_exact=[],
        server_metrics_errors=[],
    )


class TimelineServerLinesTest(unittest.TestCase):
    def test_steps_start_at_the_server_sample_times_and_each_sample_is_marked(self) -> None:
        samples = [ServerSample(5 * MS, 1, 0), ServerSample(40 * MS, 3, 2), ServerSample(90 * MS, 0, 0)]
        fig = draw_timeline(result_with_samples(samples))
        try:
            bottom = fig.axes[1]
            lines = {line.get_label(): line for line in bottom.get_lines() if isinstance(line, Line2D)}
            running = lines["server running"]
            self.assertEqual(running.get_drawstyle(), "steps-post")  # a value holds until the next sample
            self.assertEqual(list(np.asarray(running.get_xdata())), [5.0, 40.0, 90.0])
            self.assertEqual(list(np.asarray(running.get_ydata())), [1, 3, 0])
            self.assertNotIn(running.get_marker(), (None, "None", "", " "))
            self.assertIn("3 server samples", bottom.get_title())
            fig.canvas.draw()
            legend = bottom.get_legend()
            assert legend is not None
            box, panel = legend.get_window_extent(), bottom.get_window_extent()
            self.assertGreaterEqual(box.x0, panel.x1)  # beside the panel, not over the curves
        finally:
            plt.close(fig)


class TimelineRequestBarsTest(unittest.TestCase):
    def test_lateness_and_queue_are_separate_bars(self) -> None:
        r = RequestRecord(0, 0, 1, dispatch_ns=5 * MS, sent_ns=12 * MS)
        r.add_token_event(20 * MS, 1)
        r.add_token_event(30 * MS, 1)
        r.status = "ok"
        result = result_with_samples([])
        result.records = [r]
        fig = draw_timeline(result)
        try:
            spans = sorted(
                (round(p.get_x(), 6), round(p.get_x() + p.get_width(), 6))
                for p in fig.axes[0].patches
                if isinstance(p, Rectangle)
            )
            # lateness 0-5, queue 5-12, TTFT 12-20, decoding 20-30; never one bar for 0-12
            self.assertEqual(spans, [(0.0, 5.0), (5.0, 12.0), (12.0, 20.0), (20.0, 30.0)])
            self.assertIn("lateness", fig.axes[0].get_title())
        finally:
            plt.close(fig)


class ScheduleLimitsTest(unittest.TestCase):
    def test_a_vanishing_request_rate_is_refused_up_front(self) -> None:
        with self.assertRaisesRegex(ValueError, "^request_rate: 1e-300"):
            HarnessConfig(request_rate=1e-300)
        with self.assertRaisesRegex(ValueError, "too"):
            arrival_offsets_s(3, 1e-300, 1.0, np.random.default_rng(0))
        HarnessConfig(request_rate=0.01)  # 16 requests over ~1600 s is fine


if __name__ == "__main__":
    unittest.main()
