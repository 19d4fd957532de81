"""Checkpoint loading: dtypes on disk, shards, tied embeddings, the random-checkpoint writer, clear errors."""

from __future__ import annotations

import json
import os
import stat
import tempfile
import unittest
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from attention_kv_caceh.model_executor.checkpoint import (
    CheckpointError,
    SafetensorsCheckpoint,
    widen_bfloat16,
)
from attention_kv_caceh.model_executor.layers import rope_inv_freq
from attention_kv_caceh.model_executor.model import Model, ModelConfig
from attention_kv_caceh.toy_model.make_model import bfloat16_bits, write_random_checkpoint


class CheckpointTestBase(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.root = Path(self._tmp.name)

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def write(self, name: str, arch: str = "llama", **kwargs: object) -> Path:
        return write_random_checkpoint(self.root / name, arch, "tiny", seed=3, **kwargs)  # type: ignore[arg-type]

    def edit_config(self, folder: Path, **changes: object) -> None:
        path = folder / "config.json"
        config = json.loads(path.read_text())
        config.update(changes)
        path.write_text(json.dumps(config))


class TestDtypes(CheckpointTestBase):
    def test_bfloat16_bits_round_to_nearest_even_and_widen_exactly(self) -> None:
        x = np.array([1.0, -2.5, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20], dtype=np.float32)
        bits = bfloat16_bits(x)
        # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even mantissa wins (1.0); 1 + 3 * 2^-8 ties up to 1 + 2^-6.
        want = np.array([1.0, -2.5, 1.0, 1 + 2**-6, 1 + 2**-7], dtype=np.float32)
        np.testing.assert_array_equal(widen_bfloat16(bits), want)
        self.assertEqual(int(bits[0]), 0x3F80)

    def test_bf16_and_fp16_checkpoints_load_widened_and_equal_the_rounded_fp32_weights(self) -> None:
        fp32 = SafetensorsCheckpoint(self.write("f32", "qwen2"))
        bf16 = SafetensorsCheckpoint(self.write("bf16", "qwen2", dtype="bfloat16"))
        fp16 = SafetensorsCheckpoint(self.write("f16", "qwen2", dtype="float16"))
        self.assertEqual(fp32.names, bf16.names)
        for name in fp32.names:
            w = fp32.get(name, np.float32)
            np.testing.assert_array_equal(bf16.get(name, np.float64), widen_bfloat16(bfloat16_bits(w)))
            np.testing.assert_array_equal(fp16.get(name, np.float32), w.astype(np.float16).astype(np.float32))
            np.testing.assert_allclose(bf16.get(name, np.float32), w, rtol=2**-8, atol=0)
        model = Model.load(self.root / "bf16", "float64")
        self.assertEqual(model.embed_tokens.dtype, np.float64)

    def test_sharded_checkpoint_loads_the_same_weights_as_one_file(self) -> None:
        one = Model.load(self.write("one", "qwen3"), "float32")
        sharded = self.write("sharded", "qwen3", max_shard_bytes=300_000)
        self.assertTrue((sharded / "model.safetensors.index.json").is_file())
        self.assertGreater(len(list(sharded.glob("model-*-of-*.safetensors"))), 2)
        two = Model.load(sharded, "float32")
        np.testing.assert_array_equal(one.layers[1].qkv_proj.dense(), two.layers[1].qkv_proj.dense())
        np.testing.assert_array_equal(one.lm_head.dense(), two.lm_head.dense())


class TestFilePermissions(CheckpointTestBase):
    def test_every_written_file_gets_the_umask_permissions_not_0600(self) -> None:
        old = os.umask(0o022)
        try:
            folders = [self.write("one"), self.write("sharded", max_shard_bytes=300_000)]
        finally:
            os.umask(old)
        for folder in folders:
            for file in folder.iterdir():
                with self.subTest(file=file.name):
                    self.assertEqual(stat.S_IMODE(file.stat().st_mode), 0o644)


class TestTiedEmbeddings(CheckpointTestBase):
    def test_tied_checkpoint_has_no_lm_head_and_uses_the_embedding_matrix(self) -> None:
        folder = self.write("tied", "llama", tie_word_embeddings=True)
        self.assertNotIn("lm_head.weight", load_file(folder / "model.safetensors"))
        model = Model.load(folder, "float64")
        self.assertIs(model.lm_head.weight, model.embed_tokens)  # the numpy path shares the array
        hidden = np.random.default_rng(0).standard_normal((2, 128))
        np.testing.assert_allclose(model.compute_logits(hidden), hidden @ model.embed_tokens.T)
        packed = Model.load(folder, "float32", "packed")  # a packed copy of the same matrix
        np.testing.assert_array_equal(packed.lm_head.dense(), packed.embed_tokens)

    def test_untied_checkpoint_reads_its_own_lm_head(self) -> None:
        folder = self.write("untied", "qwen3", tie_word_embeddings=False)
        tensors = load_file(folder / "model.safetensors")
        model = Model.load(folder, "float32")
        np.testing.assert_array_equal(model.lm_head.dense(), tensors["lm_head.weight"])
        self.assertFalse(np.array_equal(model.lm_head.dense(), model.embed_tokens))


class TestErrors(CheckpointTestBase):
    def test_missing_tensor_names_the_file_and_key(self) -> None:
        folder = self.write("m")
        tensors = load_file(folder / "model.safetensors")
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, folder / "model.safetensors")
        with self.assertRaisesRegex(
            CheckpointError, r"model\.safetensors: missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"
        ):
            Model.load(folder)

    def test_untied_config_without_lm_head_is_a_missing_tensor(self) -> None:
        folder = self.write("u", "qwen2")  # tied by default: no lm_head.weight on disk
        self.edit_config(folder, tie_word_embeddings=False)
        with self.assertRaisesRegex(CheckpointError, "missing tensor 'lm_head.weight'"):
            Model.load(folder)

    def test_wrong_shape_names_the_key_and_both_shapes(self) -> None:
        folder = self.write("s")
        self.edit_config(folder, intermediate_size=256)
        with self.assertRaisesRegex(
            CheckpointError,
            r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(384, 128\), expected \(256, 128\)",
        ):
            Model.load(folder)

    def test_a_truncated_or_corrupt_safetensors_file_is_a_checkpoint_error_naming_it(self) -> None:
        for size in (4, 100, 1_000_000 // 8, None):
            for dtype in ("float32", "bfloat16"):
                with self.subTest(size=size, dtype=dtype):
                    folder = self.write(f"t{size}{dtype}", dtype=dtype)
                    path = folder / "model.safetensors"
                    if size is None:  # the header parses, the data is cut short
                        size = path.stat().st_size - 8
                    if size >= path.stat().st_size:
                        continue
                    os.truncate(path, size)
                    with self.assertRaisesRegex(CheckpointError, r"model\.safetensors"):
                        Model.load(folder)
        folder = self.write("garbage")
        (folder / "model.safetensors").write_bytes(b"\xff" * 64)
        with self.assertRaisesRegex(CheckpointError, r"model\.safetensors: not a readable safetensors"):
            SafetensorsCheckpoint(folder)

    def test_a_config_int_of_the_wrong_type_names_its_key(self) -> None:
        keys = [
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
            "bos_token_id",
            "eos_token_id",
        ]
        folder = self.write("c")
        original = (folder / "config.json").read_text()
        for key in keys:
            for bad in ("two", 4.5, True, None if key in ("vocab_size", "hidden_size") else [1.5], {}):
                if bad is None:
                    continue
                with self.subTest(key=key, value=bad):
                    (folder / "config.json").write_text(original)
                    self.edit_config(folder, **{key: bad})
                    with self.assertRaisesRegex(CheckpointError, rf"config\.json: key '{key}'"):
                        Model.load(folder)
        (folder / "config.json").write_text(original)
        self.edit_config(folder, num_hidden_layers=2.0)  # JSON writers may spell an int as 2.0
        self.assertEqual(Model.load(folder).config.num_hidden_layers, 2)

    def test_unknown_architecture_names_config_json_and_the_key(self) -> None:
        folder = self.write("a")
        self.edit_config(folder, architectures=["GPT2LMHeadModel"])
        with self.assertRaisesRegex(CheckpointError, r"config\.json: key 'architectures': unsupported"):
            Model.load(folder)

    def test_unsupported_rope_scaling_is_refused_and_llama3_accepted(self) -> None:
        folder = self.write("r")
        self.edit_config(folder, rope_scaling={"rope_type": "yarn", "factor": 4.0})
        with self.assertRaisesRegex(CheckpointError, r"config\.json: key 'rope_scaling': rope type 'yarn'"):
            Model.load(folder)
        llama3 = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        self.edit_config(folder, rope_scaling=llama3)
        self.assertEqual(
            Model.load(folder).config.rope_scaling,
            {k: float(v) for k, v in llama3.items() if k != "rope_type"},
        )

    def test_missing_config_and_missing_weights_are_checkpoint_errors(self) -> None:
        with self.assertRaisesRegex(CheckpointError, r"config\.json: file not found"):
            Model.load(self.root)
        (self.root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        with self.assertRaisesRegex(CheckpointError, r"config\.json: key '\w+': missing"):
            Model.load(self.root)
        folder = self.write("w")
        (folder / "model.safetensors").unlink()
        with self.assertRaisesRegex(CheckpointError, r"model\.safetensors: file not found"):
            Model.load(folder)


class TestConfigAndRope(unittest.TestCase):
    def test_llama3_rope_scaling_divides_low_frequencies_and_keeps_high_ones(self) -> None:
        scaling = {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        plain = rope_inv_freq(128, 500000.0)
        scaled = rope_inv_freq(128, 500000.0, scaling)
        wavelen = 2 * np.pi / plain
        np.testing.assert_array_equal(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])
        np.testing.assert_allclose(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)
        band = (wavelen > 8192 / 4) & (wavelen < 8192)
        self.assertTrue(np.all((scaled[band] < plain[band]) & (scaled[band] > plain[band] / 8)))

    def test_hf_defaults_fill_kv_heads_and_head_dim(self) -> None:
        config = ModelConfig.from_hf_config(
            {
                "architectures": ["MistralForCausalLM"],
                "vocab_size": 10,
                "hidden_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "intermediate_size": 8,
                "eos_token_id": [2, 3],
                "sliding_window": None,
            }
        )
        self.assertEqual((config.num_key_value_heads, config.head_dim, config.eos_token_id), (4, 16, 2))

    def test_transformers_5_rope_parameters_give_rope_theta_and_the_scaling_type(self) -> None:
        # transformers >= 5 writes rope_theta inside `rope_parameters` instead of at the top level; a
        # checkpoint saved by transformers 5.24 gave other greedy tokens until this key was read.
        base: dict[str, object] = {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "intermediate_size": 8,
        }
        plain = ModelConfig.from_hf_config(
            {**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
        )
        self.assertEqual((plain.rope_theta, plain.rope_scaling), (5e5, None))
        self.assertEqual(ModelConfig.from_hf_config({**base, "rope_theta": 123.0}).rope_theta, 123.0)
        self.assertEqual(ModelConfig.from_hf_config(base).rope_theta, 10000.0)
        with self.assertRaisesRegex(CheckpointError, r"key 'rope_parameters': rope type 'yarn'"):
            ModelConfig.from_hf_config({**base, "rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn"}})


class TestMakeModel(CheckpointTestBase):
    def test_same_arguments_write_identical_files_and_another_seed_other_weights(self) -> None:
        a, b = self.write("a", "qwen3"), self.write("b", "qwen3")
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            self.assertEqual((a / name).read_bytes(), (b / name).read_bytes(), name)
        c = write_random_checkpoint(self.root / "c", "qwen3", "tiny", seed=4)
        self.assertNotEqual((a / "model.safetensors").read_bytes(), (c / "model.safetensors").read_bytes())

    def test_config_json_has_the_hugging_face_keys(self) -> None:
        config = json.loads((self.write("k", "qwen2", dtype="bfloat16") / "config.json").read_text())
        self.assertEqual(config["architectures"], ["Qwen2ForCausalLM"])
        self.assertEqual((config["model_type"], config["torch_dtype"]), ("qwen2", "bfloat16"))
        self.assertEqual((config["head_dim"], config["num_key_value_heads"]), (32, 2))
        tensors = SafetensorsCheckpoint(self.root / "k").names
        self.assertIn("model.layers.0.self_attn.q_proj.bias", tensors)

    def test_bad_arguments_are_value_errors(self) -> None:
        for kwargs in ({"arch": "gpt2"}, {"preset": "huge"}, {"dtype": "int8"}):
            with self.subTest(**kwargs), self.assertRaises(ValueError):
                write_random_checkpoint(self.root / "x", **kwargs)  # type: ignore[arg-type]


if __name__ == "__main__":
    unittest.main()
