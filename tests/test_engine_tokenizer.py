"""Tokenizer wrapper and incremental detokenization, on the locally trained tokenizers of make_model."""

from __future__ import annotations

import json
import tempfile
import unittest
from pathlib import Path

from attention_kv_caceh.engine.checkpoint import CheckpointError
from attention_kv_caceh.engine.make_model import write_random_checkpoint
from attention_kv_caceh.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "The keeper wrote: café, naïve, 日本, ☃ — and the lamp turned."


class TestTokenizer(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        root = Path(cls._tmp.name)
        cls.llama = write_random_checkpoint(root / "llama", "llama", "tiny")
        cls.qwen = write_random_checkpoint(root / "qwen", "qwen3", "tiny")

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def test_encode_decode_round_trips_unicode_text(self) -> None:
        for folder in (self.llama, self.qwen):
            tok = Tokenizer.load(folder)
            ids = tok.encode(TEXT)
            self.assertEqual(tok.decode(ids), TEXT)
            self.assertLess(
                len(tok.encode("the lighthouse keeper", add_special_tokens=False)),
                len("the lighthouse keeper"),
            )

    def test_max_length_gives_the_first_ids_of_the_whole_encoding(self) -> None:
        long_text = TEXT * 40
        for folder in (self.llama, self.qwen):
            tok = Tokenizer.load(folder)
            whole = tok.encode(long_text)
            for n in (1, 7, len(whole) - 1, len(whole), len(whole) + 5):
                self.assertEqual(tok.encode(long_text, max_length=n), whole[:n])
            chat = tok.encode(long_text, add_special_tokens=False)
            self.assertEqual(tok.encode(long_text, add_special_tokens=False, max_length=9), chat[:9])
            with self.assertRaises(ValueError):
                tok.encode(long_text, max_length=0)

    def test_encode_counted_cuts_the_ids_and_counts_every_token_of_the_whole_text(self) -> None:
        long_text = TEXT * 40
        for folder in (self.llama, self.qwen):
            tok = Tokenizer.load(folder)
            for special in (True, False):
                whole = tok.encode(long_text, add_special_tokens=special)
                for n in (None, 1, len(whole) - 1, len(whole), len(whole) + 5):
                    ids, count = tok.encode_counted(long_text, add_special_tokens=special, max_length=n)
                    self.assertEqual((ids, count), (whole[:n], len(whole)))
            with self.assertRaises(ValueError):
                tok.encode_counted(long_text, max_length=0)

    def test_special_tokens_match_config_json(self) -> None:
        for folder in (self.llama, self.qwen):
            tok = Tokenizer.load(folder)
            config = json.loads((folder / "config.json").read_text())
            self.assertEqual(tok.eos_token_id, config["eos_token_id"])
            self.assertIsNotNone(tok.chat_template)
        llama = Tokenizer.load(self.llama)
        self.assertEqual(llama.encode("hi")[0], llama.bos_token_id)  # Llama prepends its BOS
        self.assertIsNone(Tokenizer.load(self.qwen).bos_token_id)

    def test_incremental_deltas_concatenate_to_the_full_decode_without_replacement_characters(self) -> None:
        tok = Tokenizer.load(self.qwen)
        ids = tok.encode(TEXT)
        detok = IncrementalDetokenizer(tok)
        deltas = [detok.add([i]) for i in ids]
        deltas.append(detok.flush())
        self.assertEqual("".join(deltas), TEXT)
        self.assertFalse(any("\ufffd" in d for d in deltas))
        self.assertIn("", deltas[:-1])  # some multi-byte character was held back for a later token

    def test_each_step_decodes_a_short_window_not_the_whole_output(self) -> None:
        tok = Tokenizer.load(self.llama)
        text = " ".join([TEXT] * 8)
        ids = tok.encode(text, add_special_tokens=False)
        windows: list[int] = []

        class Counting:
            def decode(self, token_ids: list[int], /) -> str:
                windows.append(len(token_ids))
                return tok.decode(token_ids)

        detok = IncrementalDetokenizer(Counting())
        deltas = [detok.add([i]) for i in ids] + [detok.flush()]
        self.assertEqual("".join(deltas), text)
        self.assertGreater(len(ids), 100)
        self.assertLessEqual(max(windows), 8)  # a character spans at most a few byte-level tokens

    def test_missing_tokenizer_json_is_a_checkpoint_error(self) -> None:
        with (
            tempfile.TemporaryDirectory() as empty,
            self.assertRaisesRegex(CheckpointError, r"tokenizer\.json: file not found"),
        ):
            Tokenizer.load(empty)


if __name__ == "__main__":
    unittest.main()
