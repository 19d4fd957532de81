"""Prompts of an exact number of tokens of the target's tokenizer, and real prompts from a dataset.

`--prompt-len N` means N tokens as the server counts them. With a tokenizer, each synthetic prompt is
built from token ids: N words are drawn, tokenized, cut to N ids, and either sent as the id list
(`openai-completions`, which counts an id prompt as exactly its ids) or decoded to text and checked
by tokenizing it again (adjusted by a token at a time if the round trip drifts). The tokenizer is, in
order of preference: a local `--tokenizer DIR` (its `tokenizer.json`, read with the `tokenizers`
library), else the server's `POST /tokenize` and `POST /detokenize` (vLLM, SGLang). Without either,
the prompt is N words, an approximation; the summary then says once how far the server's count was
from it. For chat, the server's /tokenize counts the chat template too; a local tokenizer.json cannot
(it has no template), so chat prompts built with it are exact only where the server's usage confirms
it (`run.py`): otherwise the run reports `prompt_lengths: "approximate"` and says why.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, cast

import aiohttp

from attention_kv_caceh.harness.backends import RequestSpec
from attention_kv_caceh.harness.load import SYNTHETIC_WORDS

__all__ = [
    "LocalTokenizer",
    "PromptTokenizer",
    "ServerTokenizer",
    "exact_prompts",
    "probe_server_tokenizer",
]

_MAX_ADJUST = 8  # decode/encode round trips tried before a text prompt keeps its checked length


class PromptTokenizer(Protocol):
    """What exact prompts need: ids of a text (without special tokens), the text of ids, and the number
    of tokens the server counts for a text prompt (special tokens included)."""

    name: str

    async def encode(self, text: str) -> list[int]: ...
    async def decode(self, ids: list[int]) -> str: ...
    async def count(self, text: str) -> int: ...


_SPLIT_CHECK = " ".join([*SYNTHETIC_WORDS, *reversed(SYNTHETIC_WORDS), *SYNTHETIC_WORDS[::3]])


class LocalTokenizer:
    """A `tokenizer.json` (a file, or a folder holding one) read with the `tokenizers` library, or the
    tokenizer of a GGUF checkpoint (a .gguf file, a folder holding one, a model name such as smollm2:
    `model_executor.model_source`), built from its metadata.

    Synthetic text (words of SYNTHETIC_WORDS one space apart) is encoded from its words' ids, each word
    encoded once, first and after a space (`_word_ids`): encoding a whole prompt cost about 0.5 ms of
    CPU a request with a small byte-level BPE, as much as streaming it. That is only done when the
    tokenizer splits words at spaces (no merge across a word's start), checked once on a text that
    has every word in both positions; other text is encoded whole.

    Raises ValueError naming the path when there is no such file or it cannot be read.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        from attention_kv_caceh.model_executor.model_source import gguf_file_of

        self._words: dict[str, list[int]] = {}  # word or " word" -> its ids
        self._splits_at_spaces: bool | None = None  # checked at the first synthetic text
        self.name = str(path)
        gguf = gguf_file_of(path)  # CheckpointError (a ValueError) names the file
        if gguf is not None:
            from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint
            from attention_kv_caceh.model_executor.gguf_tokenizer import tokenizer_from_gguf

            self._tokenizer, _ = tokenizer_from_gguf(GGUFCheckpoint(gguf))
            return
        target = Path(path)
        file = target / "tokenizer.json" if target.is_dir() else target
        if not file.is_file():
            raise ValueError(f"--tokenizer {str(path)!r}: no tokenizer.json there")
        try:
            self._tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own exception types
            raise ValueError(f"--tokenizer {str(path)!r}: cannot read {file}: {exc}") from None
        self.name = str(target)

    def _encode_whole(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def _word_ids(self, text: str) -> list[int] | None:
        """The ids of synthetic `text` from its words' ids (class docstring), or None for other text
        or a tokenizer that does not split at spaces."""
        if self._splits_at_spaces is False:
            return None
        words = text.split(" ")
        if not all(w in SYNTHETIC_WORDS for w in words):
            return None
        if self._splits_at_spaces is None:
            self._splits_at_spaces = True
            self._splits_at_spaces = self._word_ids(_SPLIT_CHECK) == self._encode_whole(_SPLIT_CHECK)
            if not self._splits_at_spaces:
                return None
        ids: list[int] = []
        for i, word in enumerate(words):
            key = word if i == 0 else " " + word
            piece = self._words.get(key)
            if piece is None:
                piece = self._words[key] = self._encode_whole(key)
            ids += piece
        return ids

    async def encode(self, text: str) -> list[int]:
        ids = self._word_ids(text)
        return ids if ids is not None else self._encode_whole(text)

    async def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    async def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=True).ids)


@functools.cache
def local_tokenizer(path: str) -> LocalTokenizer:
    """`LocalTokenizer(path)`, built once per process: the command line checks it before any server
    starts and the run then uses the same one (a GGUF file's metadata takes seconds to read).
    Raises ValueError as LocalTokenizer does (a failure is not kept)."""
    return LocalTokenizer(path)


