"""The roofline prediction: hand-computed arithmetic, verdicts, anomalies and the boundary paragraph."""

from __future__ import annotations

import json
import math
import re
import unittest
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.experiments.cache_growth_stats import CacheFit, CacheGrowthSummary
from attention_kv_caceh.experiments.cache_prediction import (
    CachePrediction,
    cache_bytes_per_position,
    evaluate_cache,
    make_cache_prediction,
)
from attention_kv_caceh.experiments.calibration import Calibration, bytes_moved_per_step, calibrate
from attention_kv_caceh.experiments.prediction import (
    ScanPrediction,
    UserPrediction,
    check_user_prediction,
    make_scan_prediction,
    parse_saturation,
)
from attention_kv_caceh.experiments.prediction_check import Verdict, evaluate_scan, find_anomalies
from attention_kv_caceh.experiments.scan import (
    ScanConfig,
    kv_bytes_per_step,
)
from attention_kv_caceh.experiments.scan_stats import doubling_gains, saturation_point, scan_table
from attention_kv_caceh.report.outcome import outcome_json, outcome_markdown, outcome_text, prediction_card
from attention_kv_caceh.report.verdicts import (
    anomaly_note,
    cache_boundary,
    fmt_ms,
    fmt_rate,
    saturation_verdict,
    scan_boundary,
    verdict_text,
)
from attention_kv_caceh.timing import Sample

T = 128
SIZES = (1, 2, 4, 8, 16)

# Hand calibration: the smallest shape moves 1,000 bytes and takes P50 0.011 ms; the probe reads
# 1,000,000 bytes in P50 0.1 ms. Bandwidth = 1e6 / 0.1 = 1e7 bytes/ms = 10 GB/s, overhead = 0.011 -
# 1,000 / 1e7 = 0.0109 ms. Each sequence moves 100,000 bytes: 100,000 / 1e7 = 0.01 ms per sequence.
CAL = Calibration("B=1, T=1 (hand)", 1_000, (0.010, 0.011, 0.012), 1_000_000, (0.1, 0.1, 0.1))
BYTES = {b: 100_000 * b for b in SIZES}
# P50(B) = 0.0109 + 0.01 * B
EXPECTED_P50 = {1: 0.0209, 2: 0.0309, 4: 0.0509, 8: 0.0909, 16: 0.1709}


def prediction(user: UserPrediction | None = None, sizes: tuple[int, ...] = SIZES) -> ScanPrediction:
    config = ScanConfig(batch_sizes=sizes, seq_len=T)
    return make_scan_prediction(config, CAL, user, {b: BYTES[b] for b in sizes}, "2026-01-01T00:00:00+00:00")


def samples_with_p50(p50: dict[int, float], n: int = 5) -> list[Sample]:
    """n samples per B, all equal to the given P50 (so every statistic is that value)."""
    return [Sample(b, T, ms, repeat=i) for b, ms in p50.items() for i in range(n)]


