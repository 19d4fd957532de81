"""The Gemma 2, Gemma 3 and Phi-3 GGUF files: their metadata gives the folder's config, and what a Phi-3
file holds that the model does not implement is refused by key or tensor.

The files are the ones llama.cpp's converter would write for the tiny folders under tests/data
(tests/gguf_families.py); the greedy tokens they give are checked in tests/test_model_families.py.
Phi-3 files may also hold q/k/v apart (`attn_q` / `attn_k` / `attn_v`) and a fused `attn_qkv.bias`,
both of which llama.cpp's phi3 graph reads: the first gives transformers' tokens as the fused file
does, the second is the bias the model adds.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import unittest
from pathlib import Path
from typing import Any

import numpy as np

from attention_kv_caceh.model_executor.checkpoint import CheckpointError
from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint
from attention_kv_caceh.model_executor.gguf_config import model_config_from_gguf
from attention_kv_caceh.model_executor.model import Model
from attention_kv_caceh.model_executor.model_config import ModelConfig
from tests.gguf_families import family_gguf, phi3_gguf
from tests.test_engine_gguf_errors import generate
from tests.test_model_families import DATA, FAMILIES, reference, run_engine


class GGUFMetadataTest(unittest.TestCase):
    def test_the_file_gives_the_folders_config(self) -> None:
        for family in FAMILIES:
            with self.subTest(family=family), tempfile.TemporaryDirectory() as tmp:
                path = family_gguf(DATA / family, Path(tmp) / "model.gguf")
                from_file = model_config_from_gguf(GGUFCheckpoint(path))
                from_folder = ModelConfig.from_hf_config(
                    json.loads((DATA / family / "config.json").read_text())
                )
                # the file stores floats as float32 (rms_norm_eps 1e-6 comes back rounded)
                fields: dict[str, Any] = dataclasses.asdict(from_file)
                fields["eos_token_ids"] = from_folder.eos_token_ids
                for key, value in dataclasses.asdict(from_folder).items():
                    if isinstance(value, float):
                        self.assertAlmostEqual(float(fields[key]), value, delta=1e-7 * abs(value), msg=key)
                    else:
                        self.assertEqual(fields[key], value, msg=key)


class Phi3GGUFTest(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self._tmp.cleanup)
        self.folder = Path(self._tmp.name) / "phi3"  # run_engine finds the reference by folder name
        self.folder.mkdir()

    def write(self, name: str, **kwargs: Any) -> Path:
        return phi3_gguf(DATA / "phi3", self.folder / name, **kwargs)

    def test_q_k_v_stored_apart_give_transformers_tokens(self) -> None:
        path = self.write("apart.gguf", separate_qkv=True)
        names = GGUFCheckpoint(path).gguf_names
        self.assertIn("blk.0.attn_k.weight", names)
        self.assertNotIn("blk.0.attn_qkv.weight", names)
        ref = reference("phi3")
        together, again, _ = run_engine(path, "float64")
        self.assertEqual(together, ref["tokens"])
        self.assertEqual(again, ref["tokens"][1])

    def test_a_fused_qkv_bias_is_the_bias_the_model_adds(self) -> None:
        rng = np.random.default_rng(0)
        biases = [rng.standard_normal(128).astype(np.float32) for _ in range(3)]

        def add_bias(tensors: dict[str, np.ndarray]) -> None:
            for i, bias in enumerate(biases):
                tensors[f"model.layers.{i}.self_attn.qkv_proj.bias"] = bias

        model = Model.load(self.write("bias.gguf", edit=add_bias), "float64")
        self.assertTrue(model.config.qkv_bias)
        for layer, bias in zip(model.layers, biases, strict=True):
            assert layer.qkv_bias is not None
            np.testing.assert_array_equal(layer.qkv_bias, bias.astype(np.float64))

    def test_a_window_of_zero_is_no_window(self) -> None:
        # the converter writes 0 for a null sliding_window (Phi-4)
        config = model_config_from_gguf(GGUFCheckpoint(self.write("nowindow.gguf", sliding_window=None)))
        self.assertEqual((config.sliding_window, config.layer_types), (None, ()))

    def test_longrope_and_partial_rotary_are_refused_by_name(self) -> None:
        longrope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "long_factor": [2.0] * 16,  # one per rotated pair: head_dim 32 / 2
            "short_factor": [1.0] * 16,
            "original_max_position_embeddings": 128,
        }
        path = self.write("longrope.gguf", rope_parameters=longrope)
        with self.assertRaises(CheckpointError) as caught:
            model_config_from_gguf(GGUFCheckpoint(path))
        self.assertIn(f"{path}: tensor 'rope_factors_long.weight': LongRoPE", str(caught.exception))
        code, out, err = generate(path)  # one line, exit 2 (no warning about the ignored tensors)
        self.assertEqual((code, out, len(err.splitlines())), (2, "", 1), err)
        self.assertIn("'rope_factors_long.weight': LongRoPE", err)
        partial = {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        path = self.write("partial.gguf", rope_parameters=partial)
        with self.assertRaises(CheckpointError) as caught:
            model_config_from_gguf(GGUFCheckpoint(path))
        self.assertIn(f"{path}: key 'phi3.rope.dimension_count': RoPE over 16 of 32", str(caught.exception))


if __name__ == "__main__":
    unittest.main()
