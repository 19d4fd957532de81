"""A GGUF model split over several files (llama.cpp's gguf-split layout, model_executor/gguf_split.py): read as
one model from its first part or its folder, the same tensors and greedy tokens as the unsplit file; a
missing, misnumbered or inconsistent part refused by name."""

from __future__ import annotations

import contextlib
import io
import shutil
import tempfile
import unittest
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from attention_kv_caceh import cli
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.model_executor.checkpoint import CheckpointError
from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint
from attention_kv_caceh.model_executor.gguf_config import model_config_from_gguf
from attention_kv_caceh.model_executor.model_source import resolve_model
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint
from tests.gguf_files import gguf_from_checkpoint, split_gguf

T = GGMLQuantizationType


class SplitTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        cls.root = Path(cls._tmp.name)
        folder = write_random_checkpoint(cls.root / "hf", "llama", "tiny", seed=7)
        cls.whole = gguf_from_checkpoint(folder, cls.root / "whole.gguf", T.Q8_0)
        (cls.root / "split").mkdir()
        cls.parts = split_gguf(cls.whole, cls.root / "split" / "model", 3)

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def copy_parts(self, name: str) -> list[Path]:
        folder = self.root / name
        folder.mkdir()
        return [Path(shutil.copy(p, folder / p.name)) for p in self.parts]

    def test_the_parts_hold_the_tensors_of_the_whole(self) -> None:
        whole, split = GGUFCheckpoint(self.whole), GGUFCheckpoint(self.parts[0])
        self.assertEqual(len(split.parts), 3)
        self.assertTrue(all(part.tensors for part in split.parts))  # spread over every part
        self.assertEqual(split.names, whole.names)
        self.assertEqual(model_config_from_gguf(split), model_config_from_gguf(whole))
        for name in whole.names:
            self.assertEqual(split.quantized(name).data.tobytes(), whole.quantized(name).data.tobytes(), name)

    def test_first_part_and_folder_resolve_to_the_first_part(self) -> None:
        self.assertEqual(resolve_model(self.root / "split").path, self.parts[0])
        self.assertEqual(resolve_model(self.parts[0]).path, self.parts[0])

    def test_greedy_tokens_equal_the_unsplit_file(self) -> None:
        from attention_kv_caceh.engine.config import EngineConfig
        from attention_kv_caceh.engine.llm_engine import LLMEngine
        from attention_kv_caceh.engine.request import SamplingParams

        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outputs = []
        for path in (self.whole, self.parts[0], self.root / "split"):
            engine = LLMEngine.from_pretrained(str(path), EngineConfig(dtype="float64", num_kv_blocks=32))
            tok = Tokenizer.load(path)
            outputs.append(
                engine.generate([tok.encode(p) for p in ("the cache", "a key and a value")], params)
            )
        self.assertEqual(outputs[1], outputs[0])
        self.assertEqual(outputs[2], outputs[0])
        self.assertEqual([len(o) for o in outputs[0]], [6, 6])

    def test_a_first_part_without_tensors(self) -> None:
        (self.root / "empty-first").mkdir()
        parts = split_gguf(self.whole, self.root / "empty-first" / "m", 3, first_without_tensors=True)
        self.assertEqual(GGUFCheckpoint(parts[0]).names, GGUFCheckpoint(self.whole).names)

    def test_a_missing_part_is_refused_by_name(self) -> None:
        parts = self.copy_parts("missing")
        parts[2].unlink()
        with self.assertRaises(CheckpointError) as caught:
            GGUFCheckpoint(parts[0])
        self.assertIn(str(parts[2]), str(caught.exception))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["generate", "--model", str(parts[0]), "--prompt", "a", "--max-tokens", "2"])
        self.assertEqual((code, out.getvalue()), (2, ""))
        self.assertEqual(len(err.getvalue().splitlines()), 1, err.getvalue())
        self.assertIn(parts[2].name, err.getvalue())

    def test_a_folder_missing_a_part_names_that_part(self) -> None:
        for missing in (1, 0):  # part 2 of 3, then part 1 of 3
            with self.subTest(missing=missing + 1):
                parts = self.copy_parts(f"folder-missing-{missing + 1}")
                parts[missing].unlink()
                out, err = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    code = cli.main(
                        ["generate", "--model", str(parts[0].parent), "--prompt", "a", "--max-tokens", "2"]
                    )
                self.assertEqual((code, out.getvalue()), (2, ""))
                self.assertEqual(len(err.getvalue().splitlines()), 1, err.getvalue())
                self.assertIn(parts[missing].name, err.getvalue())

    def test_a_later_part_given_first_is_refused_naming_the_first(self) -> None:
        with self.assertRaises(CheckpointError) as caught:
            GGUFCheckpoint(self.parts[1])
        self.assertIn(self.parts[0].name, str(caught.exception))

    def test_inconsistent_parts_are_refused(self) -> None:
        parts = self.copy_parts("swapped")
        # part 3's file holds part 2: its split.no disagrees with its name
        shutil.copy(self.parts[1], parts[2])
        with self.assertRaises(CheckpointError) as caught:
            GGUFCheckpoint(parts[0])
        self.assertIn(str(parts[2]), str(caught.exception))
        self.assertIn("split.no", str(caught.exception))
        # a part that repeats a tensor of another part
        dup = self.copy_parts("dup")
        shutil.copy(self.parts[1], dup[2])
        writer = GGUFWriter(str(dup[2]), "llama")
        del writer.kv_data[0]["general.architecture"]
        writer.add_key_value("split.no", 2, GGUFValueType.UINT16)
        writer.add_key_value("split.count", 3, GGUFValueType.UINT16)
        writer.add_key_value("split.tensors.count", 0, GGUFValueType.INT32)
        first = GGUFCheckpoint(self.parts[0]).parts[0].tensors[0]
        writer.add_tensor(first.name, np.asarray(first.data), raw_dtype=first.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with self.assertRaises(CheckpointError) as caught:
            GGUFCheckpoint(dup[0])
        self.assertIn(repr(first.name), str(caught.exception))

    def test_a_tensor_count_that_disagrees(self) -> None:
        (self.root / "count").mkdir()
        parts = split_gguf(self.whole, self.root / "count" / "m", 2)
        data = bytearray(parts[0].read_bytes())
        key = b"split.tensors.count"
        at = data.index(key) + len(key) + 4  # after the key's name and its type
        total = int.from_bytes(data[at : at + 4], "little")
        data[at : at + 4] = (total + 1).to_bytes(4, "little")
        parts[0].write_bytes(bytes(data))
        with self.assertRaises(CheckpointError) as caught:
            GGUFCheckpoint(parts[0])
        self.assertIn(str(total + 1), str(caught.exception))


if __name__ == "__main__":
    unittest.main()