class RooflineArithmeticTest(unittest.TestCase):
    def test_calibration_matches_hand_computation(self) -> None:
        self.assertAlmostEqual(CAL.bandwidth_bytes_per_ms, 1e7)
        self.assertAlmostEqual(CAL.bandwidth_gb_s, 10.0)
        self.assertAlmostEqual(CAL.overhead_ms, 0.0109)

    def test_predicted_p50_is_overhead_plus_bytes_over_bandwidth(self) -> None:
        rows = prediction().rows
        self.assertEqual([r.batch_size for r in rows], list(SIZES))
        for r in rows:
            self.assertAlmostEqual(r.overhead_ms, 0.0109)
            self.assertAlmostEqual(r.bandwidth_ms, 0.01 * r.batch_size)
            self.assertAlmostEqual(r.predicted_p50_ms, EXPECTED_P50[r.batch_size])

    def test_model_saturation_uses_the_scan_rule(self) -> None:
        # One doubling gains 2 P50(B) / P50(2B) - 1 = o / (o + 2Bs) with o = 0.0109, s = 0.01:
        # B=1: 0.0109/0.0309 = 35.3 %; B=2: 0.0109/0.0509 = 21.4 %; B=4: 0.0109/0.0909 = 12.0 %;
        # B=8: 0.0109/0.1709 = 6.4 % < 10 %, so the model saturates at B = 8.
        p = prediction()
        gains = [g for _, _, g in doubling_gains(p.predicted_table())]
        for got, want in zip(
            gains, [0.0109 / 0.0309, 0.0109 / 0.0509, 0.0109 / 0.0909, 0.0109 / 0.1709], strict=True
        ):
            self.assertAlmostEqual(got, want)
        self.assertEqual(p.saturation, 8)
        self.assertTrue(saturation_verdict(p.predicted_table()).startswith("Saturated at B = 8"))
        # The bandwidth term 0.01 * B first exceeds the 0.0109 ms overhead at B = 2.
        self.assertEqual(p.knee, 2)
        self.assertEqual([r.dominant for r in p.rows][:2], ["call overhead", "bandwidth"])

    def test_overhead_is_never_negative(self) -> None:
        # The smallest shape's bytes term (1e9 / 1e7 = 100 ms) exceeds its P50: overhead clamps to 0.
        cal = Calibration("x", 1_000_000_000, (0.5,), 1_000_000, (0.1,))
        self.assertEqual(cal.overhead_ms, 0.0)

    def test_bytes_moved_per_step_by_hand(self) -> None:
        # 2 (K and V) x B=1 x H_kv=1 x D=64 x 4 bytes = 512 bytes per position.
        # Dynamic: attention reads T+1 = 129 positions, the copy reads T = 128 and writes 129: 386 x 512.
        dyn = ScanConfig(seq_len=T, cache="dynamic")
        self.assertEqual(bytes_moved_per_step(dyn, 1), 386 * 512)
        # Preallocated: 129 read + 1 written = 130 x 512; twice for B = 2.
        pre = ScanConfig(seq_len=T, cache="preallocated")
        self.assertEqual(bytes_moved_per_step(pre, 1), 130 * 512)
        self.assertEqual(bytes_moved_per_step(pre, 2), 2 * 130 * 512)

    def test_json_round_trip_rebuilds_the_prediction(self) -> None:
        p = prediction(UserPrediction("saturates at B = 4", True, 4))
        data = json.loads(json.dumps(p.to_json()))
        self.assertEqual(ScanPrediction.from_json(data), p)
        self.assertEqual(data["model"]["saturation"], 8)
        self.assertAlmostEqual(data["model"]["rows"][2]["predicted_p50_ms"], 0.0509)


class UserPredictionTest(unittest.TestCase):
    def test_parse_saturation(self) -> None:
        self.assertEqual(parse_saturation("4"), 4)
        self.assertIsNone(parse_saturation("None"))
        for bad in ("four", "0", "-2", "2.5"):
            with self.assertRaises(ValueError):
                parse_saturation(bad)

    def test_a_batch_size_that_can_never_be_measured_is_refused(self) -> None:
        for b in (3, 16):  # not scanned; the largest B has no doubling after it
            with self.assertRaisesRegex(ValueError, f"B = {b}"):
                check_user_prediction(UserPrediction("", True, b), SIZES)
        check_user_prediction(UserPrediction("", True, None), SIZES)  # "none" is always checkable
        with self.assertRaises(ValueError):
            prediction(UserPrediction("", True, 16))


