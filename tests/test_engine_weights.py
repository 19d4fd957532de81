"""Compact linear weights in the engine: bfloat16 panels and GGUF blocks against NumPy on the same weights.

The oracle of a compact format is the numpy GEMM path on the floats that format decodes to: the same
weights, multiplied by `x @ W.T`. A model on the packed path must pick the same greedy tokens as one
on that oracle, and a float64 model on the decoded weights too.
"""

from __future__ import annotations

import tempfile
import unittest
from pathlib import Path

import numpy as np

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.kernels.block_formats import dequantize_blocks, quantize_weight
from attention_kv_caceh.kernels.dispatch import (
    WEIGHT_FORMATS,
    compute_dtype,
    resolve_gemm_path,
    weight_format,
)
from attention_kv_caceh.kernels.gemm import bfloat16_bits, bfloat16_to_float32
from attention_kv_caceh.kernels.isa import compiled_variant
from attention_kv_caceh.model_executor.layers import LinearWeight, linear
from attention_kv_caceh.model_executor.model import Model
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint
from tests.test_engine_model import FakeRequest, FakeSchedulerOutput

PACKED = compiled_variant() is not None


def greedy(model: Model, steps: int = 4) -> list[list[int]]:
    """Two requests of five prompt tokens, one prefill step and `steps` - 1 decode steps, greedy."""
    runner = ModelRunner(
        model, EngineConfig(block_size=4, dtype="float32" if model.dtype == np.float32 else "float64"), 8
    )
    reqs = [
        FakeRequest(r, list(range(1 + 7 * i, 6 + 7 * i)), 0, [2 * i, 2 * i + 1]) for i, r in enumerate("ab")
    ]
    n = 5
    for _ in range(steps):
        logits = runner.execute_model(FakeSchedulerOutput(reqs, {r.request_id: n for r in reqs}))  # type: ignore[arg-type]
        for row, req in enumerate(reqs):
            req.num_computed_tokens += n
            req.all_token_ids.append(int(np.argmax(logits[row])))
        n = 1
    return [r.all_token_ids for r in reqs]


class LinearWeightTest(unittest.TestCase):
    def test_every_format_decodes_to_what_the_numpy_path_multiplies(self) -> None:
        rng = np.random.default_rng(0)
        w = rng.standard_normal((40, 64)).astype(np.float32)
        x = rng.standard_normal((9, 64)).astype(np.float32)
        for fmt in WEIGHT_FORMATS:
            oracle = LinearWeight.of(w, "numpy", fmt)
            if fmt == "bfloat16":
                np.testing.assert_array_equal(oracle.dense(), bfloat16_to_float32(bfloat16_bits(w)))
            elif fmt != "float32":
                np.testing.assert_array_equal(oracle.dense(), dequantize_blocks(quantize_weight(w, fmt), fmt))
            self.assertEqual((oracle.shape, oracle.format), ((40, 64), fmt))
            if not PACKED:
                continue
            packed = LinearWeight.of(w, "packed", fmt)
            np.testing.assert_array_equal(packed.dense(), oracle.dense())
            self.assertIn(fmt, packed.kernel)
            got = linear(x, packed)
            want = x.astype(np.float64) @ oracle.dense().astype(np.float64).T
            rounding = 2.0**-7 if packed.kernel.endswith("(vdpbf16ps)") else 1e-5  # x read as bfloat16
            np.testing.assert_allclose(got, want, rtol=rounding, atol=rounding * np.abs(want).max())

    def test_bytes_read_per_product_follow_the_format(self) -> None:
        w = np.ones((64, 64), dtype=np.float32)
        sizes = {
            fmt: LinearWeight.of(w, "numpy" if not PACKED else "packed", fmt).nbytes for fmt in WEIGHT_FORMATS
        }
        if PACKED:
            self.assertEqual(sizes["q8_0"], 64 * 2 * 34)
            self.assertEqual(sizes["q4_1"], 64 * 2 * 20)
            self.assertEqual(sizes["q4_0"], 64 * 2 * 18)
            self.assertLessEqual(sizes["bfloat16"] * 2, sizes["float32"] + 1)

    def test_from_blocks_keeps_the_bytes_or_decodes_them(self) -> None:
        raw = quantize_weight(np.random.default_rng(1).standard_normal((5, 32)).astype(np.float32), "q4_1")
        decoded = LinearWeight.from_blocks(raw, "q4_1", "numpy", np.float64)
        self.assertEqual(decoded.dense().dtype, np.float64)
        np.testing.assert_array_equal(decoded.dense(), dequantize_blocks(raw, "q4_1"))
        if PACKED:
            kept = LinearWeight.from_blocks(raw, "q4_1", "packed")
            assert kept.blocks is not None
            self.assertTrue(np.shares_memory(kept.blocks.blocks, raw))  # the bytes as given, not a copy


