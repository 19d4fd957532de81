"""The sampler at the edges of what it accepts: every value SamplingParams takes gives finite logits (the
min_tokens mask excepted, which is -inf by design), no floating-point warning, and the token a plain
Python reference picks.

The reference applies the documented rule (sampler.py's module docstring) one token at a time with Python
floats: logit bias, the min_tokens mask, the repetition penalty, the frequency and presence penalties,
then argmax (ties to the lower id) or temperature, top_k, top_p and one inverse-CDF draw with the
request's own first uniform number. Vocabularies stay under 8 tokens, where NumPy's sum is the plain
left-to-right sum the reference takes, so the two agree to the last bit. Values SamplingParams refuses
(ValueError) are the refusals under test elsewhere; here they end the example.
"""

from __future__ import annotations

import math
import unittest
import warnings
from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.engine.request import SAMPLING_EPS, Request, SamplingParams
from attention_kv_caceh.engine.sampler import apply_logits_processors, sample, sample_row

FLOAT32_MAX = float(np.finfo(np.float32).max)


def reference_token(logits: list[float], request: Request, u: float) -> int:
    """The documented rule, token by token in Python floats; `u` is the request's first uniform draw."""
    params = request.sampling_params
    vocab = len(logits)
    row = [float(x) for x in logits]
    for token, bias in params.logit_bias:
        row[token] += bias
    if request.num_output_tokens < params.min_tokens:
        stops = set(params.stop_token_ids)
        if not params.ignore_eos and request.eos_token_id is not None:
            stops.add(request.eos_token_id)
        if len(stops & set(range(vocab))) < vocab:  # a mask that would leave nothing is not applied
            for token in stops & set(range(vocab)):
                row[token] = -math.inf
    if params.repetition_penalty != 1.0:
        p = params.repetition_penalty
        for token in set(request.prompt_token_ids) | set(request.output_token_ids):
            row[token] = row[token] / p if row[token] > 0 else row[token] * p
    counts = Counter(request.output_token_ids)
    for token, count in counts.items():
        row[token] -= params.frequency_penalty * count + params.presence_penalty
    if params.temperature < SAMPLING_EPS:
        return max(range(vocab), key=lambda i: (row[i], -i))
    scaled = [x / params.temperature for x in row]
    restricted = params.top_k > 0 or params.top_p < 1.0
    order = sorted(range(vocab), key=lambda i: (-scaled[i], i)) if restricted else list(range(vocab))
    if 0 < params.top_k < vocab:
        order = order[: params.top_k]
    values = [scaled[i] for i in order]
    top = max(values)
    probs = [float(e) for e in np.exp(np.array([v - top for v in values]))]
    total = sum(probs)
    probs = [q / total for q in probs]
    if params.top_p < 1.0:
        kept: list[float] = []
        mass = 0.0
        for q in probs:
            if mass < params.top_p:  # the mass before this token
                kept.append(q)
            mass += q
        order = order[: len(kept)]
        total = sum(kept)
        probs = [q / total for q in kept]
    cdf: list[float] = []
    running = 0.0
    for q in probs:
        running += q
        cdf.append(running)
    target = u * cdf[-1]
    j = next((k for k, c in enumerate(cdf) if c > target), len(cdf) - 1)
    return order[j]


