"""GGUF checkpoints: each tensor type against a float64 dequantization from the block definitions, the
Q/K row order, a make-model checkpoint converted to GGUF loading to the same model, and clear refusals."""

from __future__ import annotations

import dataclasses
import tempfile
import unittest
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.entrypoints.chat_utils import load_chat_template
from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint, unpermute_rows
from attention_kv_caceh.model_executor.model_source import load_model_config
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint
from tests.gguf_files import gguf_from_checkpoint, llama_cpp_permute, write

T = GGMLQuantizationType


# -- float64 dequantization from the block formats (ggml-common.h's block structs) ----------------------


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian float16 field at byte `start` of every block, as float64 `[n]`."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view("<f2")[:, 0].astype(np.float64)


def _k_scale_min(scales: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 6-bit scale and minimum of sub-block j from 12 packed bytes (get_scale_min_k4)."""
    s = scales.astype(np.int64)
    if j < 4:
        return s[:, j] & 63, s[:, j + 4] & 63
    return (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4), (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)


def reference_dequantize(blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """uint8 blocks `[n, type_size]` -> float64 weights `[n, block_size]`, written from each format's
    definition: a float16 scale d (and minimum m or dmin), packed low/high nibbles or bits."""
    b = blocks.astype(np.int64)
    n = len(b)
    if qtype == T.Q8_0:  # d, int8 q[32]: w = d q
        return _f16(blocks, 0)[:, None] * blocks[:, 2:].view(np.int8)
    if qtype in (T.Q4_0, T.Q4_1):  # d (, m), nibbles: element j low nibble of byte j, j + 16 high
        start = 2 if qtype == T.Q4_0 else 4
        q = np.concatenate([b[:, start:] & 0xF, b[:, start:] >> 4], axis=1)
        d = _f16(blocks, 0)[:, None]
        return d * (q - 8) if qtype == T.Q4_0 else d * q + _f16(blocks, 2)[:, None]
    if qtype in (T.Q5_0, T.Q5_1):  # d (, m), qh: bit j is element j's fifth bit, then nibbles
        start = 2 if qtype == T.Q5_0 else 4
        qh = blocks[:, start : start + 4].copy().view("<u4").astype(np.int64)  # [n, 1]
        qs = b[:, start + 4 :]
        high = (qh >> np.arange(32)) & 1
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1) | (high << 4)
        d = _f16(blocks, 0)[:, None]
        return d * (q - 16) if qtype == T.Q5_0 else d * q + _f16(blocks, 2)[:, None]
    if qtype in (T.Q4_K, T.Q5_K):  # d, dmin, 12 bytes of 6-bit scales/mins, [qh 32,] qs 128
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        scales = blocks[:, 4:16]
        qh = b[:, 16:48] if qtype == T.Q5_K else None
        qs = b[:, 48:] if qtype == T.Q5_K else b[:, 16:]
        out = np.empty((n, 256))
        for chunk in range(4):  # 64 weights: 32 low nibbles then 32 high nibbles of 32 bytes
            q = qs[:, 32 * chunk : 32 * chunk + 32]
            for half, nib in ((0, q & 0xF), (1, q >> 4)):
                j = 2 * chunk + half
                sc, m = _k_scale_min(scales, j)
                if qh is not None:
                    nib = nib + 16 * ((qh >> j) & 1)
                out[:, 32 * j : 32 * j + 32] = (d * sc)[:, None] * nib - (dmin * m)[:, None]
        return out
    if qtype == T.Q6_K:  # ql 128, qh 64, int8 scales 16, d: 6-bit q - 32, 16 weights a scale
        ql, qh = b[:, :128], b[:, 128:192]
        sc = blocks[:, 192:208].view(np.int8).astype(np.float64)
        d = _f16(blocks, 208)
        out = np.empty((n, 256))
        for h in range(2):  # two halves of 128 weights
            lo, hi, s = ql[:, 64 * h : 64 * h + 64], qh[:, 32 * h : 32 * h + 32], sc[:, 8 * h : 8 * h + 8]
            for k, (bits, shift) in enumerate(
                ((lo[:, :32] & 0xF, 0), (lo[:, 32:] & 0xF, 2), (lo[:, :32] >> 4, 4), (lo[:, 32:] >> 4, 6))
            ):
                q = (bits | (((hi >> shift) & 3) << 4)) - 32
                for l16 in range(2):
                    cols = slice(128 * h + 32 * k + 16 * l16, 128 * h + 32 * k + 16 * l16 + 16)
                    out[:, cols] = (d * s[:, 2 * k + l16])[:, None] * q[:, 16 * l16 : 16 * l16 + 16]
        return out
    if qtype == T.Q2_K:  # scales 16 (low nibble scale, high nibble min), qs 64 (2 bits), d, dmin
        scales, qs = b[:, :16], b[:, 16:80]
        d, dmin = _f16(blocks, 80), _f16(blocks, 82)
        out = np.empty((n, 256))
        for h in range(2):
            q = qs[:, 32 * h : 32 * h + 32]
            for shift in range(4):
                for l16 in range(2):
                    s = scales[:, 8 * h + 2 * shift + l16]
                    vals = (q[:, 16 * l16 : 16 * l16 + 16] >> (2 * shift)) & 3
                    start = 128 * h + 32 * shift + 16 * l16
                    out[:, start : start + 16] = (d * (s & 0xF))[:, None] * vals - (dmin * (s >> 4))[:, None]
        return out
    if qtype == T.Q3_K:  # hmask 32, qs 64 (2 bits), 12 bytes of 16 6-bit scales, d; 16 weights a scale
        hmask, qs = b[:, :32], b[:, 32:96]
        aux = blocks[:, 96:108].copy().view("<u4").astype(np.int64)  # [n, 3]: ggml's kmask unpacking
        k1, k2 = 0x03030303, 0x0F0F0F0F
        words = [
            (aux[:, 0] & k2) | (((aux[:, 2] >> 0) & k1) << 4),
            (aux[:, 1] & k2) | (((aux[:, 2] >> 2) & k1) << 4),
            ((aux[:, 0] >> 4) & k2) | (((aux[:, 2] >> 4) & k1) << 4),
            ((aux[:, 1] >> 4) & k2) | (((aux[:, 2] >> 6) & k1) << 4),
        ]
        scales = np.stack(words, axis=1).astype("<u4").view(np.int8).astype(np.float64) - 32  # [n, 16]
        d = _f16(blocks, 108)
        out = np.empty((n, 256))
        s = 0
        for h in range(2):  # 128 weights per 32 bytes of qs
            q = qs[:, 32 * h : 32 * h + 32]
            for shift in range(4):
                bit = 4 * h + shift  # bit of hmask: one per 32 weights
                for l16 in range(2):
                    low = (q[:, 16 * l16 : 16 * l16 + 16] >> (2 * shift)) & 3
                    high = (hmask[:, 16 * l16 : 16 * l16 + 16] >> bit) & 1
                    start = 128 * h + 32 * shift + 16 * l16
                    out[:, start : start + 16] = (d * scales[:, s])[:, None] * (low - 4 * (1 - high))
                    s += 1
        return out
    raise AssertionError(qtype)


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks `[rows, cols // block_size * type_size]`: random bytes with every float16
    scale field set to a finite value."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    scale_fields = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q2_K: (80, 82)}[qtype]
    for offset in scale_fields:
        scales = rng.uniform(-0.05, 0.05, size=len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


class DequantizeTest(unittest.TestCase):
    """Each type written by GGUFWriter, read back by GGUFCheckpoint, against reference_dequantize."""

    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.root = Path(self._tmp.name)
        self.rng = np.random.default_rng(0)

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def read(
        self, name: str, array: np.ndarray, qtype: GGMLQuantizationType, dtype: str = "float64"
    ) -> tuple[np.ndarray, GGUFCheckpoint]:
        path = write(self.root / f"{qtype.name}.gguf", "llama", lambda w: None, {name: (array, qtype)})
        ckpt = GGUFCheckpoint(path)
        hf = "model.layers.0.mlp.up_proj.weight"
        return ckpt.get(hf, dtype), ckpt

    def test_block_types_equal_the_float64_definition(self) -> None:
        rows, cols = 6, 512
        x = self.rng.standard_normal((rows, cols)).astype(np.float32)
        for qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q4_K, T.Q5_K, T.Q6_K):
            with self.subTest(qtype=qtype.name):
                quantized = qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
                if quantized:
                    from gguf.quants import quantize

                    blocks = quantize(x, qtype)
                else:  # the library writes no K-quants: random blocks with finite scales
                    blocks = random_blocks(qtype, rows, cols, self.rng)
                got, ckpt = self.read("blk.0.ffn_up.weight", blocks, qtype)
                block_size, type_size = GGML_QUANT_SIZES[qtype]
                want = reference_dequantize(blocks.reshape(-1, type_size), qtype).reshape(rows, cols)
                self.assertEqual(got.shape, (rows, cols))
                # the library computes in float32: equal to float32 rounding of the terms
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
                if quantized:  # and the weights are near the originals (the format's resolution)
                    step = {T.Q8_0: 1 / 127, T.Q4_0: 1 / 7, T.Q4_1: 1 / 15, T.Q5_0: 1 / 15, T.Q5_1: 1 / 31}[
                        qtype
                    ]
                    self.assertLess(np.abs(got - x).max(), 2 * step * np.abs(x).max())
                raw = ckpt.quantized("model.layers.0.mlp.up_proj.weight")
                self.assertEqual(
                    (raw.ggml_type, raw.shape, raw.block_size, raw.type_size),
                    (qtype.name, (rows, cols), block_size, type_size),
                )
                np.testing.assert_array_equal(raw.data, blocks.reshape(rows, -1))

    def test_float_types_read_exactly(self) -> None:
        x = self.rng.standard_normal((4, 64)).astype(np.float32)
        for qtype, stored in ((T.F32, x), (T.F16, x.astype(np.float16)), (T.BF16, None)):
            with self.subTest(qtype=qtype.name):
                if stored is None:  # BF16: the upper half of each float32, as bits; widened by << 16
                    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
                    got, _ = self.read("blk.0.ffn_up.weight", bits.view(np.uint8).reshape(4, -1), qtype)
                    want = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
                else:
                    got, _ = self.read("blk.0.ffn_up.weight", stored, qtype)
                    want = stored.astype(np.float64)
                np.testing.assert_array_equal(got, want)


class RowOrderTest(unittest.TestCase):
    def test_unpermute_undoes_the_converters_permutation_and_follows_the_formula(self) -> None:
        heads, d = 3, 8
        hf = np.arange(heads * d)
        gguf = llama_cpp_permute(hf, heads)
        for h in range(heads):
            for i in range(d // 2):
                for j in range(2):  # GGUF row h*D + 2i + j holds Hugging Face row h*D + j*D/2 + i
                    self.assertEqual(gguf[h * d + 2 * i + j], h * d + j * d // 2 + i)
        np.testing.assert_array_equal(unpermute_rows(gguf, heads), hf)
        blocks = np.arange(heads * d * 5, dtype=np.uint8).reshape(heads * d, 5)  # whole rows of bytes
        np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(blocks, heads), heads), blocks)
        with self.assertRaises(ValueError):
            unpermute_rows(np.zeros(9), 2)


class ConvertedCheckpointTest(unittest.TestCase):
    """A make-model checkpoint and its GGUF conversion load to the same model and tokenizer."""

    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        cls.root = Path(cls._tmp.name)
        cls.folders = {
            a: write_random_checkpoint(cls.root / a, a, "tiny", seed=5) for a in ("llama", "qwen2", "qwen3")
        }
        cls.files = {a: gguf_from_checkpoint(f, cls.root / f"{a}.gguf") for a, f in cls.folders.items()}

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def test_every_tensor_equals_the_folders_in_hugging_face_order(self) -> None:
        from attention_kv_caceh.model_executor.checkpoint import SafetensorsCheckpoint

        for arch in self.folders:
            with self.subTest(arch=arch):
                hf, gguf = SafetensorsCheckpoint(self.folders[arch]), GGUFCheckpoint(self.files[arch])
                self.assertEqual(gguf.names, hf.names)
                for name in hf.names:
                    self.assertEqual(gguf.shape(name), hf.shape(name), name)
                    np.testing.assert_array_equal(gguf.get(name, np.float32), hf.get(name, np.float32), name)

    def test_quantized_blocks_come_out_in_hugging_face_row_order(self) -> None:
        from attention_kv_caceh.model_executor.checkpoint import SafetensorsCheckpoint

        q8 = GGUFCheckpoint(gguf_from_checkpoint(self.folders["llama"], self.root / "llama-q8.gguf", T.Q8_0))
        hf = SafetensorsCheckpoint(self.folders["llama"])
        for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
            with self.subTest(name=name):
                raw = q8.quantized(name)
                self.assertEqual(
                    (raw.ggml_type, raw.shape, raw.data.dtype), ("Q8_0", hf.shape(name), np.uint8)
                )
                blocks = reference_dequantize(raw.data.reshape(-1, raw.type_size), T.Q8_0).reshape(raw.shape)
                np.testing.assert_allclose(q8.get(name, np.float64), blocks, rtol=1e-6)
                want = hf.get(name, np.float64)
                self.assertLess(np.abs(blocks - want).max(), np.abs(want).max() / 127)  # Q8_0's resolution

    def test_greedy_tokens_equal_the_folders(self) -> None:
        from attention_kv_caceh.engine.config import EngineConfig
        from attention_kv_caceh.engine.llm_engine import LLMEngine
        from attention_kv_caceh.engine.request import SamplingParams

        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for arch in self.folders:
            with self.subTest(arch=arch):
                outputs = []
                for path in (self.folders[arch], self.files[arch]):
                    engine = LLMEngine.from_pretrained(
                        str(path), EngineConfig(dtype="float64", num_kv_blocks=32)
                    )
                    tok = Tokenizer.load(path)
                    outputs.append(
                        engine.generate([tok.encode(p) for p in ("the cache", "a key and a value")], params)
                    )
                self.assertEqual(outputs[0], outputs[1])
                self.assertEqual([len(o) for o in outputs[1]], [6, 6])

    def test_config_from_metadata_equals_config_json(self) -> None:
        for arch in self.folders:
            with self.subTest(arch=arch):
                _, want = load_model_config(self.folders[arch])
                source, got = load_model_config(self.files[arch])
                self.assertEqual(source.format, "gguf")
                # GGUF stores float metadata as float32
                f32 = {k: float(np.float32(getattr(want, k))) for k in ("rms_norm_eps", "rope_theta")}
                self.assertEqual(got, dataclasses.replace(want, **f32))

    def test_the_tokenizer_and_chat_template_equal_the_folders(self) -> None:
        texts = ["the cache", "Once upon a time, 12 keys  and\nvalues!", "<|end_of_text|>x", "naïve café"]
        for arch in self.folders:
            with self.subTest(arch=arch):
                hf, gguf = Tokenizer.load(self.folders[arch]), Tokenizer.load(self.files[arch])
                self.assertEqual(gguf.eos_token_id, hf.eos_token_id)
                if arch == "llama":  # Qwen's tokenizer_config names no BOS; its GGUF file has config.json's
                    self.assertEqual(gguf.bos_token_id, hf.bos_token_id)
                for text in texts:
                    ids = hf.encode(text)
                    self.assertEqual(gguf.encode(text), ids, text)
                    self.assertEqual(gguf.decode(ids), hf.decode(ids))
                messages = [{"role": "user", "content": "hi"}]
                want = load_chat_template(self.folders[arch])
                got = load_chat_template(self.files[arch])
                assert want is not None and got is not None
                self.assertEqual(got.render(messages), want.render(messages))


if __name__ == "__main__":
    unittest.main()
