"""Tokenizer: a Hugging Face `tokenizer.json` (through the `tokenizers` library) plus `tokenizer_config.json`,
or the one a GGUF file's metadata describes (`gguf_tokenizer.py`).

What vLLM's `transformers_utils/tokenizer.py` and `v1/engine/detokenizer.py` do, for one local folder:
encode/decode with the fast tokenizer, read the eos/bos tokens and the chat template string from
tokenizer_config.json, and turn a growing list of output ids into text deltas for streaming. Left out:
rendering the chat template (it is Jinja; the string is kept for a caller that has a renderer), slow
tokenizers, and the prompt tokens vLLM decodes as the first window's context (deltas here start at the
first output token).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer as HFTokenizer

from attention_kv_caceh.engine.checkpoint import CheckpointError

__all__ = ["IncrementalDetokenizer", "TextDecoder", "Tokenizer"]

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

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Read `path/tokenizer.json` and, when present, `path/tokenizer_config.json`.

        `path` may also name a GGUF file (a `.gguf` file, a folder holding one, or a model name of
        `model_source.MODELS`): the tokenizer is then built from the file's metadata
        (`gguf_tokenizer.tokenizer_from_gguf`).

        Raises CheckpointError (a ValueError) naming the file when tokenizer.json is missing or either
        file cannot be parsed, or naming the key of a GGUF tokenizer that cannot be built.
        """
        from attention_kv_caceh.engine.model_source import gguf_file_of

        gguf = gguf_file_of(path)
        if gguf is not None:
            from attention_kv_caceh.engine.gguf_checkpoint import GGUFCheckpoint
            from attention_kv_caceh.engine.gguf_tokenizer import tokenizer_from_gguf

            return cls(*tokenizer_from_gguf(GGUFCheckpoint(gguf)))
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
        """
        return self.encode_counted(text, add_special_tokens, max_length)[0]

    def encode_counted(
        self, text: str, add_special_tokens: bool = True, max_length: int | None = None
    ) -> tuple[list[int], int]:
        """The ids of `text` (only the first `max_length` with it) and how many ids the whole text has.

        The count is exact: the Rust tokenizer encodes the whole text (with the GIL released, as `encode`)
        and the length of its Encoding is read before the cut, so only the Python list of at most
        `max_length` ids is built with the GIL held. What the server uses to refuse a prompt past the
        context with its exact length. Raises ValueError for max_length < 1.
        """
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        encoding = self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        count = len(encoding)
        if max_length is not None and count > max_length:
            encoding.truncate(max_length)
        return encoding.ids, count

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids the tokenizer does not know (a model's padding rows) decode to nothing."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes token `token_id` stands for (what chat logprobs' `bytes` carry).

        A byte-level BPE token (GPT-2's alphabet: each byte written as one printable character) maps back
        to its raw bytes, so half of a multi-byte character gives its bytes, not U+FFFD. Any other token
        gives the UTF-8 of its decoded text. An id the tokenizer does not know gives b"".
        """
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        table = _byte_level_decoder()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")


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