class EngineFormatsTest(unittest.TestCase):
    def test_dtype_and_quantization_choose_the_format_and_are_checked(self) -> None:
        self.assertEqual(weight_format("bfloat16", None), "bfloat16")
        self.assertEqual(weight_format("float32", "q4_1"), "q4_1")
        self.assertEqual(compute_dtype("bfloat16"), np.float32)
        with self.assertRaisesRegex(ValueError, "bfloat16"):
            weight_format("bfloat16", "q8_0")
        with self.assertRaisesRegex(ValueError, "q5_k"):
            resolve_gemm_path("auto", "float32", "q5_k")
        with self.assertRaisesRegex(ValueError, "quantization"):
            EngineConfig(quantization="q3_k")
        with self.assertRaisesRegex(ValueError, "bfloat16"):
            EngineConfig(dtype="bfloat16", quantization="q4_0")
        self.assertEqual(resolve_gemm_path("auto", "float64", "q4_0")[0], "numpy")

    def test_a_bfloat16_engine_keeps_a_float32_kv_cache(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_random_checkpoint(Path(tmp) / "m", "llama", "tiny", seed=5)
            model = Model.load(folder, "bfloat16")
            runner = ModelRunner(model, EngineConfig(dtype="bfloat16", block_size=4), 4)
            self.assertEqual(runner.kv_caches[0][0].dtype, np.float32)
            self.assertEqual(
                ModelRunner.bytes_per_block(model.config, 4, "bfloat16"),
                ModelRunner.bytes_per_block(model.config, 4, "float32"),
            )

    @unittest.skipUnless(PACKED, "no packed kernel for this CPU")
    def test_activations_is_checked_and_a_setting_without_effect_is_named(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_random_checkpoint(Path(tmp) / "m", "llama", "tiny", seed=3)
            with self.assertRaises(ValueError):
                Model.load(folder, "float32", "packed", "q4_0", activations="int4")
            with self.assertLogs("attention_kv_caceh.model_executor.model", "WARNING") as logs:
                Model.load(folder, "float32", "packed", None, activations="float32")  # float32 panels
            self.assertIn("--activations float32 has no effect", logs.output[0])
            blocks = Model.load(
                folder, "float32", "packed", "q4_0", activations="int8"
            )  # on blocks: no warning
            self.assertEqual(blocks.activations, "int8")
            self.assertTrue(blocks.has_int_kernel_weights)
            self.assertIn("8 bits, integer dot products", blocks.gemm_note)

    @unittest.skipUnless(PACKED, "no packed kernel for this CPU")
    def test_compact_models_pick_the_greedy_tokens_of_numpy_on_the_same_weights(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_random_checkpoint(Path(tmp) / "m", "llama", "tiny", seed=3)
            for dtype, quantization in (
                ("bfloat16", None),
                ("float32", "q8_0"),
                ("float32", "q4_0"),
                ("float32", "q4_1"),
            ):
                with self.subTest(dtype=dtype, quantization=quantization):
                    # float32 activations: the same products as NumPy's (8-bit ones: the test below)
                    packed = Model.load(folder, dtype, "packed", quantization, activations="float32")
                    oracle = Model.load(folder, dtype, "numpy", quantization)
                    self.assertEqual(packed.weight_format, quantization or dtype)
                    self.assertEqual(greedy(packed), greedy(oracle))
                    if quantization is not None:  # and the decoded weights in float64
                        self.assertEqual(
                            greedy(packed), greedy(Model.load(folder, "float64", "numpy", quantization))
                        )


@unittest.skipUnless(PACKED, "no packed kernel for this CPU")
class GGUFBlocksTest(unittest.TestCase):
    """The real model (SmolLM2-135M-Instruct, Q4_1 layers and a Q8_0 embedding) from its file's bytes."""

    def test_the_files_blocks_are_kept_and_give_the_greedy_tokens_of_numpy_on_them(self) -> None:
        from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint
        from attention_kv_caceh.model_executor.model_source import resolve_model

        packed = Model.load("smollm2", "float32", "packed", "gguf", activations="float32")
        self.assertEqual({layer.gate_up_proj.format for layer in packed.layers}, {"q4_1"})
        self.assertEqual((packed.lm_head.format, packed.embedding.format), ("q8_0", "q8_0"))
        assert packed.lm_head.blocks is not None and packed.embedding.blocks is not None
        self.assertIs(packed.lm_head.blocks.blocks, packed.embedding.blocks)  # the tied head: same bytes
        file = GGUFCheckpoint(resolve_model("smollm2").path).quantized("model.layers.0.mlp.down_proj.weight")
        down = packed.layers[0].down_proj.blocks
        assert down is not None
        np.testing.assert_array_equal(down.blocks, file.data)  # the bytes as the file stores them
        oracle = Model.load("smollm2", "float32", "numpy", "gguf")  # x @ W.T on the decoded blocks
        self.assertEqual(greedy(packed), greedy(oracle))

    def test_8_bit_activations_keep_the_greedy_token_except_at_near_ties(self) -> None:
        """The real model with x quantized to 8 bits per product (`--activations int8`) against float32
        activations, teacher-forced on the same text: every row's argmax is the same unless the
        float32 logits' top two are closer than twice the largest logit difference of that row, and
        no logit moves by more than half the logits' standard deviation (a wrong block or a wrong
        scale moves them by more than the whole spread)."""
        from attention_kv_caceh.engine.tokenizer import Tokenizer
        from attention_kv_caceh.model_executor.model_source import resolve_model
        from attention_kv_caceh.model_executor.paged_attention import allocate_kv_cache
        from attention_kv_caceh.model_executor.warmup import _metadata

        def logits(model: Model, ids: list[int]) -> np.ndarray:
            c, n = model.config, len(ids)
            caches = [
                allocate_kv_cache(-(-n // 16), 16, c.num_key_value_heads, c.head_dim, np.float32)
                for _ in model.layers
            ]
            hidden = model.forward(np.array(ids), np.arange(n), caches, _metadata(n, 16))
            return model.compute_logits(hidden).astype(np.float64)  # [N, V], every row

        float32 = Model.load("smollm2", "float32", "packed", "gguf", activations="float32")
        int8 = Model.load("smollm2", "float32", "packed", "gguf", activations="int8")
        self.assertEqual(
            Model.load("smollm2", "float32", "packed", "gguf").activations, "float32"
        )  # the default
        tokenizer = Tokenizer.load(resolve_model("smollm2").path)
        for text in (
            "The capital of France is Paris. The capital of Germany is",
            "def add(a, b):\n    return",
        ):
            ids = tokenizer.encode(text)
            want, got = logits(float32, ids), logits(int8, ids)
            moved = np.abs(got - want).max(axis=1)  # [N]
            top2 = np.sort(want, axis=1)[:, -2:]
            near_tie = top2[:, 1] - top2[:, 0] < 2 * moved
            with self.subTest(text=text):
                self.assertTrue((moved < 0.5 * want.std(axis=1)).all(), moved)
                self.assertTrue(np.logical_or(want.argmax(1) == got.argmax(1), near_tie).all())
                self.assertFalse(np.array_equal(got, want))  # the 8-bit path did run


if __name__ == "__main__":
    unittest.main()
