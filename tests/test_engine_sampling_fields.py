"""Per-request sampling fields in the batched engine: penalties, logit_bias, min_tokens, stop_token_ids.

The oracle is a plain loop over one request: the fake runner's dense logits of the growing sequence
(`random_logits`, a function of the context alone), the field's formula written out per token in float64,
then argmax. The engine runs the same request beside unpenalised neighbours in one batch; its tokens must
equal the loop's, and the neighbours' must equal their own unpenalised run.
"""

from __future__ import annotations

import unittest

import numpy as np

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.request import Request, SamplingParams
from attention_kv_caceh.engine.sampler import apply_logits_processors
from tests.engine_fakes import VOCAB, FakeModelRunner, random_logits

EOS = 0


def oracle(prompt: list[int], params: SamplingParams, eos: int | None = EOS) -> tuple[list[int], str]:
    """Greedy tokens of one request, each field applied by its formula, token by token."""
    out: list[int] = []
    while True:
        logits = [float(x) for x in random_logits(prompt + out, VOCAB)]
        for token_id, bias in params.logit_bias:
            logits[token_id] += bias
        if len(out) < params.min_tokens:
            for t in [*params.stop_token_ids, *([] if eos is None or params.ignore_eos else [eos])]:
                logits[t] = -np.inf
        for t in range(VOCAB):
            if t in prompt or t in out:  # repetition penalty over prompt and output
                p = params.repetition_penalty
                logits[t] = logits[t] / p if logits[t] > 0 else logits[t] * p
            count = out.count(t)  # OpenAI's frequency and presence penalties over the output
            logits[t] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        token = max(range(VOCAB), key=lambda t: (logits[t], -t))
        out.append(token)
        stopped = (not params.ignore_eos and token == eos) or token in params.stop_token_ids
        if stopped and len(out) >= params.min_tokens:
            return out, "stop"
        if len(out) >= params.max_tokens:
            return out, "length"


def run_batch(prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[list[int], str | None]]:
    """Every request in one engine, batched; (tokens, finish_reason) of each."""
    config = EngineConfig(max_num_seqs=8, num_kv_blocks=128, block_size=4, max_model_len=128)
    engine = LLMEngine(config, FakeModelRunner(128, 4, VOCAB, random_logits), eos_token_id=EOS)
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
        tokens[f"r{i}"] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return [(tokens[f"r{i}"], reasons.get(f"r{i}")) for i in range(len(prompts))]


PROMPT = [5, 9, 9, 2, 17, 5, 30]


class PenaltyTest(unittest.TestCase):
    def test_a_penalised_request_beside_plain_ones_gets_the_oracles_tokens_and_they_get_theirs(self) -> None:
        penalised = SamplingParams(
            max_tokens=12,
            temperature=0.0,
            ignore_eos=True,
            frequency_penalty=0.9,
            presence_penalty=0.6,
            repetition_penalty=1.7,
            logit_bias=((3, 2.5), (11, -4.0)),
        )
        plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = [PROMPT, [1, 2, 3], PROMPT, [7, 7, 7, 7, 7]]
        got = run_batch(prompts, [plain, penalised, penalised, plain])
        for prompt, params, (tokens, reason) in zip(
            prompts, [plain, penalised, penalised, plain], got, strict=True
        ):
            self.assertEqual((tokens, reason), oracle(prompt, params))
        # the fields change something here, so the test can fail
        self.assertNotEqual(got[0][0], got[2][0])

    def test_each_field_alone_matches_its_formula(self) -> None:
        fields: list[dict[str, object]] = [
            {"frequency_penalty": 2.0},
            {"presence_penalty": -1.5},
            {"repetition_penalty": 0.5},
            {"repetition_penalty": 3.0},
            {"logit_bias": ((4, 100.0),)},
        ]
        for extra in fields:
            with self.subTest(extra=extra):
                params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, **extra)  # pyright: ignore[reportArgumentType]
                self.assertEqual(run_batch([PROMPT], [params])[0], oracle(PROMPT, params))

    def test_apply_logits_processors_leaves_a_plain_request_unchanged(self) -> None:
        logits = random_logits(PROMPT, VOCAB)
        request = Request("r", PROMPT, SamplingParams(max_tokens=4))
        np.testing.assert_array_equal(apply_logits_processors(logits, request), logits)


class StopTokenTest(unittest.TestCase):
    def test_stop_token_ids_end_at_the_first_occurrence_and_min_tokens_holds_them_back(self) -> None:
        plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        known, _ = oracle(PROMPT, plain)
        # the first token that did not occur before it: stopping on it ends exactly there
        j = next(i for i in range(1, len(known)) if known[i] not in known[:i])
        stop = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=(known[j],))
        ((tokens, reason),) = run_batch([PROMPT], [stop])
        self.assertEqual((tokens, reason), (known[: j + 1], "stop"))  # the stop token is an output token
        held = SamplingParams(
            max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=(known[j],), min_tokens=j + 2
        )
        ((tokens, reason),) = run_batch([PROMPT], [held])
        self.assertEqual((tokens, reason), oracle(PROMPT, held))
        self.assertNotIn(known[j], tokens[: j + 2])
        self.assertGreaterEqual(len(tokens), j + 2)

    def test_min_tokens_masks_eos(self) -> None:
        plain = SamplingParams(max_tokens=16, temperature=0.0)
        eos_run, _ = oracle(PROMPT, plain, eos=None)
        eos = eos_run[2]  # an id the greedy run produces at step 2: as eos it would stop there
        config = EngineConfig(max_num_seqs=2, num_kv_blocks=64, block_size=4, max_model_len=128)
        for min_tokens in (0, 5):
            with self.subTest(min_tokens=min_tokens):
                engine = LLMEngine(config, FakeModelRunner(64, 4, VOCAB, random_logits), eos_token_id=eos)
                params = SamplingParams(max_tokens=16, temperature=0.0, min_tokens=min_tokens)
                (tokens,) = engine.generate([PROMPT], params)
                expected, _ = oracle(PROMPT, params, eos=eos)
                self.assertEqual(tokens, expected)
                if min_tokens:
                    self.assertGreater(len(tokens), min_tokens)
                    self.assertNotIn(eos, tokens[:min_tokens])
                else:
                    self.assertEqual(tokens[-1], eos)


if __name__ == "__main__":
    unittest.main()
