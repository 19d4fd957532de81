"""POST /tokenize's answer, written as JSON piece by piece (vLLM's `serving_tokenization.py`, its shape).

vLLM's /tokenize counts every token (it is not held to max_model_len), so an 8 MB text answers with
millions of ids. As Python ints in a list, then a copy FastAPI makes to encode it, then the JSON text,
they cost about 60 bytes a token, 30 times the body. Here each piece of ids the tokenizer yields
(`Tokenizer.encode_pieces`) is written to the JSON bytes at once with msgspec and dropped, so the answer
costs about its own size.

Left out: vLLM's `/tokenizer_info`, and the chat form's tools, multimodal parts and `chat_template_kwargs`;
the requests themselves are checked in api_server.py (/tokenize, /detokenize).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import msgspec

from attention_kv_caceh.engine.async_llm import TokenizerLike

__all__ = ["encode_pieces", "tokenize_json"]

_encoder = msgspec.json.Encoder()


def encode_pieces(tokenizer: TokenizerLike, text: str, add_special_tokens: bool) -> Iterator[list[int]]:
    """The ids of `text` in consecutive lists: the tokenizer's own pieces when it has
    `encode_pieces` (engine/tokenizer.py), else one list."""
    pieces: Callable[[str, bool], Iterator[list[int]]] | None = getattr(tokenizer, "encode_pieces", None)
    if pieces is None:
        yield tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return
    yield from pieces(text, add_special_tokens)


def tokenize_json(
    pieces: Iterable[list[int]], max_model_len: int, decode: Callable[[list[int]], str] | None
) -> bytes:
    """`{"count", "max_model_len", "tokens", "token_strs"}` of the ids in `pieces`, as JSON bytes;
    `token_strs` is each token's text when `decode` is given (`decode([id])`), else null."""
    tokens, strs = bytearray(), bytearray()
    count = 0
    for ids in pieces:
        if not ids:
            continue
        sep = b"," if count else b""
        tokens += sep + _encoder.encode(ids)[1:-1]
        if decode is not None:
            strs += sep + _encoder.encode([decode([t]) for t in ids])[1:-1]
        count += len(ids)
    head = b'{"count":%d,"max_model_len":%d,"tokens":[' % (count, max_model_len)
    tail = b'],"token_strs":' + (b"[" + strs + b"]" if decode is not None else b"null") + b"}"
    return b"".join((head, tokens, tail))
