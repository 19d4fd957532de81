"""Metric definitions against hand-computed values, the E2EL invariant, goodput, arrivals, lengths."""

from __future__ import annotations

import math
import unittest

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.harness.load import LengthRange, arrival_offsets_s
from attention_kv_caceh.harness.metrics import GoodputSLO, compute_request_metrics, parse_goodput
from attention_kv_caceh.harness.records import JSONL_KEYS, STATUS_OK, RequestRecord
from attention_kv_caceh.harness.summary import summarize_run

MS = 1_000_000


def ok_record(
    request_id: int, arrival: int, sent: int, times: list[int], per_event: list[int] | None = None
) -> RequestRecord:
    record = RequestRecord(request_id, arrival, requested_prompt_tokens=10, prompt_tokens=10, sent_ns=sent)
    for t, n in zip(times, per_event or [1] * len(times), strict=True):
        record.add_token_event(t, n)
    record.output_tokens = sum(record.tokens_per_event)
    record.stream_end_ns = times[-1] + 1 * MS
    record.status = STATUS_OK
    return record


class RequestMetricsTest(unittest.TestCase):
    def test_hand_computed_request(self) -> None:
        # arrival 0, sent 5 ms, tokens at 25, 35, 55 ms (first event carries 2 tokens): 4 tokens
        r = ok_record(0, 0, 5 * MS, [25 * MS, 35 * MS, 55 * MS], [2, 1, 1])
        m = r.metrics()
        self.assertEqual(m.queue_ms, 5.0)
        self.assertEqual(m.ttft_ms, 20.0)
        self.assertEqual(m.ttft_from_arrival_ms, 25.0)
        self.assertEqual(m.itl_ms, (10.0, 20.0))
        self.assertEqual(m.tpot_ms, 30.0 / 2)  # (55 - 25) / (4 - 2)
        self.assertEqual(m.e2el_ms, 50.0)
        self.assertEqual(m.e2e_ms, 55.0)

    def test_one_token_response_has_no_itl_and_no_tpot(self) -> None:
        m = ok_record(0, 0, 0, [30 * MS]).metrics()
        self.assertEqual(m.itl_ms, ())
        self.assertIsNone(m.tpot_ms)
        self.assertEqual(m.e2el_ms, 30.0)
        self.assertIsNone(ok_record(0, 0, 0, [30 * MS], [3]).metrics().tpot_ms)

    def test_request_without_tokens_has_no_ttft(self) -> None:
        r = RequestRecord(0, 0, 1, sent_ns=MS)
        m = r.metrics()
        self.assertEqual(m.queue_ms, 1.0)
        self.assertIsNone(m.ttft_ms)
        self.assertIsNone(m.e2el_ms)
        self.assertIsNone(r.to_json()["tpot_ms"])

    def test_tpot_is_undefined_not_zero_when_every_event_came_in_one_read(self) -> None:
        r = ok_record(0, 0, 0, [5 * MS, 5 * MS, 5 * MS])  # three events, one timestamp
        self.assertEqual(r.output_tokens, 3)
        self.assertIsNone(r.metrics().tpot_ms)

    def test_bad_timestamps_raise(self) -> None:
        with self.assertRaisesRegex(ValueError, "non-decreasing"):
            compute_request_metrics(
                arrival_ns=0,
                sent_ns=0,
                first_token_ns=5,
                token_times_ns=[5, 3],
                tokens_per_event=[1, 1],
                finish_ns=3,
                output_tokens=2,
            )

    @settings(max_examples=200, deadline=None)
    @given(
        queue=st.integers(0, 10**10),
        ttft=st.integers(0, 10**10),
        gaps=st.lists(st.integers(0, 10**9), max_size=50),
    )
    def test_e2el_is_ttft_plus_sum_of_itl(self, queue: int, ttft: int, gaps: list[int]) -> None:
        sent = 10**12 + queue
        times = [sent + ttft]
        for gap in gaps:
            times.append(times[-1] + gap)
        m = ok_record(0, 10**12, sent, times).metrics()
        assert m.ttft_ms is not None
        assert m.e2el_ms is not None
        assert m.e2e_ms is not None
        self.assertTrue(math.isclose(m.e2el_ms, m.ttft_ms + math.fsum(m.itl_ms), abs_tol=1e-6))
        self.assertTrue(math.isclose(m.e2e_ms, (m.queue_ms or 0) + m.e2el_ms, abs_tol=1e-6))

    def test_jsonl_keys_are_the_issues_list(self) -> None:
        self.assertEqual(tuple(ok_record(3, 0, 0, [MS, 2 * MS]).to_json()), JSONL_KEYS)

    def test_unknown_failure_kind_is_refused(self) -> None:
        with self.assertRaisesRegex(ValueError, "oops"):
            RequestRecord(0, 0, 1).fail("oops", "x")


