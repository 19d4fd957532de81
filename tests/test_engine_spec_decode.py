"""Speculative decoding with n-gram drafts: the config, the proposer, and exactness of the engine's tokens.

Oracles: the proposer against a brute-force search over every n-gram length and position; the engine with
speculation against the same engine without it and against a full recompute one prompt at a time (at
temperature 0 the tokens must be equal, for any K, budget, block size, pool size, prefix hit and
preemption); at temperature > 0 the same seeded tokens with and without speculation, and a chi-square
test of the output distribution against the exact one, enumerated.

The fake runner (tests/engine_fakes.py) reads every row's context back through the request's block
table, so a draft written at a wrong slot, or a rejected draft's slot read before it is rewritten,
changes the tokens.
"""

from __future__ import annotations

import itertools
import math
import unittest
from collections import Counter
from collections.abc import Callable, Sequence
from unittest import mock

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_kv_caceh.engine import model_runner as model_runner_module
from attention_kv_caceh.engine.request import Request, SamplingParams
from attention_kv_caceh.engine.sampler import sample_row
from attention_kv_caceh.engine.spec_decode.config import (
    DEFAULT_VERIFY_ROWS,
    SpeculativeConfig,
    default_draft_schedule,
)
from attention_kv_caceh.engine.spec_decode.metrics import SpecDecodingStats, acceptance_summary
from attention_kv_caceh.engine.spec_decode.ngram_proposer import NgramProposer, find_ngram_draft
from tests.engine_fakes import (
    assert_all_blocks_free,
    copy_logits,
    make_engine,
    random_logits,
    run_workload,
)

_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def spec(k: int = 4, lo: int = 1, hi: int = 3, schedule: list[list[int]] | None = None) -> SpeculativeConfig:
    """An ngram config with K drafts at every batch size unless a schedule is given."""
    return SpeculativeConfig(k, lo, hi, tuple(map(tuple, schedule or [[1, 64, k]])))  # pyright: ignore[reportArgumentType]