class VerdictTest(unittest.TestCase):
    def verdict(self, outcome_verdicts: Sequence[Verdict], name: str) -> tuple[bool | None, str]:
        for v in outcome_verdicts:
            if v.name == name:
                return v.held, verdict_text(v)
        raise AssertionError(f"no verdict {name}")

    def test_wrong_user_prediction_fails_with_both_values(self) -> None:
        outcome = evaluate_scan(
            prediction(UserPrediction("saturates at B = 4", True, 4)), samples_with_p50(EXPECTED_P50)
        )
        self.assertEqual(outcome.measured_saturation, 8)
        held, text = self.verdict(outcome.verdicts, "user saturation")
        self.assertFalse(held)
        self.assertEqual(re.findall(r"B = (\d+)", text), ["8", "4"])  # measured, then predicted
        self.assertIn(text, outcome_text(outcome))
        self.assertIn(f"| user saturation | FAILED | {text} |", outcome_markdown(outcome))
        verdicts = json.loads(json.dumps(outcome_json(outcome.verdicts, outcome.anomalies)))["verdicts"]
        self.assertIn({"name": "user saturation", "held": False, "text": text}, verdicts)
        # The free text is recorded and shown, never judged.
        held, text = self.verdict(outcome.verdicts, "user (text)")
        self.assertIsNone(held)
        self.assertIn("saturates at B = 4", text)

    def test_right_user_prediction_holds(self) -> None:
        outcome = evaluate_scan(prediction(UserPrediction("", True, 8)), samples_with_p50(EXPECTED_P50))
        self.assertEqual(self.verdict(outcome.verdicts, "user saturation")[0], True)
        self.assertEqual(self.verdict(outcome.verdicts, "model saturation")[0], True)
        self.assertEqual(self.verdict(outcome.verdicts, "model P50")[0], True)
        self.assertTrue(all(r.held and math.isclose(r.ratio, 1.0) for r in outcome.rows))

    def test_none_holds_only_when_saturation_is_not_reached(self) -> None:
        linear = {b: 0.01 for b in SIZES}  # P50 constant in B: positions/s doubles every time
        held = evaluate_scan(prediction(UserPrediction("", True, None)), samples_with_p50(linear))
        self.assertIsNone(held.measured_saturation)
        self.assertEqual(self.verdict(held.verdicts, "user saturation")[0], True)
        failed = evaluate_scan(prediction(UserPrediction("", True, None)), samples_with_p50(EXPECTED_P50))
        self.assertIn(
            "failed: measured B = 8, predicted not reached",
            self.verdict(failed.verdicts, "user saturation")[1],
        )

    def test_model_p50_outside_twice_fails_and_names_the_batch_size(self) -> None:
        measured = dict(EXPECTED_P50) | {16: 3 * EXPECTED_P50[16]}  # 3x at B = 16
        outcome = evaluate_scan(prediction(), samples_with_p50(measured))
        held, text = self.verdict(outcome.verdicts, "model P50")
        self.assertFalse(held)
        self.assertIn("failed at B = 16", text)
        self.assertIn(f"measured {fmt_ms(3 * 0.1709)} ms, predicted {fmt_ms(0.1709)} ms", text)
        self.assertEqual([r.held for r in outcome.rows], [True, True, True, True, False])

    def test_partial_scan_is_compared_on_the_batch_sizes_it_has(self) -> None:
        part = {b: EXPECTED_P50[b] for b in (1, 2, 4)}
        outcome = evaluate_scan(prediction(), samples_with_p50(part))
        self.assertEqual([r.batch_size for r in outcome.rows], [1, 2, 4])
        # Over B = 1, 2, 4 neither side saturates, so the model's point still agrees.
        self.assertEqual(self.verdict(outcome.verdicts, "model saturation")[0], True)
        with self.assertRaisesRegex(ValueError, "B = \\[32\\]"):
            evaluate_scan(prediction(), samples_with_p50({32: 1.0}))


