"""A step whose logits are not finite for one request fails that request alone: the core reports it with
finish_reason "error" and frees its blocks, the step's other requests keep their tokens, and a server
answers the failed request with an error and keeps serving.

Oracle: the letter runner's tokens (`letter_token`) for the requests that were not poisoned, as a run
without the poisoned request gives them.
"""

from __future__ import annotations

import unittest
from collections.abc import Sequence

import numpy as np
import openai

from attention_kv_caceh.engine.outputs import EngineCoreRequest
from attention_kv_caceh.engine.request import SamplingParams
from tests.engine_fakes import CharTokenizer, expected_text, letter_logits, letter_token, make_text_core
from tests.serve_helpers import MODEL, fake_server

POISON = 1  # the id of "!": a context holding it gets non-finite logits
TOK = CharTokenizer()


def poisoned(value: float) -> object:
    def logits_fn(context: Sequence[int], vocab: int) -> np.ndarray:
        logits = letter_logits(context, vocab)
        if POISON in context:
            logits[3] = value
        return logits

    return logits_fn


class CoreTest(unittest.TestCase):
    def test_only_the_request_with_non_finite_logits_fails_and_the_others_run_on(self) -> None:
        for value in (np.nan, np.inf, -np.inf):
            with self.subTest(value=value):
                core, _ = make_text_core(logits_fn=poisoned(value))  # type: ignore[arg-type]
                params = SamplingParams(max_tokens=5, ignore_eos=True)
                prompts = {"good": [40, 41, 42], "bad": [40, POISON, 42], "also-good": [50]}
                for rid, prompt in prompts.items():
                    core.add_request(core.preprocess_add_request(EngineCoreRequest(rid, prompt, params)))
                tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
                finished: dict[str, tuple[str | None, str | None]] = {}
                with self.assertLogs("attention_kv_caceh.engine.core", "ERROR"):
                    first_step = core.step()
                steps = [first_step]
                while core.has_unfinished_requests():
                    steps.append(core.step())
                for outputs in steps:
                    for out in outputs.outputs:
                        tokens[out.request_id] += out.new_token_ids
                        if out.finish_reason is not None:
                            finished[out.request_id] = (out.finish_reason, out.error)
                self.assertEqual(finished["bad"][0], "error")
                self.assertIn("NaN, an infinity", finished["bad"][1] or "")
                self.assertEqual(tokens["bad"], [])
                self.assertEqual(
                    {o.request_id for o in first_step.outputs}, set(prompts)
                )  # one step, all three
                for rid in ("good", "also-good"):
                    context = list(prompts[rid])
                    for _ in range(5):
                        context.append(letter_token(context))
                    self.assertEqual(tokens[rid], context[len(prompts[rid]) :], rid)
                    self.assertEqual(finished[rid], ("length", None))
                kv = core.scheduler.kv_cache_manager
                self.assertEqual(kv.num_free_blocks, kv.num_blocks)


class ServerTest(unittest.TestCase):
    def test_the_server_fails_the_poisoned_request_and_keeps_serving(self) -> None:
        thread, engine, _ = fake_server(logits_fn=poisoned(np.nan))  # type: ignore[arg-type]
        oai = openai.OpenAI(base_url=thread.base_url + "/v1", api_key="none", max_retries=0, timeout=20)
        with thread, self.assertLogs("attention_kv_caceh", "ERROR"):
            with self.assertRaises(openai.APIError) as caught:
                oai.completions.create(model=MODEL, prompt="a!b", max_tokens=4)
            self.assertIn("NaN, an infinity", str(caught.exception))
            stream = oai.completions.create(model=MODEL, prompt="x!", max_tokens=4, stream=True)
            with self.assertRaises(openai.APIError):
                list(stream)
            ok = oai.completions.create(model=MODEL, prompt="f", max_tokens=4)
        self.assertEqual(ok.choices[0].text, expected_text(TOK.encode("f"), 4))
        self.assertFalse(engine.has_unfinished_requests())


if __name__ == "__main__":
    unittest.main()