class TestSpeculativeConfig(unittest.TestCase):
    def test_defaults_and_lookup_bounds_as_vllm_sets_them(self) -> None:
        c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
        self.assertEqual((c.prompt_lookup_min, c.prompt_lookup_max), (5, 5))
        c = SpeculativeConfig.from_dict(
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 7}
        )
        self.assertEqual((c.prompt_lookup_min, c.prompt_lookup_max), (7, 7))
        c = SpeculativeConfig.from_dict(
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
        )
        self.assertEqual((c.prompt_lookup_min, c.prompt_lookup_max), (2, 2))
        c = SpeculativeConfig.from_dict({"model": "[ngram]", "num-speculative-tokens": 2})
        self.assertEqual((c.method, c.num_speculative_tokens), ("ngram", 2))
        self.assertEqual(SpeculativeConfig.from_json(c.to_json()), c)

    def test_bad_values_are_refused_with_vllms_messages(self) -> None:
        cases = [
            ({"method": "ngram"}, "num_speculative_tokens must be provided"),
            ({"method": "ngram", "num_speculative_tokens": 0}, "greater than zero (0)"),
            ({"method": "ngram", "num_speculative_tokens": True}, "valid integer"),
            (
                {"num_speculative_tokens": 4},
                "num_speculative_tokens was provided but without speculative model.",
            ),
            ({"method": "eagle", "num_speculative_tokens": 4}, "'eagle' is not available"),
            ({"method": "lookahead", "num_speculative_tokens": 4}, "'lookahead' is not one of vLLM's"),
            (
                {
                    "method": "ngram",
                    "num_speculative_tokens": 2,
                    "prompt_lookup_min": 4,
                    "prompt_lookup_max": 2,
                },
                "prompt_lookup_min=4 must be <= prompt_lookup_max=2",
            ),
            (
                {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
                "greater than or equal to 1",
            ),
            (
                {"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
                "draft_tensor_parallel_size",
            ),
            (
                {
                    "method": "ngram",
                    "num_speculative_tokens": 2,
                    "num_speculative_tokens_per_batch_size": [[2, 4, 1]],
                },
                "must start at 1",
            ),
            (
                {
                    "method": "ngram",
                    "num_speculative_tokens": 2,
                    "num_speculative_tokens_per_batch_size": [[1, 4, 1], [3, 5, 0]],
                },
                "non-overlapping",
            ),
            # past any context: refused before anything is sized by them (they once took all memory)
            ({"method": "ngram", "num_speculative_tokens": 10**9}, "num_speculative_tokens=1000000000"),
            ({"method": "ngram", "num_speculative_tokens": 10**20}, "num_speculative_tokens="),
            (
                {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 10**20},
                "prompt_lookup_max=",
            ),
        ]
        for obj, message in cases:
            with self.subTest(obj=obj), self.assertRaises(ValueError) as ctx:
                SpeculativeConfig.from_dict(obj)
            self.assertIn(message, str(ctx.exception))
        for text in ("[1]", "{", '"ngram"'):
            with self.subTest(text=text), self.assertRaises(ValueError):
                SpeculativeConfig.from_json(text)

    def test_batch_size_schedules(self) -> None:
        # vLLM's dense lookup: ranges, a gap carrying the previous K, the last K past the end, capped at K
        c = SpeculativeConfig(3, 1, 2, ((1, 2, 5), (4, 4, 1), (6, 6, 0)))
        self.assertEqual(c.draft_schedule(8)[1:], [3, 3, 3, 1, 1, 0, 0, 0])
        default = default_draft_schedule(4, 12)
        self.assertEqual(default[1:], [4, 3, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0])
        for b, k in enumerate(default[1:], start=1):  # drafts keep a step within the verify rows
            self.assertLessEqual(b * (1 + k), max(DEFAULT_VERIFY_ROWS, b))
        self.assertEqual(SpeculativeConfig(2).draft_schedule(3), default_draft_schedule(2, 3))
        with self.assertLogs("attention_kv_caceh.engine.spec_decode.config", "WARNING") as logs:
            SpeculativeConfig(3, 1, 2, ((1, 4, 9),))  # an entry above K is capped, with a warning
        self.assertIn("[1, 4, 9]", logs.output[0])

    def test_a_draft_that_cannot_fit_the_context_is_refused(self) -> None:
        SpeculativeConfig(511, 1, 512).check_fits(512)
        for config, field in (
            (SpeculativeConfig(512), "num_speculative_tokens=512"),
            (SpeculativeConfig(3, 1, 513), "prompt_lookup_max=513"),
        ):
            with self.subTest(field), self.assertRaises(ValueError) as ctx:
                config.check_fits(512)
            self.assertIn(field, str(ctx.exception))


def brute_force_draft(tokens: list[int], lo: int, hi: int, k: int, max_model_len: int) -> list[int]:
    """The rule, by search: the longest n in [lo, hi] whose suffix recurs ending before the last token,
    its earliest occurrence, the k tokens after it (capped by max_model_len - T)."""
    t = len(tokens)
    k = min(k, max_model_len - t)
    if k <= 0:
        return []
    for n in range(min(hi, t - 1), lo - 1, -1):
        suffix = tokens[t - n :]
        for start in range(0, t - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


class TestNgramProposer(unittest.TestCase):
    def test_the_documented_example(self) -> None:
        tokens = np.array([1, 2, 3, 4, 2, 3], dtype=np.int64)
        self.assertEqual(find_ngram_draft(tokens, 2, 3, 4, 100).tolist(), [4, 2, 3])
        self.assertEqual(find_ngram_draft(tokens, 3, 3, 4, 100).tolist(), [])
        self.assertEqual(find_ngram_draft(tokens, 2, 3, 4, 7).tolist(), [4])  # max_model_len caps k
        self.assertEqual(NgramProposer(2, 3, 100).propose([1, 2, 3, 4, 2, 3], 2), [4, 2])

    @_SETTINGS
    @given(
        st.lists(st.integers(0, 3), min_size=1, max_size=40),
        st.integers(1, 4),
        st.integers(0, 3),
        st.integers(1, 6),
        st.integers(1, 60),
    )
    def test_equals_brute_force(self, tokens: list[int], lo: int, extra: int, k: int, max_len: int) -> None:
        hi = lo + extra
        got = find_ngram_draft(np.array(tokens, dtype=np.int64), lo, hi, k, max_len).tolist()
        self.assertEqual(got, brute_force_draft(tokens, lo, hi, k, max_len))


def argmax_reference(
    prompt: Sequence[int],
    params: SamplingParams,
    max_model_len: int,
    logits_fn: Callable[[Sequence[int], int], np.ndarray],
    vocab: int,
    eos: int = 0,
) -> tuple[list[int], str]:
    """Greedy tokens and finish reason of one prompt by full recompute (the oracle)."""
    seq, out = list(prompt), []
    while True:
        t = int(np.argmax(logits_fn(seq, vocab)))
        out.append(t)
        seq.append(t)
        if (not params.ignore_eos and t == eos) or t in params.stop_token_ids:
            return out, "stop"
        if len(out) >= params.max_tokens or len(seq) >= max_model_len:
            return out, "length"


def spec_totals(engine: object) -> SpecDecodingStats:
    total = SpecDecodingStats(8)
    for s in engine.step_stats:  # type: ignore[attr-defined]
        if s.spec_decoding is not None:
            total.add(s.spec_decoding)
    return total


class TestGreedyEquality(unittest.TestCase):
    VOCAB = 6

    @_SETTINGS
    @given(st.data())
    def test_tokens_with_speculation_equal_tokens_without(self, data: st.DataObject) -> None:
        k = data.draw(st.integers(1, 5), "K")
        lo = data.draw(st.integers(1, 2), "prompt_lookup_min")
        hi = lo + data.draw(st.integers(0, 2), "extra")
        block_size = data.draw(st.sampled_from([1, 2, 4, 8]), "block_size")
        max_num_seqs = data.draw(st.integers(1, 4), "max_num_seqs")
        budget = data.draw(st.integers(max_num_seqs, 24), "max_num_batched_tokens")
        max_model_len = data.draw(st.integers(12, 40), "max_model_len")
        shared = data.draw(st.lists(st.integers(1, self.VOCAB - 1), min_size=0, max_size=9), "shared")
        n = data.draw(st.integers(1, 5), "requests")
        arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
        needs: list[int] = []
        for i in range(n):
            own = data.draw(st.lists(st.integers(1, self.VOCAB - 1), min_size=1, max_size=8), f"prompt {i}")
            prompt = (shared + own)[: max_model_len - 1]
            params = SamplingParams(
                max_tokens=data.draw(st.integers(1, 14), f"max_tokens {i}"),
                ignore_eos=data.draw(st.booleans(), f"ignore_eos {i}"),
                stop_token_ids=tuple(data.draw(st.lists(st.integers(1, 5), max_size=1), f"stop {i}")),
            )
            step = data.draw(st.integers(0, 6), f"arrival {i}")
            arrivals.setdefault(step, []).append((f"r{i}", prompt, params))
            positions = min(len(prompt) + params.max_tokens, max(max_model_len, len(prompt) + 1)) - 1
            needs.append(-(-positions // block_size))
        num_blocks = max(needs) + data.draw(st.integers(0, 10), "spare blocks")  # few: preemption
        caching = data.draw(st.booleans(), "prefix caching")

        def run(config: SpeculativeConfig | None) -> tuple[dict[str, list[int]], dict[str, str], object]:
            engine, _ = make_engine(
                num_blocks=num_blocks,
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=max_model_len,
                enable_prefix_caching=caching,
                vocab=self.VOCAB,
                logits_fn=copy_logits,
                speculative_config=config,
            )
            tokens, reasons = run_workload(engine, arrivals)
            assert_all_blocks_free(engine)
            return tokens, reasons, engine

        plain_tokens, plain_reasons, _ = run(None)
        tokens, reasons, engine = run(spec(k, lo, hi))
        self.assertEqual(tokens, plain_tokens)
        self.assertEqual(reasons, plain_reasons)
        for batch in arrivals.values():
            for rid, prompt, params in batch:
                expected = argmax_reference(prompt, params, max_model_len, copy_logits, self.VOCAB)
                self.assertEqual((tokens[rid], reasons[rid]), expected, rid)
        totals = spec_totals(engine)
        self.assertLessEqual(totals.num_accepted_tokens, totals.num_draft_tokens)

    def test_drafts_are_accepted_rejected_trimmed_and_rolled_back(self) -> None:
        """A fixed workload where every path occurs: accepted and rejected drafts, a draft cut by the
        budget, preemption, a prefix hit, a stop inside an accepted draft; the tokens equal the oracle's."""
        prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [1, 2, 3, 4, 1, 2, 3, 5], [5, 4, 3, 5, 4, 3, 5]]
        params = [
            SamplingParams(max_tokens=20, ignore_eos=True),
            SamplingParams(max_tokens=18, ignore_eos=True, stop_token_ids=(4,)),
            SamplingParams(max_tokens=16, ignore_eos=True),
        ]
        arrivals = {0: [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]}
        arrivals[9] = [("again", prompts[0], params[0])]  # a prefix hit on r0's cached blocks
        engine, _ = make_engine(
            num_blocks=16, block_size=2, max_num_seqs=3, max_num_batched_tokens=9, max_model_len=64,
            vocab=self.VOCAB, logits_fn=copy_logits, speculative_config=spec(4, 1, 3),
        )  # fmt: skip
        tokens, reasons = run_workload(engine, arrivals)
        for batch in arrivals.values():
            for rid, prompt, sp in batch:
                self.assertEqual(
                    (tokens[rid], reasons[rid]), argmax_reference(prompt, sp, 64, copy_logits, self.VOCAB)
                )
        totals = spec_totals(engine)
        self.assertGreater(totals.num_accepted_tokens, 0)
        self.assertLess(totals.num_accepted_tokens, totals.num_draft_tokens)
        self.assertGreater(engine.scheduler.num_preemptions, 0)
        self.assertGreater(sum(s.prefix_cache_hits for s in engine.step_stats), 0)

    def test_drafts_are_cut_by_the_budget_and_max_model_len(self) -> None:
        for budget, max_model_len, expected in ((3, 64, [4, 5]), (16, 10, [4])):
            engine, runner = make_engine(
                num_blocks=32, block_size=4, max_num_seqs=1, max_num_batched_tokens=budget,
                max_model_len=max_model_len, vocab=self.VOCAB, logits_fn=copy_logits,
                speculative_config=spec(4, 1, 2),
            )  # fmt: skip
            engine.add_request("a", [1, 2, 3, 4, 5, 1, 2], SamplingParams(max_tokens=8, ignore_eos=True))
            while engine.has_unfinished_requests() and not any(
                o.scheduled_spec_decode_tokens for o in runner.outputs
            ):
                engine.step()
            drafted = next(o for o in runner.outputs if o.scheduled_spec_decode_tokens)
            self.assertEqual(drafted.scheduled_spec_decode_tokens["a"], expected, (budget, max_model_len))

    def test_a_stop_inside_an_accepted_draft_trims_the_tokens_after_it(self) -> None:
        prompt = [1, 2, 3, 4, 5, 1, 2]
        params = SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(5,))
        engine, _ = make_engine(
            num_blocks=32, block_size=4, max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64,
            vocab=self.VOCAB, logits_fn=copy_logits, speculative_config=spec(4, 1, 2),
        )  # fmt: skip
        tokens, reasons = run_workload(engine, {0: [("a", prompt, params)]})
        expected = argmax_reference(prompt, params, 64, copy_logits, self.VOCAB)
        self.assertEqual((tokens["a"], reasons["a"]), expected)
        self.assertEqual(expected, ([3, 4, 5], "stop"))
        last = engine.step_stats[-1].spec_decoding
        assert last is not None
        self.assertEqual((last.num_draft_tokens, last.num_accepted_tokens), (4, 4))  # 1 + 4 tokens, 2 kept

    def test_a_draft_gives_way_before_anyone_is_preempted(self) -> None:
        engine, _ = make_engine(
            num_blocks=3, block_size=4, max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64,
            vocab=self.VOCAB, logits_fn=copy_logits, speculative_config=spec(4, 1, 1),
        )  # fmt: skip
        prompt = [1, 2, 1, 2, 1, 2, 1]
        engine.add_request("a", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            tokens += [t for out in engine.step() for t in out.new_token_ids]
        self.assertEqual(engine.scheduler.num_preemptions, 0)  # 12 positions fit 3 blocks, drafts did not
        expected, _ = argmax_reference(
            prompt, SamplingParams(max_tokens=6, ignore_eos=True), 64, copy_logits, self.VOCAB
        )
        self.assertEqual(tokens, expected)


def seeded_run(
    prompts: list[list[int]], params: list[SamplingParams], config: SpeculativeConfig | None, vocab: int
) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    engine, _ = make_engine(
        num_blocks=400, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
        vocab=vocab, logits_fn=random_logits, speculative_config=config,
    )  # fmt: skip
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp)
        tokens[str(i)], logprobs[str(i)] = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprob for lp in out.logprobs]
    return tokens, logprobs


class TestSampling(unittest.TestCase):
    def test_seeded_tokens_and_logprobs_equal_without_speculation(self) -> None:
        """One generator draw per emitted token with or without drafts: a seeded request samples the same
        tokens, with penalties, min_tokens, top-k / top-p, stop ids and logprobs keeping their meaning."""
        vocab = 5
        prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 4, 4, 4], [2, 3, 2, 3, 2]]
        variants = [
            SamplingParams(max_tokens=24, temperature=0.8, seed=1, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=24, temperature=1.3, seed=2, top_k=3, top_p=0.9, stop_token_ids=(0,)),
            SamplingParams(
                max_tokens=24, temperature=1.0, seed=3, min_tokens=10, presence_penalty=0.7,
                frequency_penalty=0.4, repetition_penalty=1.3, logprobs=0, logit_bias=((2, 1.5),),
            ),
            SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.5, ignore_eos=True),
        ]  # fmt: skip
        for params in variants:
            with self.subTest(params=params):
                ps = [params] * len(prompts)
                plain = seeded_run(prompts, ps, None, vocab)
                drafted = seeded_run(prompts, ps, spec(3, 1, 2), vocab)
                self.assertEqual(drafted, plain)


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): 1 - P(df/2, x/2), the regularized lower incomplete gamma by its
    power series P(a, z) = z^a e^-z / Gamma(a + 1) * sum_n z^n / ((a + 1) ... (a + n))."""
    a, z = df / 2, x / 2
    term = total = 1.0
    n = 0
    while term > 1e-16 * total:
        n += 1
        term *= z / (a + n)
        total += term
    return max(0.0, 1.0 - math.exp(a * math.log(z) - z - math.lgamma(a + 1)) * total) if z > 0 else 1.0


def chi2_critical(df: int, alpha: float) -> float:
    """The x with chi2_sf(x, df) = alpha, by bisection."""
    lo, hi = 0.0, 10.0 * df + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


class TestOutputDistribution(unittest.TestCase):
    """At temperature 1 the outputs with speculation follow the model's distribution.

    The fake model: 3 tokens, logits drawn from the context's hash (`random_logits`), so each context has
    its own distribution. The prompt [0 1 2 0 1] ends with an n-gram seen before, so drafts are
    proposed and accepted or rejected at both positions. The exact probability of each of the 27
    three-token outputs is the product of the model's probabilities along it. N seeded requests (seed i
    for request i: deterministic, it cannot flake) are binned by output, bins with fewer than 5 expected
    merged, and Pearson's statistic compared with the chi-square critical value at ALPHA: a correct
    sampler fails this test for a fresh set of seeds with probability ALPHA = 1e-4 (for the fixed seeds
    here it passes or fails every time). The same statistic must reject a classic wrong rule (after a
    rejection, resample from the full distribution instead of the residual), so the test can fail.
    """

    N = 3000
    ALPHA = 1e-4
    VOCAB = 3
    PROMPT = (0, 1, 2, 0, 1)
    LENGTH = 3

    def exact(self) -> dict[tuple[int, ...], float]:
        out: dict[tuple[int, ...], float] = {}
        for seq in itertools.product(range(self.VOCAB), repeat=self.LENGTH):
            p = 1.0
            for j in range(self.LENGTH):
                logits = random_logits([*self.PROMPT, *seq[:j]], self.VOCAB)
                probs = np.exp(logits - logits.max())
                p *= float(probs[seq[j]] / probs.sum())
            out[seq] = p
        return out

    def statistic(self, counts: Counter[tuple[int, ...]]) -> tuple[float, int]:
        """Pearson's chi-square against `exact`, small bins merged; (statistic, degrees of freedom)."""
        expected = {seq: p * self.N for seq, p in self.exact().items()}
        big = [seq for seq, e in expected.items() if e >= 5]
        observed = [float(counts[seq]) for seq in big]
        wanted = [expected[seq] for seq in big]
        rest = [seq for seq in expected if seq not in big]
        if rest:
            observed.append(float(sum(counts[seq] for seq in rest)))
            wanted.append(sum(expected[seq] for seq in rest))
        stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted, strict=True))
        return stat, len(observed) - 1

    def draw(self) -> tuple[Counter[tuple[int, ...]], SpecDecodingStats]:
        engine, _ = make_engine(
            num_blocks=4096, block_size=4, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=32,
            vocab=self.VOCAB, logits_fn=random_logits, speculative_config=spec(2, 1, 2),
        )  # fmt: skip
        outputs: dict[str, list[int]] = {}
        for i in range(self.N):
            params = SamplingParams(max_tokens=self.LENGTH, temperature=1.0, seed=i, ignore_eos=True)
            engine.add_request(str(i), list(self.PROMPT), params)
            outputs[str(i)] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] += out.new_token_ids
        return Counter(tuple(o) for o in outputs.values()), spec_totals(engine)

    def test_chi_square_against_the_exact_distribution(self) -> None:
        counts, totals = self.draw()
        self.assertGreater(totals.num_accepted_tokens, 0)
        self.assertLess(totals.num_accepted_tokens, totals.num_draft_tokens)
        self.assertGreater(totals.num_accepted_tokens_per_pos[1], 0)  # both draft positions decided
        stat, df = self.statistic(counts)
        self.assertLess(stat, chi2_critical(df, self.ALPHA), f"chi-square {stat:.1f} on {df} df")

        def wrong_verify(logits: np.ndarray, request: Request, draft: Sequence[int]) -> list[int]:
            tokens: list[int] = []
            for j in range(len(draft) + 1):
                token = sample_row(logits[j], request.sampling_params, request.generator)
                if j < len(draft) and token == draft[j]:
                    tokens.append(token)
                    continue
                if j < len(draft):  # rejected: resampled from the full distribution, not the residual
                    token = sample_row(logits[j], request.sampling_params, request.generator)
                tokens.append(token)
                break
            return tokens

        with mock.patch.object(model_runner_module, "verify_draft", wrong_verify):
            wrong, _ = self.draw()
        stat, df = self.statistic(wrong)
        self.assertGreater(stat, chi2_critical(df, self.ALPHA), "the test cannot tell a wrong rule")

    def test_chi2_helpers_against_known_values(self) -> None:
        self.assertAlmostEqual(chi2_sf(3.841458820694124, 1), 0.05, places=6)
        self.assertAlmostEqual(chi2_sf(18.307038053275146, 10), 0.05, places=6)
        self.assertAlmostEqual(chi2_critical(4, 0.01), 13.276704135987622, places=5)


class TestAcceptanceSummary(unittest.TestCase):
    def test_vllm_definitions(self) -> None:
        a, b = SpecDecodingStats(3), SpecDecodingStats(3)
        a.observe_draft(3, 2)
        a.observe_draft(2, 0)
        b.observe_draft(3, 3)
        with self.assertRaises(ValueError):
            b.observe_draft(2, 3)
        s = acceptance_summary([a, None, b], 3)
        self.assertEqual((s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens), (3, 8, 5))
        self.assertEqual(s.num_accepted_tokens_per_pos, (2, 2, 1))
        self.assertAlmostEqual(s.acceptance_rate, 5 / 8)
        self.assertAlmostEqual(s.acceptance_length, 1 + 5 / 3)
        self.assertEqual(s.per_position_acceptance_rates, (2 / 3, 2 / 3, 1 / 3))
        self.assertTrue(math.isnan(acceptance_summary([], 2).acceptance_rate))


if __name__ == "__main__":
    unittest.main()