class ServerTokenizer:
    """The server's `POST /tokenize` and `POST /detokenize` (vLLM's and SGLang's API), over `session`.

    With `chat`, `count` tokenizes the text as one user message in the model's chat template
    (`messages`, `add_generation_prompt`), so a chat prompt's length includes the template's tokens,
    as the server's usage counts them.

    Raises aiohttp.ClientError, TimeoutError or ValueError (an answer without `tokens`/`prompt`).
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        model: str,
        timeout_s: float,
        *,
        chat: bool = False,
    ) -> None:
        self.chat = chat
        self.session = session
        self.root = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=min(timeout_s, 30.0))
        self.name = f"{self.root}/tokenize"

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(self.root + path, json=body, timeout=self.timeout) as response:
            if response.status != 200:
                raise ValueError(f"POST {path} answered HTTP {response.status}")
            data: object = await response.json(content_type=None)
        if not isinstance(data, dict):
            raise ValueError(f"POST {path} did not answer a JSON object")
        return cast("dict[str, Any]", data)

    async def _tokens(self, text: str, special: bool) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": special}
        tokens: object = (await self._post("/tokenize", body)).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in cast("list[Any]", tokens)):
            raise ValueError("POST /tokenize answered without a list of token ids")
        return cast("list[int]", tokens)

    async def encode(self, text: str) -> list[int]:
        return await self._tokens(text, special=False)

    async def decode(self, ids: list[int]) -> str:
        prompt: object = (await self._post("/detokenize", {"model": self.model, "tokens": ids})).get("prompt")
        if not isinstance(prompt, str):
            raise ValueError("POST /detokenize answered without a prompt")
        return prompt

    async def count(self, text: str) -> int:
        if not self.chat:
            return len(await self._tokens(text, special=True))
        # a chat prompt as the server counts it: one user message in the model's chat template
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": text}],
            "add_generation_prompt": True,
        }
        tokens: object = (await self._post("/tokenize", body)).get("tokens")
        if not isinstance(tokens, list):
            raise ValueError("POST /tokenize (messages) answered without a list of token ids")
        return len(cast("list[Any]", tokens))


async def probe_server_tokenizer(tokenizer: ServerTokenizer) -> bool:
    """True when the server answers `POST /tokenize` and `/detokenize` sensibly."""
    try:
        ids = await tokenizer.encode("hello world")
        await tokenizer.decode(ids)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return False
    return bool(ids)


async def _exact_ids(text: str, n: int, tokenizer: PromptTokenizer) -> list[int]:
    """The first `n` ids of `text`, repeated when it is shorter (rare: a word is at least one token)."""
    ids = await tokenizer.encode(text)
    while len(ids) < n:
        ids += await tokenizer.encode(" " + text)
    return ids[:n]


async def _block_ids(
    spec: RequestSpec, tokenizer: PromptTokenizer, blocks: dict[int, list[int]]
) -> list[int]:
    """A trace prompt's ids: each hash id's block of exactly `hash_block_size` ids (tokenized once per
    id, kept in `blocks`), concatenated and cut to the prompt's length."""
    from attention_kv_caceh.harness.trace import block_words

    size = spec.hash_block_size
    ids: list[int] = []
    for h in spec.hash_ids:
        block = blocks.get(h)
        if block is None:
            block = blocks[h] = await _exact_ids(" ".join(block_words(h, size)), size, tokenizer)
        ids += block
    return ids[: spec.prompt_tokens]


async def _exact_spec(
    spec: RequestSpec, tokenizer: PromptTokenizer, token_ids: bool, blocks: dict[int, list[int]]
) -> RequestSpec:
    n = spec.prompt_tokens
    if spec.hash_ids:  # a trace row: equal hash ids, equal blocks of ids
        ids = await _block_ids(spec, tokenizer, blocks)
    elif spec.prefix_tokens:  # a shared prefix of exactly prefix_tokens ids, then this request's own suffix
        suffix = spec.prompt[len(spec.prefix) :]
        ids = await _exact_ids(spec.prefix, spec.prefix_tokens, tokenizer)
        ids += await _exact_ids(suffix, n - spec.prefix_tokens, tokenizer)
    else:
        ids = await _exact_ids(spec.prompt, n, tokenizer)
    if token_ids:
        return replace(spec, prompt_token_ids=tuple(ids[:n]), prompt_tokens_checked=n)
    specials = await tokenizer.count("") if n > 1 else 0
    keep = max(1, n - specials)
    text = await tokenizer.decode(ids[:keep])
    counted = await tokenizer.count(text)
    for _ in range(_MAX_ADJUST):
        if counted == n:
            break
        keep = max(1, min(len(ids), keep + (n - counted)))
        text = await tokenizer.decode(ids[:keep])
        counted = await tokenizer.count(text)
    return replace(spec, prompt=text, prompt_tokens_checked=counted)


async def exact_prompts(
    specs: list[RequestSpec], tokenizer: PromptTokenizer, *, token_ids: bool
) -> list[RequestSpec]:
    """`specs` with prompts of exactly `prompt_tokens` tokens of `tokenizer` (as ids when `token_ids`),
    each with `prompt_tokens_checked` set to the count checked. Dataset prompts (`from_dataset`) keep
    their text; their count becomes both the requested and the checked length (the requested length of
    a dataset prompt was its word count, a guess). A trace row's prompt (`hash_ids`) is its blocks'
    ids, each hash id tokenized once for all specs. Raises what the tokenizer raises."""
    out: list[RequestSpec] = []
    blocks: dict[int, list[int]] = {}
    for i, spec in enumerate(specs):
        if i % 64 == 63:
            await asyncio.sleep(0)  # let other tasks run (a server tokenizer's replies) between batches
        if spec.from_dataset:
            count = await tokenizer.count(spec.prompt)
            out.append(replace(spec, prompt_tokens=max(1, count), prompt_tokens_checked=count))
        else:
            out.append(await _exact_spec(spec, tokenizer, token_ids, blocks))
    return out
