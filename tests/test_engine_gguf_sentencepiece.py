"""The SentencePiece tokenizer a GGUF file describes (`tokenizer.ggml.model = "llama"`), built by
model_executor/gguf_sentencepiece.py.

Golden ids: transformers 5.24.0's `AutoTokenizer.from_pretrained(folder, gguf_file="sp.gguf")` on the
tiny vocabulary of tests/gguf_files.py (`write_sentencepiece`), taken from the output of
`scripts/check_gguf_sentencepiece.py --transformers-python <a venv with transformers, torch 2.13.0,
sentencepiece, gguf>`, which re-checks them (and the add_bos / add_eos / add_space_prefix settings) against
transformers. Invariants: decode(encode(x)) == x for any text (byte fallback covers every character; a text that
starts with a space loses that one space, as in transformers),
streaming deltas concatenate to the whole decode, token_bytes concatenate to the text's UTF-8.
"""

from __future__ import annotations

import random
import tempfile
import unittest
from pathlib import Path

from attention_kv_caceh.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from attention_kv_caceh.model_executor.gguf_sentencepiece import sentencepiece_merges
from tests.gguf_files import SP_PIECES, sentencepiece_tokens, write_sentencepiece

# text -> ids (BOS added) from transformers 5.24.0 on write_sentencepiece's default file
# fmt: off
GOLDEN: dict[str, list[int]] = {
    'hello world': [1, 263, 275, 262, 264, 265, 270],
    'Hello World': [1, 274, 75, 275, 262, 274, 90, 265, 270],
    ' hello  world ': [1, 263, 275, 262, 274, 264, 265, 270, 274],
    '   three leading spaces': [1, 271, 274, 268, 280, 275, 275, 274, 277, 275, 288, 281, 290, 289, 106, 274, 291, 115, 288, 102, 275, 291],
    'the world\nhello\n\nworld\r\n': [1, 261, 264, 265, 270, 13, 266, 262, 13, 13, 279, 265, 270, 16, 13],
    'tab\tthe': [1, 269, 288, 101, 12, 282, 266],
    '12 123 31 2024': [1, 274, 272, 274, 272, 285, 274, 285, 283, 274, 284, 51, 284, 55],
    '日本 日本語': [1, 274, 273, 274, 273, 235, 173, 161],
    'emoji 😀👍🏽 done': [1, 274, 275, 112, 278, 109, 290, 274, 243, 162, 155, 131, 243, 162, 148, 144, 243, 162, 146, 192, 274, 281, 278, 289, 275],
    'ünïcödé café': [1, 274, 198, 191, 289, 198, 178, 102, 198, 185, 281, 198, 172, 274, 102, 288, 105, 198, 172],
    'control \x00\x01 bytes': [1, 274, 102, 278, 289, 282, 280, 278, 277, 274, 3, 4, 274, 101, 124, 282, 275, 291],
    '<s>hello</s>': [1, 1, 266, 262, 2],
    '<unk> hello': [1, 0, 263, 275, 262],
    '<|tool|>hello<|end|>': [1, 292, 266, 262, 293],
    'hello<|tool|> world': [1, 263, 275, 262, 292, 264, 265, 270],
    '': [1],
    ' ': [1, 274],
    '\n': [1, 274, 13],
}
# fmt: on
_SPECIAL_TEXT = ("<s>", "</s>", "<unk>", "<|end|>")
# a literal "▁" is left out: SentencePiece reads it as a space, so it decodes to one
_POOL = "ab hello world the 12 3 \n\n\t  日本語 😀👍🏽 ünï e\u0301 \x00\x7f <|tool|> \r"


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_POOL) for _ in range(rng.randrange(0, 40))) for _ in range(n)]


class SentencePieceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        root = Path(cls._tmp.name)
        cls.files = {
            name: write_sentencepiece(root / f"{name}.gguf", **flags)
            for name, flags in {
                "default": {},
                "no-bos": {"add_bos_token": False},
                "eos": {"add_eos_token": True},
                "no-prefix": {"add_space_prefix": False},
            }.items()
        }
        cls.tok = Tokenizer.load(cls.files["default"])

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def test_ids_equal_transformers(self) -> None:
        for text, ids in GOLDEN.items():
            with self.subTest(text=text):
                self.assertEqual(self.tok.encode(text), ids)
                self.assertEqual(self.tok.encode(text, add_special_tokens=False), ids[1:])

    def test_add_bos_and_add_eos_flags(self) -> None:
        no_bos, eos = Tokenizer.load(self.files["no-bos"]), Tokenizer.load(self.files["eos"])
        for text, ids in GOLDEN.items():
            with self.subTest(text=text):
                self.assertEqual(no_bos.encode(text), ids[1:])
                self.assertEqual(eos.encode(text), [*ids, 2])

    def test_no_space_prefix_as_llama_cpp(self) -> None:
        tok = Tokenizer.load(self.files["no-prefix"])
        # without the prefix "hello" starts with "he" (266), not "▁h" (263); a leading space stays one "▁"
        self.assertEqual(tok.encode("hello world"), [1, 266, 262, 264, 265, 270])
        self.assertEqual(tok.encode(" hello"), [1, 263, 275, 262])
        for text in random_texts(200, seed=3):
            with self.subTest(text=text):
                self.assertEqual(tok.decode(tok.encode(text)), text)

    def test_decode_round_trips_any_text(self) -> None:
        texts = [t for t in GOLDEN if not any(s in t for s in _SPECIAL_TEXT)] + random_texts(300)
        for text in texts:
            with self.subTest(text=text):
                ids = self.tok.encode(text)
                # a text that starts with a space gets no second "▁" (Metaspace prepends only where
                # none is), and the decoder strips one space: that text loses it, as in transformers
                self.assertEqual(self.tok.decode(ids), text[1:] if text.startswith(" ") else text)
                plain = self.tok.encode(text, add_special_tokens=False)
                got = b"".join(self.tok.token_bytes(i) for i in plain)
                if "<|tool|>" not in text:  # else the prefix space follows the added token's rules
                    prefixed = text if text.startswith(" ") else " " + text
                    self.assertEqual(got, prefixed.encode("utf-8") if text else b"")

    def test_streaming_deltas_concatenate_to_the_decode(self) -> None:
        for text in random_texts(100, seed=1):
            ids = self.tok.encode(text, add_special_tokens=False)
            detok = IncrementalDetokenizer(self.tok)
            streamed = "".join(detok.add([i]) for i in ids) + detok.flush()
            self.assertEqual(streamed, self.tok.decode(ids), text)

    def test_special_tokens_and_chat_template(self) -> None:
        self.assertEqual((self.tok.bos_token_id, self.tok.eos_token_id), (1, 2))
        self.assertEqual(self.tok.decode([1, 266, 262, 293, 2]), "hello")  # specials skipped
        self.assertIn("<|end|>", self.tok.chat_template or "")

    def test_merges_rank_by_score_then_part_lengths(self) -> None:
        tokens, scores, _ = sentencepiece_tokens()
        merges = sentencepiece_merges(tokens, scores)
        rank = {pair: i for i, pair in enumerate(merges)}
        # every piece of two or more characters that splits into two pieces has a merge
        for piece in SP_PIECES:
            splits = [(piece[:i], piece[i:]) for i in range(1, len(piece))]
            self.assertEqual(
                [s for s in splits if s in rank], [s for s in splits if s[0] in tokens and s[1] in tokens]
            )
        # "▁w" (score -5) before "or" (-6); "llo" (-3): the split "l"+"lo" is no merge ("lo" is no piece)
        self.assertLess(rank[("▁", "w")], rank[("o", "r")])
        self.assertEqual([p for p in merges if "".join(p) == "llo"], [("ll", "o")])
        # equal scores: the longer left part first
        self.assertEqual(
            sentencepiece_merges(["a", "b", "c", "ab", "bc", "abc"], [0, 0, 0, -1, -1, -2])[-2:],
            [("ab", "c"), ("a", "bc")],
        )


if __name__ == "__main__":
    unittest.main()
