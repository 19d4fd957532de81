"""`--quantization gguf` on a file of every block type: each tensor kept as the file stores it.

A llama GGUF file whose linear layers hold all thirteen types of `block_formats` (the fused q/k/v and
gate/up of mixed types, as a Q4_K_M file has them) loads with every tensor's bytes as stored, a step
reads the file's tensor bytes, and the packed kernels give the greedy tokens of the numpy path on the
same decoded weights (the oracle); a tensor of a type the kernels do not decode (IQ4_NL) is widened
to float32 with a note naming it.
"""

from __future__ import annotations

import itertools
import tempfile
import unittest
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from attention_kv_caceh.benchmarks.probes import decode_weight_bytes
from attention_kv_caceh.kernels.block_formats import dequantize_blocks
from attention_kv_caceh.kernels.isa import compiled_variant
from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint
from attention_kv_caceh.model_executor.model import Model
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint
from tests.gguf_files import gguf_of_types
from tests.test_block_gemm import random_blocks
from tests.test_engine_weights import greedy

T = GGMLQuantizationType
TYPES = {
    "token_embd.weight": T.Q4_K,
    "output.weight": T.Q6_K,
    "blk.0.attn_q.weight": T.Q4_K,
    "blk.0.attn_k.weight": T.Q4_K,
    "blk.0.attn_v.weight": T.Q6_K,  # q/k/v: Q4_K + Q6_K, one block weight per part
    "blk.0.attn_output.weight": T.Q5_K,
    "blk.0.ffn_gate.weight": T.Q3_K,
    "blk.0.ffn_up.weight": T.Q2_K,
    "blk.0.ffn_down.weight": T.Q6_K,
    "blk.1.attn_q.weight": T.Q5_0,
    "blk.1.attn_k.weight": T.Q5_1,
    "blk.1.attn_v.weight": T.Q8_0,
    "blk.1.attn_output.weight": T.F16,
    "blk.1.ffn_gate.weight": T.BF16,
    "blk.1.ffn_up.weight": T.F32,
    "blk.1.ffn_down.weight": T.Q4_0,
}


def _blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks of `qtype` whose weights have an RMS of about 0.1 (float16 fields rescaled; a
    float type's values drawn so), so the activations stay of order one."""
    rng = np.random.default_rng(seed)
    if qtype in (T.F32, T.F16):
        return (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
    fmt = qtype.name.lower()
    if qtype == T.IQ4_NL:  # 18 bytes: float16 d, 16 bytes of indices into a 16-value table
        raw = rng.integers(0, 256, size=(rows, cols // 32, 18), dtype=np.uint8)
        raw[..., 0:2] = np.full(raw.shape[:2], 0.001, "<f2").view(np.uint8).reshape(*raw.shape[:2], 2)
        return raw.reshape(rows, -1)
    from attention_kv_caceh.kernels.block_formats import FORMATS

    row = FORMATS[fmt]
    raw = random_blocks(rng, fmt, rows, cols // row.chunk)
    if not row.half_fields:
        return raw
    rms = float(np.sqrt(np.mean(dequantize_blocks(raw, fmt) ** 2)))
    blocks = raw.reshape(rows, -1, row.nbytes)
    for field in row.half_fields:
        at = row.field_offset(field)
        half = blocks[..., at : at + 2].copy().view("<f2").astype(np.float64) * (0.1 / rms)
        blocks[..., at : at + 2] = half.astype("<f2").view(np.uint8)
    return raw


@unittest.skipUnless(compiled_variant() is not None, "no packed kernel for this CPU")
class EveryTypeAsStoredTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        root = Path(cls._tmp.name)
        folder = write_random_checkpoint(root / "m", "llama", "tiny")
        seeds = itertools.count()

        def blocks(qtype: GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
            return _blocks(qtype, rows, cols, next(seeds))

        cls.path = gguf_of_types(folder, root / "every.gguf", TYPES, blocks)
        iq = TYPES | {"blk.1.ffn_up.weight": T.IQ4_NL}
        cls.iq_path = gguf_of_types(folder, root / "iq.gguf", iq, blocks)

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def test_every_tensor_is_kept_as_the_file_stores_it(self) -> None:
        model = Model.load(self.path, "float32", "packed", "gguf")
        self.assertEqual(model.weight_notes, [])
        first, second = model.layers
        self.assertEqual(
            [w.format for w in (first.qkv_proj, first.o_proj, first.gate_up_proj, first.down_proj)],
            ["q4_k+q6_k", "q5_k", "q3_k+q2_k", "q6_k"],
        )
        self.assertEqual(
            [w.format for w in (second.qkv_proj, second.o_proj, second.gate_up_proj, second.down_proj)],
            ["q5_0+q5_1+q8_0", "f16", "bf16+f32", "q4_0"],
        )
        self.assertEqual((model.embedding.format, model.lm_head.format), ("q4_k", "q6_k"))
        file = GGUFCheckpoint(self.path)
        for name, weight in (
            ("model.layers.0.mlp.down_proj.weight", first.down_proj),
            ("model.layers.1.self_attn.o_proj.weight", second.o_proj),
        ):
            assert weight.blocks is not None
            stored = file.quantized(name).data  # F16: float16 values; their bytes are the blocks
            np.testing.assert_array_equal(
                weight.blocks.blocks, stored.view(np.uint8).reshape(stored.shape[0], -1)
            )
        parts = [p.blocks for p in first.qkv_proj.stacked]
        stored = [file.quantized(f"model.layers.0.self_attn.{n}_proj.weight").data for n in "qkv"]
        np.testing.assert_array_equal(parts[0], np.concatenate(stored[:2]))
        np.testing.assert_array_equal(parts[1], stored[2])
        # a decode step reads the file's tensor bytes: every tensor once, the embedding's rows aside
        tensors = sum(int(t.n_bytes) for part in file.parts for t in part.tensors)
        embedding = int(file.quantized("model.embed_tokens.weight").data.nbytes)
        self.assertEqual(decode_weight_bytes(model, 0), tensors - embedding)

    def test_the_packed_kernels_give_the_greedy_tokens_of_numpy_on_the_same_weights(self) -> None:
        packed = Model.load(self.path, "float32", "packed", "gguf", activations="float32")
        oracle = Model.load(self.path, "float32", "numpy", "gguf")  # x @ W.T on the decoded blocks
        np.testing.assert_array_equal(packed.layers[0].qkv_proj.dense(), oracle.layers[0].qkv_proj.dense())
        self.assertEqual(greedy(packed), greedy(oracle))

    def test_a_type_without_a_kernel_is_widened_with_a_note_naming_it(self) -> None:
        with self.assertLogs("attention_kv_caceh.model_executor.model_weights", "WARNING") as logs:
            model = Model.load(self.iq_path, "float32", "packed", "gguf")
        self.assertEqual(len(model.weight_notes), 1)
        note = model.weight_notes[0]
        self.assertIn("blk.1.ffn_up.weight", note)
        self.assertIn("IQ4_NL is an IQ type", note)
        self.assertIn("blk.1.ffn_up.weight", logs.output[0])
        self.assertEqual(model.layers[1].gate_up_proj.format, "float32")
        self.assertEqual(model.layers[1].down_proj.format, "q4_0")  # the others stay as stored


if __name__ == "__main__":
    unittest.main()
