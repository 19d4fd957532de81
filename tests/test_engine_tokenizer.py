"""Tokenizer wrapper and incremental detokenization, on the locally trained tokenizers of make_model."""

from __future__ import annotations

import json
import tempfile
import unittest
from pathlib import Path

from attention_kv_caceh.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from attention_kv_caceh.model_executor.checkpoint import CheckpointError
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint

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
                bound = tok.max_token_chars
                assert bound is not None
                for n in (None, 1, len(whole) - 1, len(whole), len(whole) + 5):
                    ids, count, exact = tok.encode_counted(
                        long_text, add_special_tokens=special, max_length=n
                    )
                    if n is None or len(long_text) <= n * bound:  # encoded whole: the exact count
                        self.assertEqual((ids, count, exact), (whole[:n], len(whole), True))
                    else:  # only the head is encoded: a lower bound, above n, never above the truth
                        self.assertFalse(exact)
                        self.assertEqual(ids, tok.encode(long_text[: n * bound], special, n))
                        self.assertEqual(count, -(-len(long_text) // bound))
                        self.assertTrue(n < count <= len(whole))
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


def _pipeline(kind: str) -> Tokenizer:
    """A small trained tokenizer of one pipeline kind: `llama3` (a Split regex then ByteLevel without its
    regex, as Llama 3's tokenizer.json has it, behind a BOS template), `metaspace` (SentencePiece-like),
    `whitespace` (WordPiece), `prepend` (Llama 2's normalizer, which a cut at a space changes)."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as HF

    corpus = [TEXT, "the cat sat on the mat", "a b  c   d", "x\ty\nz", "12345 678", "naïve café"] * 20
    if kind == "whitespace":
        hf = HF(models.WordPiece(unk_token="[UNK]"))
        hf.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer: trainers.Trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"])
    else:
        hf = HF(models.BPE(byte_fallback=kind != "llama3"))
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"])
        if kind == "llama3":
            split = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            hf.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
            hf.decoder = decoders.ByteLevel()
            trainer = trainers.BpeTrainer(
                vocab_size=400, special_tokens=["<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
            )
        elif kind == "metaspace":
            hf.pre_tokenizer = pre_tokenizers.Metaspace()
        else:  # prepend
            hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.train_from_iterator(corpus, trainer)
    if kind != "whitespace":
        hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return Tokenizer(hf, {})


class PiecesTest(unittest.TestCase):
    """A long text is encoded one piece at a time (bounded memory); the ids must be the whole text's."""

    def test_the_pieces_of_a_long_text_encode_to_the_whole_texts_ids(self) -> None:
        from unittest import mock

        from hypothesis import given, settings
        from hypothesis import strategies as st

        words = st.sampled_from(["the", "cat", "café", "12345", "x", ".", "'s", "日本", "--", "a-b", "(c)"])
        gaps = st.sampled_from([" ", "  ", "   ", "\t", "\n", " \n ", "", "\u00a0"])
        texts = st.lists(st.tuples(words, gaps), min_size=1, max_size=60).map(
            lambda parts: "".join(w + g for w, g in parts)
        )
        cut = [_pipeline(kind) for kind in ("llama3", "metaspace", "whitespace")]
        for tok in cut:
            self.assertIsNotNone(tok._specials)  # pyright: ignore[reportPrivateUsage]

        @settings(max_examples=150, deadline=None)
        @given(texts, st.integers(1, 12), st.booleans())
        def check(text: str, piece: int, specials: bool) -> None:
            for tok in cut:
                whole = tok._tok.encode(text, add_special_tokens=specials).ids  # pyright: ignore[reportPrivateUsage]
                with mock.patch("attention_kv_caceh.engine.tokenizer._PIECE_CHARS", piece):
                    self.assertEqual(tok.encode(text, add_special_tokens=specials), whole)
                    self.assertEqual([t for p in tok.encode_pieces(text, specials) for t in p], whole)
                    for n in (1, 3, len(whole) + 1):
                        self.assertEqual(tok.encode(text, specials, max_length=n), whole[:n])

        check()

    def test_no_token_covers_more_characters_than_the_bound(self) -> None:
        """The bound `encode(max_length=...)` relies on to stop reading a long text: every text has at
        least len(text) / max_token_chars tokens; a text past max_length of them is cut to its head."""
        from hypothesis import given, settings
        from hypothesis import strategies as st

        folder = write_random_checkpoint(Path(self._tmp()) / "m", "llama", "tiny")
        tok = Tokenizer.load(folder)
        bound = tok.max_token_chars
        assert bound is not None
        runs = st.sampled_from(["a" * 40, "the ", "  ", "日本語", "é", "\n", "12345", "....", "x"])
        texts = st.lists(runs, min_size=1, max_size=80).map("".join)

        @settings(max_examples=200, deadline=None)
        @given(texts)
        def check(text: str) -> None:
            ids = tok._tok.encode(text, add_special_tokens=False).ids  # pyright: ignore[reportPrivateUsage]
            self.assertGreaterEqual(len(ids) * bound, len(text))
            n = max(1, len(text) // bound - 1)
            if len(text) > n * bound:  # the head is read, and it has n tokens or more
                self.assertEqual(len(tok.encode(text, max_length=n)), n)

        check()
        self.assertIsNone(_pipeline("whitespace").max_token_chars)  # WordPiece's unknown word: no bound

    def test_composition_merges_at_most_max_composed_characters(self) -> None:
        import sys
        import unicodedata

        from attention_kv_caceh.engine.tokenizer import MAX_COMPOSED

        longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(sys.maxunicode + 1))
        self.assertEqual(longest, MAX_COMPOSED)

    def test_a_pipeline_a_cut_would_change_is_encoded_whole(self) -> None:
        tok = _pipeline("prepend")  # " b" alone becomes "▁▁b": a piece would differ from the text's ids
        self.assertIsNone(tok._specials)  # pyright: ignore[reportPrivateUsage]
        text = "a b " * 30000  # past one piece
        self.assertEqual(tok.encode(text), tok._tok.encode(text).ids)  # pyright: ignore[reportPrivateUsage]
        self.assertEqual(len(list(tok.encode_pieces(text))), 1)

    def test_a_huge_prompt_cut_at_max_length_costs_a_piece_not_the_body(self) -> None:
        """Peak RSS of a fresh process around `encode(8 MB, max_length=2048)`, and around the pieces of
        /tokenize's answer: the whole text's Encoding held ~1 GB here (about 200 bytes a token)."""
        import subprocess
        import sys

        folder = write_random_checkpoint(Path(self._tmp()) / "m", "llama", "tiny")
        script = f"""
import gc, resource
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.entrypoints.openai.serving_tokenization import tokenize_json
tok = Tokenizer.load({str(folder)!r})
text = ("hello world " * 700000)[:8_300_000]
word = "x" * 8_300_000  # no space anywhere: no piece to cut, but a head long enough to refuse
gc.collect()
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base = peak()
ids = tok.encode(text, max_length=2048)
assert len(tok.encode(word, max_length=2048)) == 2048
cut = peak() - base
answer = tokenize_json(tok.encode_pieces(text), 2048, None)
print(len(ids), cut, peak() - base, len(answer))
"""
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        self.assertEqual(out.returncode, 0, out.stderr)
        n, cut, whole, answer = (int(x) for x in out.stdout.split())
        self.assertEqual(n, 2048)
        self.assertLess(cut, 8_300_000)  # below the body's size
        self.assertLess(whole, 8_300_000 * 8)  # /tokenize's pieces: a small multiple (the answer is ~2x)
        self.assertGreater(answer, 8_300_000)

    def _tmp(self) -> str:
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        return tmp.name