class AnomalyTest(unittest.TestCase):
    def test_anomalies_are_listed_with_their_repeat_index(self) -> None:
        samples = samples_with_p50(EXPECTED_P50, n=21)
        samples[7 + 21 * 2] = Sample(4, T, 10.0, repeat=7)  # B = 4, repeat 7: far above its P95
        anomalies = find_anomalies(samples)
        self.assertEqual([(a.batch_size, a.repeat, a.elapsed_ms) for a in anomalies], [(4, 7, 10.0)])
        self.assertAlmostEqual(anomalies[0].group_p95_ms, EXPECTED_P50[4])
        outcome = evaluate_scan(prediction(), samples)
        self.assertIn("B = 4, repeat 7: 10.0000 ms", outcome_text(outcome))
        self.assertIn("without them no verdict changes", anomaly_note(outcome))

    def test_the_note_says_when_an_anomaly_changes_a_verdict(self) -> None:
        # B = 16 (predicted 0.1709 ms): ten samples at 0.25, ten at 0.40 and one at 10 ms (repeat 20).
        # All 21: P50 = 0.40 ms, 0.40 / 0.1709 = 2.34x the prediction (failed). Without the 10 ms sample:
        # P50 = (0.25 + 0.40) / 2 = 0.325 ms, 1.90x (held). Saturation stays at B = 8 either way.
        low, high = 0.25, 0.40
        group = [Sample(16, T, low, repeat=i) for i in range(10)]
        group += [Sample(16, T, high, repeat=10 + i) for i in range(10)]
        group += [Sample(16, T, 10.0, repeat=20)]
        others = [s for s in samples_with_p50(EXPECTED_P50, n=21) if s.batch_size != 16]
        outcome = evaluate_scan(prediction(), others + group)
        self.assertEqual([(a.batch_size, a.repeat) for a in outcome.anomalies], [(16, 20)])
        self.assertAlmostEqual(outcome.rows[-1].measured_p50_ms, high)  # kept in the statistics
        self.assertIn("model P50", anomaly_note(outcome))
        self.assertNotIn("no verdict changes", anomaly_note(outcome))


class ExplanationTest(unittest.TestCase):
    def test_paragraph_numbers_equal_the_tables(self) -> None:
        # Measured: saturates at B = 4 (0.05 -> 0.095 ms: positions/s gains 2 x 0.05 / 0.095 - 1 = 5.3 %).
        measured = {1: 0.02, 2: 0.03, 4: 0.05, 8: 0.095, 16: 0.19}
        samples = samples_with_p50(measured)
        outcome = evaluate_scan(prediction(), samples)
        table = {int(r["batch_size"]): r for r in scan_table(samples)}
        text = scan_boundary(outcome)
        self.assertEqual(outcome.measured_saturation, 4)
        self.assertIn("stops falling at B = 4", text)
        model = {v.name: v for v in outcome.verdicts}["model saturation"]
        self.assertEqual(
            (model.held, verdict_text(model)), (False, "failed: measured B = 4, predicted B = 8")
        )
        # Where they part: the model's gain from B = 4 to 8 is 0.0109 / 0.0909 = 12.0 % (hand, above).
        self.assertIn("the model expected positions/s to rise 12.0 % per doubling and they rose 5.3 %", text)
        self.assertIn(
            f"from {fmt_ms(table[4]['per_sequence_ms'])} to {fmt_ms(table[8]['per_sequence_ms'])} ms", text
        )
        gain = dict(((b1, g) for b1, _, g in doubling_gains(list(table.values()))))[4]
        self.assertIn(f"{100 * gain:.1f} % per doubling", text)
        self.assertAlmostEqual(gain, 2 * 0.05 / 0.095 - 1)
        self.assertIn(
            f"from {fmt_rate(table[1]['positions_per_s'])} to {fmt_rate(table[16]['positions_per_s'])} positions/s",
            text,
        )
        rows = {r.batch_size: r for r in outcome.rows}
        self.assertIn(f"bandwidth term is {fmt_ms(rows[8].bandwidth_ms)} ms", text)
        # The same P50 digits appear in the printed table and in the paragraph.
        printed = outcome_text(outcome)
        for b in (1, 16):
            self.assertIn(fmt_ms(table[b]["p50_ms"]), text)
            self.assertRegex(
                printed,
                rf"(?m)^\s*{b}\s+{re.escape(fmt_ms(EXPECTED_P50[b]))}\s+{re.escape(fmt_ms(measured[b]))}",
            )
        self.assertIn("no single request got faster", text)

    def test_card_shows_the_model_before_measuring(self) -> None:
        card = prediction_card(prediction(UserPrediction("saturates at B = 4", True, 4)))
        self.assertIn("'saturates at B = 4'", card)
        self.assertIn("10.00 GB/s", card)
        self.assertIn(fmt_ms(0.0109), card)
        self.assertIn("model saturation: B = 8", card)


