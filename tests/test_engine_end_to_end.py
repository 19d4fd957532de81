"""With the real NumPy model: the engine's greedy tokens under continuous batching, chunked prefill, prefix
caching and preemption equal those of the same model run one prompt at a time, without chunking or caching.

Oracle: LLMEngine.from_pretrained on a random tiny checkpoint with max_num_seqs=1, a pool that never
preempts, prefix caching off, in float64. Skipped until the model modules (model, model_runner, tokenizer,
make_model) are in the package.
"""

from __future__ import annotations

import importlib.util
import random
import tempfile
import unittest
from pathlib import Path

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.request import SamplingParams

_HAVE_MODEL = all(
    importlib.util.find_spec(f"attention_kv_caceh.{m}") is not None
    for m in ("model_executor.model", "engine.model_runner", "engine.tokenizer", "toy_model.make_model")
)


@unittest.skipUnless(_HAVE_MODEL, "the engine's model modules are not in this tree")
class EngineWithRealModelTest(unittest.TestCase):
    def test_batched_chunked_cached_preempted_tokens_equal_one_prompt_at_a_time(self) -> None:
        make_model = importlib.import_module("attention_kv_caceh.toy_model.make_model")
        rng = random.Random(0)
        shared = [rng.randrange(3, 200) for _ in range(12)]
        prompts = [shared + [rng.randrange(3, 200) for _ in range(rng.randint(1, 20))] for _ in range(6)]
        prompts += [[rng.randrange(3, 200) for _ in range(rng.randint(1, 30))] for _ in range(4)]
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        with tempfile.TemporaryDirectory() as tmp:
            for arch in ("llama", "qwen3"):
                with self.subTest(arch=arch):
                    path = str(make_model.write_random_checkpoint(Path(tmp) / arch, arch=arch, preset="tiny"))
                    solo_config = EngineConfig(
                        dtype="float64",
                        num_kv_blocks=64,
                        block_size=4,
                        max_num_seqs=1,
                        enable_prefix_caching=False,
                    )
                    solo = [
                        LLMEngine.from_pretrained(path, solo_config).generate([p], params)[0] for p in prompts
                    ]
                    config = EngineConfig(
                        dtype="float64",
                        num_kv_blocks=20,
                        block_size=4,
                        max_num_seqs=6,
                        max_num_batched_tokens=16,
                    )
                    engine = LLMEngine.from_pretrained(path, config)
                    self.assertEqual(engine.generate(prompts, params), solo)
                    kv = engine.scheduler.kv_cache_manager
                    self.assertGreater(engine.scheduler.num_preemptions, 0)
                    self.assertGreater(kv.prefix_cache_hits, 0)
                    self.assertEqual(kv.num_free_blocks, 20)


if __name__ == "__main__":
    unittest.main()
