"""Sampler: greedy is argmax; top_k=1 and a tiny top_p are greedy; frequencies follow the filtered softmax;
a seeded request samples the same tokens whatever shares its batch.

Oracles: np.argmax; probabilities computed by hand from fixed logits (frequencies over 40,000 seeded draws,
so the tolerance 0.01 is about 4 standard errors and the seeded result is fixed); the same request run alone.
"""

from __future__ import annotations

import unittest

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from attention_kv_caceh.engine.request import SAMPLING_EPS, Request, SamplingParams
from attention_kv_caceh.engine.sampler import _top_k_ids, sample, sample_row
from tests.engine_fakes import make_engine, random_logits, run_workload

_LOGITS = np.log(np.array([0.5, 0.3, 0.2]))


def _frequencies(params: SamplingParams, n: int = 40_000) -> np.ndarray:
    gen = np.random.default_rng(123)
    draws = [sample_row(_LOGITS, params, gen) for _ in range(n)]
    return np.bincount(draws, minlength=3) / n


class TopKIdsTest(unittest.TestCase):
    @settings(max_examples=200, deadline=None)
    @given(
        row=hnp.arrays(np.float64, st.integers(2, 40), elements=st.integers(-3, 3).map(float)),
        data=st.data(),
    )
    def test_the_k_largest_with_ties_to_the_lower_ids_as_a_stable_sort_gives(self, row, data) -> None:
        """Oracle: the first k ids of a stable descending sort (ties are frequent with integer logits)."""
        k = data.draw(st.integers(1, row.size - 1))
        expected = np.argsort(-row, kind="stable")[:k]
        self.assertEqual(sorted(_top_k_ids(row, k).tolist()), sorted(expected.tolist()))


class SampleRowTest(unittest.TestCase):
    @settings(max_examples=100, deadline=None)
    @given(
        logits=hnp.arrays(np.float64, st.integers(1, 50), elements=st.integers(-5, 5).map(float)),
        temperature=st.floats(0.1, 5.0),
        seed=st.integers(0, 2**32),
    )
    def test_top_k_1_and_tiny_top_p_equal_greedy_even_with_ties(
        self, logits: np.ndarray, temperature: float, seed: int
    ) -> None:
        greedy = sample_row(logits, SamplingParams(), np.random.default_rng(seed))
        self.assertEqual(greedy, int(np.argmax(logits)))
        for params in (
            SamplingParams(temperature=temperature, top_k=1),
            SamplingParams(temperature=temperature, top_p=1e-9),
        ):
            self.assertEqual(sample_row(logits, params, np.random.default_rng(seed)), greedy)

    def test_temperature_one_follows_the_softmax(self) -> None:
        np.testing.assert_allclose(_frequencies(SamplingParams(temperature=1.0)), [0.5, 0.3, 0.2], atol=0.01)

    def test_temperature_two_flattens_to_the_square_root(self) -> None:
        p = np.sqrt([0.5, 0.3, 0.2])
        np.testing.assert_allclose(_frequencies(SamplingParams(temperature=2.0)), p / p.sum(), atol=0.01)

    def test_top_k_renormalizes_over_the_k_largest(self) -> None:
        np.testing.assert_allclose(
            _frequencies(SamplingParams(temperature=1.0, top_k=2)), [0.625, 0.375, 0.0], atol=0.01
        )

    def test_top_p_keeps_the_smallest_set_reaching_p(self) -> None:
        # 0.5 < 0.6, so the second token is needed; 0.5 + 0.3 >= 0.6, so the third is dropped
        np.testing.assert_allclose(
            _frequencies(SamplingParams(temperature=1.0, top_p=0.6)), [0.625, 0.375, 0.0], atol=0.01
        )
        np.testing.assert_allclose(
            _frequencies(SamplingParams(temperature=1.0, top_p=0.5)), [1.0, 0.0, 0.0], atol=0.0
        )

    def test_same_seed_same_tokens_other_seed_other_tokens(self) -> None:
        params = SamplingParams(temperature=1.0)
        logits = np.zeros(1000)

        def draws(seed: int) -> list[int]:
            gen = np.random.default_rng(seed)
            return [sample_row(logits, params, gen) for _ in range(5)]

        self.assertEqual(draws(1), draws(1))
        self.assertNotEqual(draws(1), draws(2))

    def test_temperatures_below_the_sampling_eps_pick_the_greedy_token(self) -> None:
        """1e-320 would overflow logits / temperature and 1e-6 samples rounding noise: both are greedy
        (vLLM's _SAMPLING_EPS rule); the greedy token is the argmax oracle, including a near-tie."""
        rng = np.random.default_rng(7)
        for _ in range(50):
            logits = rng.normal(size=64) * 30.0
            logits[rng.integers(64)] = logits.max() - 1e-9  # a near-tie the noise would resolve at random
            greedy = int(np.argmax(logits))
            for temperature in (1e-320, 5e-324, 1e-6, 9.99e-6):
                params = SamplingParams(temperature=temperature, top_k=5, top_p=0.5)
                self.assertTrue(params.is_greedy)
                self.assertEqual(sample_row(logits, params, np.random.default_rng(0)), greedy)
        self.assertFalse(SamplingParams(temperature=SAMPLING_EPS).is_greedy)

    def test_a_negative_seed_is_refused(self) -> None:
        with self.assertRaisesRegex(ValueError, "seed"):
            SamplingParams(temperature=1.0, seed=-1)

    def test_sample_rejects_mismatched_rows_and_nan(self) -> None:
        reqs = [Request("a", [1], SamplingParams())]
        with self.assertRaisesRegex(ValueError, "R=1"):
            sample(np.zeros((2, 4)), reqs)
        with self.assertRaisesRegex(ValueError, "NaN"):
            sample(np.array([[0.0, np.nan]]), reqs)


class SeededRequestInEngineTest(unittest.TestCase):
    def _tokens(self, companions: int, budget: int, num_blocks: int = 60) -> list[int]:
        engine, _ = make_engine(num_blocks=num_blocks, max_num_batched_tokens=budget, logits_fn=random_logits)
        params = SamplingParams(
            max_tokens=12, temperature=0.9, top_p=0.95, top_k=20, seed=42, ignore_eos=True
        )
        arrivals = {0: [("x", [5, 4, 3, 2, 1, 9, 8], params)]}
        for i in range(companions):
            other = SamplingParams(max_tokens=8 + i, temperature=1.3, seed=i, ignore_eos=True)
            arrivals.setdefault(i, []).append((f"c{i}", [i + 1] * (3 + 2 * i), other))
        tokens, _ = run_workload(engine, arrivals)
        self.preemptions = engine.scheduler.num_preemptions
        return tokens["x"]

    def test_seeded_request_samples_the_same_tokens_with_any_batch_companions(self) -> None:
        alone = self._tokens(0, 16)
        self.assertEqual(self._tokens(3, 16), alone)
        self.assertEqual(self._tokens(5, 7), alone)  # other batches and prefill chunks
        self.assertEqual(self._tokens(5, 7, num_blocks=8), alone)  # and preemption
        self.assertGreater(self.preemptions, 0)

    def test_seeded_request_is_not_greedy(self) -> None:
        # the seeded run above would pass trivially if sampling ignored the temperature
        engine, _ = make_engine(num_blocks=60, logits_fn=random_logits)
        greedy = SamplingParams(max_tokens=12, ignore_eos=True)
        tokens, _ = run_workload(engine, {0: [("x", [5, 4, 3, 2, 1, 9, 8], greedy)]})
        self.assertNotEqual(tokens["x"], self._tokens(0, 16))


if __name__ == "__main__":
    unittest.main()