# Values at and past the edges of every range: subnormals, float32's and float64's extremes, exact ties.
_LOGIT = st.one_of(
    st.sampled_from([0.0, 1.0, -1.0, FLOAT32_MAX, -FLOAT32_MAX, 1e-30, -1e-30]),
    st.floats(-FLOAT32_MAX, FLOAT32_MAX, width=32),
)
_TEMPERATURE = st.one_of(
    st.sampled_from([0.0, 1e-300, SAMPLING_EPS, 1e-4, 0.5, 1.0, 2.0, 1e5, 1e100, 1e300, 1.7e308]),
    st.floats(-6, 308).map(lambda e: 10.0**e),
)
_REPETITION = st.one_of(
    st.sampled_from([1.0, 5e-324, 1e-300, 1e-101, 1e-100, 1e-99, 0.5, 2.0, 1e99, 1e100, 1e101, 1.7e308]),
    st.floats(-110, 110).map(lambda e: 10.0**e),
)
_BIAS = st.one_of(
    st.sampled_from([0.0, 100.0, -100.0, 99.99, -99.99, 100.01, -1e300, 1e300]),
    st.floats(-100.0, 100.0),
)
_PENALTY = st.one_of(st.sampled_from([0.0, 2.0, -2.0, 2.01, -2.01]), st.floats(-2.0, 2.0))


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[float], Request] | None:
    """(logits [V], a Request with output history), or None when SamplingParams refuses the values."""
    vocab = draw(st.integers(2, 7))
    logits = draw(st.lists(_LOGIT, min_size=vocab, max_size=vocab))
    token = st.integers(0, vocab - 1)
    outputs = draw(st.lists(token, max_size=6))
    fields = {
        "max_tokens": 16,
        "temperature": draw(_TEMPERATURE),
        "top_k": draw(st.integers(0, vocab)),
        "top_p": draw(st.one_of(st.just(1.0), st.floats(min_value=1e-9, max_value=1.0))),
        "seed": draw(st.integers(0, 2**32)),
        "repetition_penalty": draw(_REPETITION),
        "frequency_penalty": draw(_PENALTY),
        "presence_penalty": draw(_PENALTY),
        "logit_bias": tuple(draw(st.dictionaries(token, _BIAS, max_size=3)).items()),
        "min_tokens": draw(st.integers(0, 8)),
        "stop_token_ids": tuple(draw(st.lists(token, max_size=vocab, unique=True))),
    }
    try:
        params = SamplingParams(**fields)
    except ValueError:
        return None
    request = Request("r", draw(st.lists(token, min_size=1, max_size=6)), params, eos_token_id=draw(token))
    for t in outputs:
        request.append_output_token(t)
    return logits, request


class ExtremeSamplingTest(unittest.TestCase):
    @settings(max_examples=400, deadline=None)
    @given(case=requests())
    def test_every_accepted_value_stays_finite_warns_nothing_and_picks_the_references_token(
        self, case: tuple[list[float], Request] | None
    ) -> None:
        if case is None:
            return  # refused at the boundary
        logits, request = case
        u = np.random.default_rng(request.sampling_params.seed).random()
        row_in = np.array(logits, dtype=np.float32)
        with warnings.catch_warnings(), np.errstate(over="raise", invalid="raise", divide="raise"):
            warnings.simplefilter("error")
            row = apply_logits_processors(row_in, request)
            token = sample_row(row, request.sampling_params, request.generator)
        masked = np.isneginf(row)
        self.assertTrue(np.isfinite(row[~masked]).all(), row)
        self.assertFalse(masked.all())
        self.assertEqual(token, reference_token([float(x) for x in row_in], request, u))

    def test_values_past_the_ranges_are_refused(self) -> None:
        for fields in (
            {"repetition_penalty": 1e101},
            {"repetition_penalty": 1e-101},
            {"logit_bias": ((0, 100.5),)},
            {"logit_bias": ((0, -1e300),)},
            {"frequency_penalty": 2.5},
        ):
            with self.subTest(fields=fields), self.assertRaises(ValueError):
                SamplingParams(**fields)  # type: ignore[arg-type]

    def test_logits_past_float32s_range_fail_the_step_with_a_clear_error(self) -> None:
        request = Request("r", [0], SamplingParams(repetition_penalty=2.0))
        for bad in (np.inf, -np.inf, np.nan, 1e300):
            with self.subTest(bad=bad), self.assertRaises(ValueError):
                sample(np.array([[0.0, bad]]), [request])


if __name__ == "__main__":
    unittest.main()
