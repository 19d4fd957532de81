"""The `logprobs` objects of OpenAI's responses, built from the engine's TokenLogprobs.

Corresponds to `_create_completion_logprobs` in vLLM's `serving_completion.py` and
`_create_chat_logprobs` in `serving_chat.py`:

- completions (`logprobs: k`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one entry per
  token. `tokens[i]` is token i decoded alone (special tokens kept), `top_logprobs[i]` maps the k most
  probable tokens' texts, and the chosen token's, to their logprobs; `text_offset[i]` is where token i's
  text starts in the returned `text`: a special token the text leaves out (the prompt's BOS, which the
  echoed prompt never holds; an output's special tokens under `skip_special_tokens`) takes no characters
  there, so the offsets index the text itself. (vLLM advances by `tokens[i]` even for a BOS it does not
  echo, so its offsets run 17 characters past the text of a Llama-3 prompt.) With
  `echo`, the prompt's tokens come first and the first of them has `null` logprob and top_logprobs (no
  context predicts it).
- chat (`logprobs: true`, `top_logprobs: k`): `{"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}] * k}]}`; `bytes` are the token's UTF-8 bytes (Tokenizer.token_bytes), so
  concatenated they rebuild the text even where a token is half of a multi-byte character.

A logprob of -inf (a masked token) is written as -9999.0, as vLLM does: JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attention_kv_caceh.engine.request import TokenLogprobs
from attention_kv_caceh.engine.tokenizer import TextDecoder, Tokenizer

__all__ = ["chat_logprobs", "completion_logprobs"]

_MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _text(tokenizer: TextDecoder, token_id: int) -> str:
    """Token `token_id` decoded alone, special tokens kept (when the tokenizer can keep them)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.decode([token_id], skip_special_tokens=False)
    return tokenizer.decode([token_id])


def _bytes(tokenizer: TextDecoder, token_id: int) -> bytes:
    """The token's UTF-8 bytes (Tokenizer.token_bytes; another decoder: the bytes of its text)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.token_bytes(token_id)
    return _text(tokenizer, token_id).encode("utf-8", "surrogatepass")


def _shown(tokenizer: TextDecoder, token_id: int, skip_special_tokens: bool) -> str:
    """Token `token_id`'s text as the returned text holds it (a skipped special token: "")."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens)
    return tokenizer.decode([token_id])


def completion_logprobs(
    tokens: Sequence[tuple[int, TokenLogprobs | None]],
    tokenizer: TextDecoder,
    text_offset: int,
    *,
    skip_special_tokens: bool = True,
) -> tuple[dict[str, Any], int]:
    """The completions `logprobs` object of `tokens` ((token id, its TokenLogprobs or None) in order) whose
    text starts at character `text_offset`; returns it and the offset after the last token. A token
    advances the offset by its text as the returned text holds it (`skip_special_tokens`: special tokens
    take no characters)."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in tokens:
        text = _text(tokenizer, token_id)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(_shown(tokenizer, token_id, skip_special_tokens))
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(entry.logprob))
        top = {_text(tokenizer, t): _finite(lp) for t, lp in entry.top}
        top.setdefault(text, _finite(entry.logprob))
        out["top_logprobs"].append(top)
    return out, text_offset


def _chat_entry(tokenizer: TextDecoder, token_id: int, logprob: float) -> dict[str, Any]:
    return {
        "token": _text(tokenizer, token_id),
        "logprob": _finite(logprob),
        "bytes": list(_bytes(tokenizer, token_id)),
    }


def chat_logprobs(entries: Sequence[TokenLogprobs], tokenizer: TextDecoder) -> dict[str, Any]:
    """The chat `logprobs` object of the sampled tokens' `entries`."""
    content: list[dict[str, Any]] = []
    for entry in entries:
        item = _chat_entry(tokenizer, entry.token_id, entry.logprob)
        item["top_logprobs"] = [_chat_entry(tokenizer, t, lp) for t, lp in entry.top]
        content.append(item)
    return {"content": content}
