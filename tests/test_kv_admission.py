"""The one KV admission rule: the scheduler, `generate`'s check and the server refuse the same requests with
the same numbers, and the server's pool is the one the engine core reported in its ready message.

Oracle: a request fits when its largest context, min(prompt + max_tokens, max(max_model_len, prompt + 1))
- 1 positions (one output token at least; the last sampled token is never computed), is at most
num_blocks * block_size, written out here.
"""

from __future__ import annotations

import re
import types
import unittest
from typing import Any, cast

from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.cli.common import UsageError
from attention_kv_caceh.cli.engine_args import check_prompts_fit
from attention_kv_caceh.engine.async_llm import AsyncLLM
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.kv_cache_manager import KVCacheConfig, RequestTooLargeError
from attention_kv_caceh.engine.request import Request, SamplingParams
from attention_kv_caceh.engine.scheduler import Scheduler
from attention_kv_caceh.entrypoints.openai.serving import HTTPError
from attention_kv_caceh.entrypoints.openai.serving_engine import OpenAIServing
from tests.engine_fakes import CharTokenizer, make_text_core


def _numbers(message: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", message)]


def _refusals(
    num_blocks: int, block_size: int, max_model_len: int, num_prompt: int, max_tokens: int
) -> tuple[str | None, str | None, tuple[str, str] | None]:
    """What each caller says about one request: the scheduler's error, generate's UsageError, the
    server's (message, param); None where it is accepted."""
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, max_model_len=max_model_len)
    params = SamplingParams(max_tokens=max_tokens)
    prompt = [1] * num_prompt
    scheduler_error = cli_error = None
    http: tuple[str, str] | None = None
    try:
        Scheduler(config, num_blocks, max_model_len).add_request(Request("r", prompt, params))
    except RequestTooLargeError as exc:
        scheduler_error = str(exc)
    pool = KVCacheConfig(num_blocks, block_size, max_model_len)
    plan = types.SimpleNamespace(kv_cache_config=pool, max_model_len=max_model_len)
    try:
        check_prompts_fit(cast("Any", plan), [prompt], params)
    except UsageError as exc:
        cli_error = str(exc)
    llm = types.SimpleNamespace(kv_cache_config=pool)
    serving = OpenAIServing(cast("Any", llm), CharTokenizer(), "m", max_model_len)
    try:
        serving._check_kv_capacity(num_prompt, params)  # pyright: ignore[reportPrivateUsage]
    except HTTPError as exc:
        http = (exc.message, cast("str", exc.param))
    return scheduler_error, cli_error, http


class OneRuleTest(unittest.TestCase):
    def test_the_three_callers_refuse_the_same_request_with_the_same_numbers(self) -> None:
        # 4 blocks of 4 tokens: prompt 10 + max_tokens 8 needs 17 positions, 5 blocks
        scheduler_error, cli_error, http = _refusals(4, 4, 96, 10, 8)
        assert scheduler_error is not None and cli_error is not None and http is not None
        self.assertEqual(_numbers(scheduler_error), [10, 8, 5, 4, 17, 4, 16])
        self.assertIn(scheduler_error, cli_error)
        self.assertIn("--max-tokens", cli_error)  # generate names its flag
        self.assertEqual(http, (scheduler_error, "max_tokens"))
        self.assertEqual(_refusals(4, 4, 96, 20, 1)[2], (_refusals(4, 4, 96, 20, 1)[0], "prompt"))
        self.assertEqual(_refusals(4, 4, 96, 10, 7), (None, None, None))  # 16 positions: fits

    @settings(max_examples=60, deadline=None)
    @given(
        st.integers(1, 8),
        st.integers(1, 8),
        st.integers(2, 80),
        st.integers(1, 80),
        st.integers(1, 80),
    )
    def test_they_agree_with_the_written_out_rule(
        self, num_blocks: int, block_size: int, max_model_len: int, num_prompt: int, max_tokens: int
    ) -> None:
        num_prompt = min(num_prompt, max_model_len)  # a longer prompt is each caller's own refusal
        final = min(num_prompt + max_tokens, max(max_model_len, num_prompt + 1))
        fits = final - 1 <= num_blocks * block_size
        scheduler_error, cli_error, http = _refusals(
            num_blocks, block_size, max_model_len, num_prompt, max_tokens
        )
        self.assertEqual(scheduler_error is None, fits)
        self.assertEqual(cli_error is None, fits)
        self.assertEqual(http is None, fits)
        if scheduler_error is not None:
            assert http is not None and cli_error is not None
            self.assertEqual(http[0], scheduler_error)
            self.assertIn(scheduler_error, cli_error)


class ReadyMessageTest(unittest.TestCase):
    def test_the_core_reports_its_pool_when_ready(self) -> None:
        core, _runner = make_text_core(num_blocks=7, block_size=4, max_model_len=64)
        llm = AsyncLLM.from_engine_core(core, CharTokenizer())
        try:
            self.assertEqual(llm.kv_cache_config, KVCacheConfig(7, 4, 64))
            assert llm.kv_cache_config is not None
            self.assertEqual(llm.kv_cache_config.kv_capacity_tokens, 28)
        finally:
            llm.client.shutdown()
            llm.client.close()


if __name__ == "__main__":
    unittest.main()