class SaturationPointTest(unittest.TestCase):
    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.floats(0.5, 4.0), min_size=1, max_size=6))
    def test_saturation_point_names_the_b_of_saturation_verdict(self, factors: list[float]) -> None:
        rows = [{"batch_size": 1.0, "positions_per_s": 100.0}]
        for i, f in enumerate(factors, start=1):
            rows.append({"batch_size": float(2**i), "positions_per_s": rows[-1]["positions_per_s"] * f})
        point, verdict = saturation_point(rows), saturation_verdict(rows)
        if point is None:
            self.assertTrue(verdict.startswith("Not reached"))
        else:
            self.assertTrue(verdict.startswith(f"Saturated at B = {point}:"))


class CalibrateTest(unittest.TestCase):
    def test_calibrate_times_the_smallest_shape_and_the_probe(self) -> None:
        config = ScanConfig(batch_sizes=(1, 4), seq_len=16, head_dim=8, warmup=1, repeats=3)
        cal = calibrate(config)
        self.assertEqual(len(cal.overhead_samples_ms), 3)
        self.assertEqual(len(cal.probe_samples_ms), 3)
        self.assertEqual(cal.probe_bytes, kv_bytes_per_step(config, 4))
        self.assertEqual(cal.overhead_bytes, bytes_moved_per_step(config, 1, 1))
        self.assertIn("B=1, T=1", cal.overhead_shape)
        self.assertGreaterEqual(cal.overhead_ms, 0.0)


class CachePredictionTest(unittest.TestCase):
    def summary(self, dynamic_slope: float, preallocated_slope: float) -> CacheGrowthSummary:
        fits = {
            "dynamic": CacheFit("dynamic", dynamic_slope, 0.01, 0.99, 0.9, 100),
            "preallocated": CacheFit("preallocated", preallocated_slope, 0.01, 0.98, 0.9, 100),
        }
        return CacheGrowthSummary(fits, {}, math.nan, [], None, 640, None, {})

    def test_slopes_by_hand(self) -> None:
        # 2 (K, V) x B=2 x H_kv=8 x D=64 x 4 bytes = 8,192 bytes per position; the copy triples it.
        per = cache_bytes_per_position(2, 8, 64, "float32")
        self.assertEqual(per, {"dynamic": 24_576, "preallocated": 8_192})
        # Probe: 1,000,000 bytes in 0.1 ms = 1e7 bytes/ms; slopes 8,192 / 1e7 and 24,576 / 1e7 ms.
        p = make_cache_prediction(per, 1_000_000, [0.1, 0.1], "2026-01-01T00:00:00+00:00")
        self.assertAlmostEqual(p.slope_ms_per_position("preallocated"), 8.192e-4)
        self.assertAlmostEqual(p.slope_ms_per_position("dynamic"), 2.4576e-3)
        self.assertEqual(CachePrediction.from_json(json.loads(json.dumps(p.to_json()))), p)

    def test_slope_verdicts(self) -> None:
        p = make_cache_prediction(cache_bytes_per_position(2, 8, 64, "float32"), 1_000_000, [0.1])
        ok = evaluate_cache(p, self.summary(2.4576e-3 * 1.5, 8.192e-4 * 1.2))
        self.assertTrue(all(v.held for v in ok.verdicts))
        bad = evaluate_cache(p, self.summary(2.4576e-3 * 3, 8.192e-4))
        texts = {v.name: (v.held, verdict_text(v)) for v in bad.verdicts}
        self.assertEqual(
            texts["dynamic slope"], (False, "failed: measured 7.3728, predicted 2.4576 us/position")
        )
        self.assertTrue(texts["preallocated slope"][0])
        self.assertIn("measured 9.00x, predicted 3.00x", texts["dynamic / preallocated"][1])
        self.assertIn("from T = 640", cache_boundary(bad))
        self.assertIn("FAILED", outcome_text(bad))
        self.assertIn("| dynamic | 2.4576 | 7.3728 | 3.00 |", outcome_markdown(bad))


if __name__ == "__main__":
    unittest.main()
