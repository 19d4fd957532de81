"""Tokenizer: a Hugging Face `tokenizer.json` (through the `tokenizers` library) plus `tokenizer_config.json`,
or the one a GGUF file's metadata describes (`gguf_tokenizer.py`).

What vLLM's `transformers_utils/tokenizer.py` and `v1/engine/detokenizer.py` do, for one local folder:
encode/decode with the fast tokenizer, read the eos/bos tokens and the chat template string from
tokenizer_config.json, and turn a growing list of output ids into text deltas for streaming. The chat
template string is kept here and rendered by the chat layer (`chat_utils.py`, with Jinja, as vLLM's
`entrypoints/chat_utils.py`). Left out: slow tokenizers, and the prompt tokens vLLM decodes as the first
window's context (deltas here start at the first output token).

A long text is encoded in pieces (`_PIECE_CHARS` characters, each cut just before a space that follows
a non-space), one piece at a time, when the tokenizer's pipeline splits words at such a space anyway
(`_cuts_at_spaces`): the ids are then exactly the whole text's, and the memory the `tokenizers` library
holds at once (its Encoding keeps about 200 bytes per token) is one piece's, not the body's. With
`max_length`, only that many ids are kept (`encode_counted` still counts the rest, piece by piece).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from attention_kv_caceh.model_executor.checkpoint import CheckpointError

__all__ = ["IncrementalDetokenizer", "TextDecoder", "Tokenizer"]

_PIECE_CHARS = 1 << 16  # characters per piece of a long text (a piece's Encoding: a few MB)
# Parts of a tokenizer.json pipeline that never join text across a space that follows a non-space, so a
# text cut just before such a space encodes as its two pieces do (see `_cuts_at_spaces`).
_SAFE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
_WORD_SPLITTERS = {
    "ByteLevel",
    "Metaspace",
    "Split",
    "Whitespace",
    "WhitespaceSplit",
}  # end a word at a space
_SAFE_PRE_TOKENIZERS = _WORD_SPLITTERS | {"ByteLevel-no-regex", "Punctuation", "Digits"}  # beside one

_BOUNDED_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
MAX_COMPOSED = 4
"""The most characters Unicode composition turns into one: the longest canonical decomposition (U+1F82
is alpha and three marks); a test checks it against `unicodedata`."""

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback piece
_REPLACEMENT = "\ufffd"  # what a decoder emits for bytes that are not (yet) a whole UTF-8 character


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...} (AddedToken)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):  # pyright: ignore[reportUnknownMemberType]
        return str(value["content"])  # pyright: ignore[reportUnknownArgumentType]
    return None


class Tokenizer:
    """Encode and decode text with a model folder's fast tokenizer.

    Attributes: eos_token_id / bos_token_id (None when the folder names no such token),
    chat_template (the Jinja string, or None), vocab_size (ids the tokenizer knows, special ones
    included; a model's vocab_size may be larger).
    """

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any]) -> None:
        self._tok = tokenizer
        self.eos_token = _token_content(config.get("eos_token"))
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token_id = None if self.eos_token is None else tokenizer.token_to_id(self.eos_token)
        self.bos_token_id = None if self.bos_token is None else tokenizer.token_to_id(self.bos_token)
        template = config.get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._specials = _cuts_at_spaces(tokenizer)  # None: long texts are encoded whole
        self.max_token_chars = _chars_per_token(tokenizer)
        model = tokenizer.model
        self._byte_fallback = isinstance(model, models.BPE) and model.byte_fallback  # SentencePiece-style

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Read `path/tokenizer.json` and, when present, `path/tokenizer_config.json`.

        `path` may also name a GGUF file (a `.gguf` file, a folder holding one, or a model name of
        `model_source.MODELS`): the tokenizer is then built from the file's metadata
        (`gguf_tokenizer.tokenizer_from_gguf`), once per process and file version, the same Tokenizer
        for every call.

        Raises CheckpointError (a ValueError) naming the file when tokenizer.json is missing or either
        file cannot be parsed, or naming the key of a GGUF tokenizer that cannot be built.
        """
        from attention_kv_caceh.model_executor.model_source import gguf_file_of

        gguf = gguf_file_of(path)
        if gguf is not None:
            stat = gguf.stat()
            return _gguf_tokenizer(str(gguf), stat.st_size, stat.st_mtime_ns)
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise CheckpointError(f"{file}: file not found")
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as err:  # the Rust library raises a bare Exception for malformed files
            raise CheckpointError(f"{file}: cannot be loaded ({err})") from err
        config: dict[str, Any] = {}
        config_file = folder / "tokenizer_config.json"
        if config_file.is_file():
            try:
                parsed: object = json.loads(config_file.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise CheckpointError(f"{config_file}: not valid JSON ({err})") from err
            if isinstance(parsed, dict):
                config = dict(parsed)  # pyright: ignore[reportUnknownArgumentType]
        return cls(tok, config)

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        """Token ids of `text`; add_special_tokens applies the tokenizer's post-processor (e.g. a BOS).
        With `max_length`, only the first `max_length` ids (of the post-processed sequence).

        Goes through `encode_batch_fast`, which releases the GIL while the Rust tokenizer works (`encode`
        does not), so a server thread tokenizing a long prompt leaves the event loop running. What runs
        with the GIL held is building the Python list of ids, a few milliseconds per 100,000 tokens:
        `max_length` bounds it, which is how the server keeps a prompt far longer than the model's
        context from holding up the event loop. `_fast` skips the character offsets nothing here reads,
        which leaves less to free with the GIL held. Raises ValueError for max_length < 1.

        A text longer than `max_length * max_token_chars` characters (where that bound exists, see
        `_chars_per_token`) has at least `max_length` tokens, since no token covers more characters:
        only that many leading characters are encoded, so a text of any length, one without a space
        included, costs what its head costs. The ids are then those of that head, which may differ from
        the whole text's in the last few (a word cut at its end); the text is known to be too long.
        """
        return self.encode_counted(text, add_special_tokens, max_length)[0]

    def encode_counted(
        self, text: str, add_special_tokens: bool = True, max_length: int | None = None
    ) -> tuple[list[int], int, bool]:
        """(ids, num_tokens, exact): the ids of `text` (only the first `max_length` with it), how many ids
        the whole text has, and whether that count is exact.

        The count is exact for every text of at most `max_length * max_token_chars` characters: the Rust
        tokenizer encodes all of it (with the GIL released, as `encode`; a long text piece by piece) and
        only the Python list of at most `max_length` ids is built with the GIL held. A longer text (where
        the bound exists, see `_chars_per_token`) is known to be too long without encoding it whole: only
        its head is encoded, and the count is then the lower bound ceil(len(text) / max_token_chars), which
        is above `max_length`, since no token covers more characters (special tokens the post-processor
        adds only raise the count). What the server uses to refuse a prompt past the context with its
        exact length, or "at least" that bound. Raises ValueError for max_length < 1.
        """
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        bound = self.max_token_chars
        if max_length is not None and bound is not None and len(text) > max_length * bound:
            ids = self._encode_cut(text[: max_length * bound], add_special_tokens, max_length)[0]
            return ids, -(-len(text) // bound), False
        ids, count = self._encode_cut(text, add_special_tokens, max_length)
        return ids, count, True

    def _encode_cut(
        self, text: str, add_special_tokens: bool, max_length: int | None
    ) -> tuple[list[int], int]:
        """The first `max_length` ids of `text` (all without it) and the number of ids of the whole text."""
        if self._specials is not None and len(text) > _PIECE_CHARS:
            ids: list[int] = []
            count = 0
            for part in self.encode_pieces(text, add_special_tokens):
                count += len(part)
                if max_length is None or len(ids) < max_length:
                    ids += part if max_length is None else part[: max_length - len(ids)]
            return ids, count
        encoding = self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        count = len(encoding)
        if max_length is not None and count > max_length:
            encoding.truncate(max_length)
        return encoding.ids, count

    def encode_pieces(self, text: str, add_special_tokens: bool = True) -> Iterator[list[int]]:
        """The ids of `encode(text)` in consecutive lists, one per piece of a long text (one list for a
        short one, or when the tokenizer cannot be cut at spaces; see the module docstring), so a caller
        that turns them into something else (/tokenize's JSON) never holds them all as Python ints."""
        if self._specials is None or len(text) <= _PIECE_CHARS:
            yield self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
            return
        before, after = self._specials if add_special_tokens else ([], [])
        pieces = _pieces(text, _PIECE_CHARS)
        for i, piece in enumerate(pieces):
            ids = self._tok.encode_batch_fast([piece], add_special_tokens=False)[0].ids
            yield (before if i == 0 else []) + ids + (after if i == len(pieces) - 1 else [])

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer as its JSON (what llguidance builds its tokenizer view from)."""
        return self._tok.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids the tokenizer does not know (a model's padding rows) decode to nothing."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes token `token_id` stands for (what chat logprobs' `bytes` carry).

        A byte-level BPE token (GPT-2's alphabet: each byte written as one printable character) maps back
        to its raw bytes, so half of a multi-byte character gives its bytes, not U+FFFD. Any other token
        gives the UTF-8 of its decoded text. A SentencePiece piece with byte fallback gives its byte
        ("<0x0A>" gives one newline byte) or its text with "▁" read as a space. An id the tokenizer does not know gives b"".
        """
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_fallback:
            byte = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode("utf-8")
        table = _byte_level_decoder()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")


@functools.lru_cache(maxsize=4)
def _gguf_tokenizer(path: str, size: int, mtime_ns: int) -> Tokenizer:
    """The Tokenizer of a GGUF file, built once per process and file version (size, mtime): a start loads
    it for the engine, the prompts and the server, and building a 49,152-token vocabulary costs about
    a second. Shared: a Tokenizer is not changed after it is built."""
    del size, mtime_ns  # part of the cache key only
    from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint
    from attention_kv_caceh.model_executor.gguf_tokenizer import tokenizer_from_gguf

    return Tokenizer(*tokenizer_from_gguf(GGUFCheckpoint(path)))


def _pieces(text: str, size: int) -> list[str]:
    """`text` cut into pieces of about `size` characters, each cut just before a space (U+0020) whose
    previous character is not whitespace; a stretch with no such space stays whole."""
    out: list[str] = []
    start = 0
    while len(text) - start > size:
        cut = text.rfind(" ", start + 1, start + size + 1)
        while cut > start and text[cut - 1].isspace():
            cut = text.rfind(" ", start + 1, cut)
        if cut <= start:  # no cut in this stretch: look further on
            cut = text.find(" ", start + size + 1)
            while cut != -1 and text[cut - 1].isspace():
                cut = text.find(" ", cut + 1)
            if cut == -1:
                break
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def _chars_per_token(tok: HFTokenizer) -> int | None:
    """The most characters of a text one token can cover, when there is such a bound; else None.

    A BPE model's token covers the characters of its vocabulary entry (a byte-level entry writes one
    character per byte, and a character is at least one byte), so the longest entry bounds it, added
    tokens included, as long as nothing removes characters before the model: no normalizer, or one that
    decomposes or lower-cases (neither ever shortens a text) or composes (NFC, NFKC: at most
    MAX_COMPOSED characters become one, so the bound is that many times larger), and no pre-tokenizer
    that drops text
    (Whitespace drops the spaces, a Split may remove its matches). WordPiece's and Unigram's unknown
    token can stand for a whole word: no bound there.
    """
    spec: dict[str, Any] = json.loads(tok.to_str())
    model: dict[str, Any] = spec.get("model", {})
    if model.get("type") != "BPE" or (model.get("fuse_unk") and model.get("unk_token") is not None):
        return None  # fuse_unk: one unknown token for a run of unknown characters

    def types(part: Any, key: str) -> list[dict[str, Any]] | None:
        if part is None:
            return []
        if not isinstance(part, dict):
            return None
        node: dict[str, Any] = part  # pyright: ignore[reportUnknownVariableType]
        if node.get("type") == "Sequence":
            out: list[dict[str, Any]] = []
            for child in node.get(key, []):
                sub = types(child, key)
                if sub is None:
                    return None
                out += sub
            return out
        return [node]

    normalizers = types(spec.get("normalizer"), "normalizers")
    if normalizers is None or any(n.get("type") not in _BOUNDED_NORMALIZERS for n in normalizers):
        return None
    # composing (NFC, NFKC) merges at most MAX_COMPOSED characters into one (Greek with three marks)
    shrink = MAX_COMPOSED if any(n.get("type") in {"NFC", "NFKC"} for n in normalizers) else 1
    pre = types(spec.get("pre_tokenizer"), "pretokenizers")
    if pre is None:
        return None
    for node in pre:
        kind = node.get("type")
        if kind not in {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"}:
            return None
        if kind == "Split" and node.get("behavior") == "Removed":
            return None
    return shrink * max((len(t) for t in tok.get_vocab(with_added_tokens=True)), default=1)


def _cuts_at_spaces(tok: HFTokenizer) -> tuple[list[int], list[int]] | None:
    """The special ids the post-processor puts (before, after) a single text, when a text cut just before
    a space that follows a non-space encodes as the concatenation of its pieces' ids; else None.

    That holds when the normalizer is absent or only recomposes or lower-cases characters (a space never
    composes with what precedes it), a pre-tokenizer splits words (ByteLevel with its regex, Metaspace,
    Split, Whitespace...: each ends a word before such a space; Metaspace adds no second `▁` to a piece
    that starts with a space; a Split's regex is checked on `_PROBE`), and no added token holds a space or strips the whitespace around it. A
    normalizer that prepends `▁` (Llama 2's) or strips text fails it, and so does a pipeline without a
    pre-tokenizer. tests/test_engine_tokenizer.py checks the equality on such pipelines.
    """
    spec: dict[str, Any] = json.loads(tok.to_str())

    def kinds(part: Any) -> set[str] | None:
        if part is None:
            return set()
        if not isinstance(part, dict):
            return None
        node: dict[str, Any] = part  # pyright: ignore[reportUnknownVariableType]
        if node.get("type") == "Sequence":
            found: set[str] = set()
            for child in node.get("normalizers", node.get("pretokenizers", [])):
                sub = kinds(child)
                if sub is None:
                    return None
                found |= sub
            return found
        if node.get("type") == "ByteLevel" and not node.get("use_regex", True):
            return {"ByteLevel-no-regex"}  # maps bytes only (Llama 3 and Qwen2 split with a Split first)
        if node.get("type") == "Metaspace" and not node.get("split", True):
            return None
        return {str(node.get("type"))}

    normalizers, pre_tokenizers = kinds(spec.get("normalizer")), kinds(spec.get("pre_tokenizer"))
    if normalizers is None or not normalizers <= _SAFE_NORMALIZERS:
        return None
    if (
        pre_tokenizers is None
        or not pre_tokenizers & _WORD_SPLITTERS
        or not pre_tokenizers <= _SAFE_PRE_TOKENIZERS
    ):
        return None
    for added in spec.get("added_tokens", []):
        if " " in added.get("content", " ") or added.get("lstrip") or added.get("rstrip"):
            return None
        if added.get("single_word"):
            return None
    probe = tok.encode("a", add_special_tokens=True)
    plain = tok.encode("a", add_special_tokens=False).ids
    ids, mask = probe.ids, probe.special_tokens_mask
    head = 0
    while head < len(ids) and mask[head]:
        head += 1
    tail = len(ids)
    while tail > head and mask[tail - 1]:
        tail -= 1
    if ids[head:tail] != plain:
        return None
    # a Split pre-tokenizer may carry any regex: check the rule on text of every kind, cut everywhere
    pieces = _pieces(_PROBE, 4)
    whole = tok.encode(_PROBE, add_special_tokens=False).ids
    if [t for p in pieces for t in tok.encode(p, add_special_tokens=False).ids] != whole:
        return None
    return ids[:head], ids[tail:]


_PROBE = (
    "Hello world,  the cat's 12345 x\t y\n z.  \u00bfQu\u00e9?  \u65e5\u672c\u8a9e \u30c6\u30b9\u30c8  "
    "end... a-b (c) [d] {e} 'f' \"g\" #h $1.50 100% ok!!  \n\n  indented    spaces x\u00a0y caf\u00e9 "
    "e\u0301 \U0001f600 done"
)


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-character table inverted (character -> byte): printable Latin-1 bytes stand for
    themselves, the other 68 bytes for U+0100 onwards (`bytes_to_unicode` in GPT-2's encoder.py)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


class TextDecoder(Protocol):
    """Anything that turns token ids into text (a `Tokenizer`, or a test's byte decoder)."""

    def decode(self, token_ids: list[int], /) -> str:
        """Text of the token ids."""
        ...


class IncrementalDetokenizer:
    """Text deltas of a growing token list, for streaming (vLLM's `detokenize_incrementally`).

    Keeps two offsets into the ids, as vLLM does: text up to `read_offset` has been returned, and
    `prefix_offset` starts a short window of earlier tokens decoded again for context (a decoder may
    drop the leading space of the first token it sees, and a byte-level token may be half of a
    character). Each `add(ids)` decodes only ids[prefix_offset:] and ids[prefix_offset:read_offset]
    and returns the difference, so a step costs the window, not the whole output. A decode that ends
    in U+FFFD (an incomplete UTF-8 sequence of byte-level tokens) is held back until a later token
    completes it, so no replacement character is streamed mid-character; `flush()` returns whatever
    is still held back at the end. The concatenated deltas equal the decode of all ids when the
    decoder decodes a window starting at a returned boundary as the full decode continues there (true
    of byte-level BPE; checked by the tests).
    """

    def __init__(self, tokenizer: TextDecoder) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # ids before this have had their text returned

    def add(self, new_token_ids: list[int]) -> str:
        """Append `new_token_ids`; return the new text (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back (replacement characters included), and mark it returned."""
        prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]
