"""OpenAIServingTokenization: POST /tokenize and /detokenize, the answer written as JSON piece by piece.

Corresponds to vLLM's `vllm/entrypoints/openai/serving_tokenization.py` (OpenAIServingTokenization), its
request and answer shapes. /tokenize takes a `prompt` (vLLM's four forms) or `messages` (rendered with
the chat template, whose text carries its own special tokens), never both; /detokenize a list of ids or
of id lists. Both run in a worker thread, so a long text never stalls the other streams.

vLLM's /tokenize counts every token (it is not held to max_model_len), so an 8 MB text answers with
millions of ids. As Python ints in a list, then a copy FastAPI makes to encode it, then the JSON text,
they cost about 60 bytes a token, 30 times the body. Here each piece of ids the tokenizer yields
(`Tokenizer.encode_pieces`) is written to the JSON bytes at once with msgspec and dropped, so the answer
costs about its own size.

Left out: vLLM's `/tokenizer_info`, and the chat form's tools, multimodal parts and `chat_template_kwargs`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgspec
from fastapi.responses import Response

from attention_kv_caceh.engine.async_llm import TokenizerLike
from attention_kv_caceh.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from attention_kv_caceh.entrypoints.openai.serving import HTTPError
from attention_kv_caceh.entrypoints.openai.serving_engine import OpenAIServing

__all__ = ["OpenAIServingTokenization", "encode_pieces", "tokenize_json"]

_encoder = msgspec.json.Encoder()


class OpenAIServingTokenization(OpenAIServing):
    """POST /tokenize and /detokenize over the base class's tokenizer, chat template and model name."""

    async def tokenize(self, body: TokenizeRequest) -> Response:
        """`{"count", "max_model_len", "tokens", "token_strs"}` of the body's prompt or messages. Raises
        HTTPError 400 for both forms or neither, a template that fails, or ids outside the vocabulary."""
        self.check_model(body.model)
        self.warn_ignored(body)
        if body.messages is not None and body.prompt is not None:  # one form or the other, never both
            raise HTTPError(400, "give either prompt or messages, not both", "messages")

        def work() -> bytes:  # in a worker thread: a long text never stalls the other streams
            decode = self.tokenizer.decode if body.return_token_strs else None
            return tokenize_json(self._pieces(body), self.max_model_len, decode)

        return Response(await asyncio.to_thread(work), media_type="application/json")

    def _pieces(self, body: TokenizeRequest) -> Iterator[list[int]]:
        """Every prompt's ids, piece by piece (the answer costs its size)."""
        if body.messages is not None:
            try:
                text = self.render_chat(body.messages, body.add_generation_prompt)
            except ValueError as exc:
                raise HTTPError(400, str(exc), "messages") from exc
            yield from encode_pieces(self.tokenizer, text, False)  # the template writes the specials
        elif body.prompt is not None:
            for item in self.prompt_list(body.prompt):
                if isinstance(item, str):
                    yield from encode_pieces(self.tokenizer, item, body.add_special_tokens)
                else:
                    yield self.check_ids(item, "prompt")
        else:
            raise HTTPError(400, "give `prompt` or `messages`", "prompt")

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """`{"prompt": text}` of the body's ids (a list of texts for a list of id lists). Raises HTTPError
        400 for ids outside the vocabulary."""
        self.check_model(body.model)
        self.warn_ignored(body)
        lists = [self.check_ids(ids, "tokens") for ids in body.tokens if isinstance(ids, list)]
        flat = self.check_ids([t for t in body.tokens if isinstance(t, int)], "tokens")
        decode = self.tokenizer.decode
        if lists:
            return {"prompt": await asyncio.to_thread(lambda: [decode(ids) for ids in lists])}
        return {"prompt": await asyncio.to_thread(decode, flat)}


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