class SummaryTest(unittest.TestCase):
    def test_e2el_statistics_hand_computed(self) -> None:
        # E2ELs 1 s, 1 s, 10 s: mean 4000 ms, median 1000 ms, population std 4242.64 ms
        records = [ok_record(i, 0, 0, [0, e * 1000 * MS]) for i, e in enumerate((1, 1, 10))]
        s = summarize_run(records, duration_s=10.0)
        self.assertAlmostEqual(s["mean_e2el_ms"], 4000.0)
        self.assertAlmostEqual(s["median_e2el_ms"], 1000.0)
        self.assertAlmostEqual(s["std_e2el_ms"], math.sqrt(((3000**2) * 2 + 6000**2) / 3))
        self.assertAlmostEqual(s["max_e2el_ms"], 10000.0)
        self.assertAlmostEqual(s["p99_e2el_ms"], 1000 + 0.98 * 9000)  # linear interpolation
        self.assertEqual(s["count_itl"], 3)
        self.assertAlmostEqual(s["request_throughput"], 0.3)
        self.assertEqual(s["total_output_tokens"], 6)
        self.assertAlmostEqual(s["output_throughput"], 0.6)

    def test_failures_are_counted_not_averaged_and_empty_metrics_are_null(self) -> None:
        good = ok_record(0, 0, 0, [10 * MS])
        bad = RequestRecord(1, 0, 1, sent_ns=0)
        bad.fail("http_error", "HTTP 500")
        s = summarize_run([good, bad], duration_s=1.0)
        self.assertEqual((s["completed"], s["failed"], s["failures"]), (1, 1, {"http_error": 1}))
        self.assertIsNone(s["mean_tpot_ms"])
        self.assertIsNone(s["mean_itl_ms"])
        self.assertEqual(s["mean_ttft_ms"], 10.0)

    def test_goodput(self) -> None:
        fast = ok_record(0, 0, 0, [10 * MS, 20 * MS])  # ttft 10, tpot 10, e2el 20
        slow = ok_record(1, 0, 0, [50 * MS, 60 * MS])  # ttft 50
        single = ok_record(2, 0, 0, [15 * MS])  # tpot undefined: cannot violate
        s = summarize_run([fast, slow, single], 2.0, slo=parse_goodput(["ttft:20", "tpot:10"]))
        self.assertEqual(s["good_requests"], 2)
        self.assertAlmostEqual(s["request_goodput"], 1.0)
        self.assertFalse(GoodputSLO(e2el_ms=19).is_good(fast.metrics()))

    def test_goodput_parse_errors_name_the_item(self) -> None:
        for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["ttft:-1"], ["ttft:1", "ttft:2"]):
            with self.subTest(bad=bad), self.assertRaisesRegex(ValueError, bad[-1]):
                parse_goodput(bad)


class ArrivalsAndLengthsTest(unittest.TestCase):
    def test_infinite_rate_sends_all_at_once(self) -> None:
        self.assertEqual(arrival_offsets_s(4, math.inf, 1.0, np.random.default_rng(0)), [0.0] * 4)

    def test_gamma_arrivals_have_the_asked_rate_and_burstiness(self) -> None:
        for burstiness in (0.5, 1.0, 4.0):
            offsets = arrival_offsets_s(20001, 50.0, burstiness, np.random.default_rng(1))
            gaps = np.diff(offsets)
            self.assertAlmostEqual(float(gaps.mean()), 1 / 50, delta=0.05 / 50)
            # gamma(k, theta) has coefficient of variation 1/sqrt(k)
            cv = float(gaps.std() / gaps.mean())
            self.assertAlmostEqual(cv, 1 / math.sqrt(burstiness), delta=0.05)
            self.assertEqual(offsets[0], 0.0)

    def test_bad_rate_and_burstiness_raise(self) -> None:
        rng = np.random.default_rng(0)
        with self.assertRaisesRegex(ValueError, "-1"):
            arrival_offsets_s(3, -1.0, 1.0, rng)
        with self.assertRaisesRegex(ValueError, "burstiness"):
            arrival_offsets_s(3, 1.0, 0.0, rng)

    def test_length_ranges(self) -> None:
        self.assertEqual(LengthRange.parse("16"), LengthRange(16, 16))
        r = LengthRange.parse("4:8")
        draws = r.draw(np.random.default_rng(0), 1000)
        self.assertEqual((min(draws), max(draws)), (4, 8))
        for bad in ("0", "8:4", "x", "3:y"):
            with self.subTest(bad=bad), self.assertRaisesRegex(ValueError, f"'{bad}'"):
                LengthRange.parse(bad)


if __name__ == "__main__":
    unittest.main()
