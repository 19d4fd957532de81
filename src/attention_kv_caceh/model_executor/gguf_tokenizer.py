"""The tokenizer a GGUF file carries in its metadata, built with the `tokenizers` library (its chat
template is read by entrypoints/chat_utils.py).

vLLM hands a GGUF file's tokenizer to transformers (`AutoTokenizer.from_pretrained(..., gguf_file=...)`,
`vllm/transformers_utils/tokenizer.py`); this builds the same fast tokenizer directly. SentencePiece
vocabularies (`tokenizer.ggml.model` "llama", Llama 2's) are built by gguf_sentencepiece.py. Left out:
WordPiece and Unigram vocabularies.
A GGUF file has no `tokenizer.json`; llama.cpp stores the vocabulary under `tokenizer.ggml.*`:

    tokenizer.ggml.model         "gpt2": byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM); "llama": SentencePiece
    tokenizer.ggml.pre           which pre-tokenizer split the text when the merges were learned
    tokenizer.ggml.tokens        the vocabulary, id = position
    tokenizer.ggml.merges        "left right" pairs, highest priority first
    tokenizer.ggml.token_type    1 normal, 3 control (special: <|im_end|>), 4 user-defined, ...
    tokenizer.ggml.bos_token_id / eos_token_id / padding_token_id, tokenizer.ggml.add_bos_token
    tokenizer.chat_template      the Jinja chat template (the one in tokenizer_config.json)

Control tokens become special added tokens (matched whole in text, dropped by decode's
skip_special_tokens) and user-defined ones plain added tokens, as llama.cpp matches both whole. The
pre-tokenizer follows llama.cpp's table (`llama-vocab.cpp`) for the names in PRE_TOKENIZERS; any other
name is refused, since a wrong split gives other token ids without an error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from gguf import GGUFValueType
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from attention_kv_caceh.model_executor.checkpoint import CheckpointError

if TYPE_CHECKING:
    from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint

__all__ = ["PRE_TOKENIZERS", "tokenizer_from_gguf"]

_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType
_INTEGERS = {
    GGUFValueType.INT8,
    GGUFValueType.UINT8,
    GGUFValueType.INT16,
    GGUFValueType.UINT16,
    GGUFValueType.INT32,
    GGUFValueType.UINT32,
    GGUFValueType.INT64,
    GGUFValueType.UINT64,
}
# GPT-2's split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT2): contractions, letters, digits, other, spaces
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (regexes applied in turn, each piece kept; ignore_merges)
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "gpt2": ((_GPT2,), False),
    "smollm": ((r"\p{N}", _GPT2), False),  # every digit alone, then GPT-2's split
    "starcoder": ((r"\p{N}", _GPT2), False),
    "llama-bpe": ((_LLAMA3,), True),  # Llama 3: a word found whole in the vocabulary skips the merges
    "qwen2": ((_QWEN2,), False),
}


def tokenizer_from_gguf(ckpt: GGUFCheckpoint) -> tuple[HFTokenizer, dict[str, Any]]:
    """The `tokenizers` Tokenizer the metadata describes, and a tokenizer_config-like dict (`eos_token`,
    `bos_token`, `pad_token`, `chat_template`) for `tokenizer.Tokenizer`.

    Raises CheckpointError naming the key for a tokenizer model other than "gpt2" or "llama", a
    pre-tokenizer outside PRE_TOKENIZERS, a missing vocabulary, a token listed twice, a malformed merge or
    one naming a token (or a merged token) outside the vocabulary, token types that are not one integer
    per token, or a special-token id outside the vocabulary.
    """
    source = ckpt.source

    def fail(key: str, why: str) -> CheckpointError:
        return CheckpointError(f"{source}: key {key!r}: {why}")

    kind = ckpt.metadata("tokenizer.ggml.model")
    if kind == "llama":  # SentencePiece
        from attention_kv_caceh.model_executor.gguf_sentencepiece import sentencepiece_from_gguf

        return sentencepiece_from_gguf(ckpt, _strings(ckpt, "tokenizer.ggml.tokens", fail))
    if kind != "gpt2":
        raise fail(
            "tokenizer.ggml.model",
            f"tokenizer {kind!r} is not implemented (only 'gpt2', byte-level BPE, and 'llama', SentencePiece)",
        )
    pre = ckpt.metadata("tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZERS:
        raise fail(
            "tokenizer.ggml.pre",
            f"pre-tokenizer {pre!r} is not implemented; known: {', '.join(PRE_TOKENIZERS)}",
        )
    tokens = _strings(ckpt, "tokenizer.ggml.tokens", fail)
    merges: list[tuple[str, str]] = []
    for i, merge in enumerate(_strings(ckpt, "tokenizer.ggml.merges", fail)):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise fail("tokenizer.ggml.merges", f"merge {i} is {merge!r}, not two tokens and one space")
        merges.append((pair[0], pair[1]))
    splits, ignore_merges = PRE_TOKENIZERS[cast(str, pre)]
    vocab: dict[str, int] = {}
    for i, piece in enumerate(tokens):
        if piece in vocab:
            raise fail("tokenizer.ggml.tokens", f"token {piece!r} is both id {vocab[piece]} and id {i}")
        vocab[piece] = i
    for i, (left, right) in enumerate(merges):
        for part in (left, right, left + right):  # BPE needs both sides and what they merge into
            if part not in vocab:
                raise fail(
                    "tokenizer.ggml.merges",
                    f"merge {i} ({left!r} {right!r}) needs {part!r}, which is not in the "
                    f"{len(tokens)}-token vocabulary (tokenizer.ggml.tokens)",
                )
    try:
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    except Exception as err:  # the tokenizers library's own checks (a plain Exception from Rust)
        raise fail("tokenizer.ggml.merges", f"the tokenizers library refuses the BPE model: {err}") from err
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    types: Any = []
    if ckpt.metadata_type("tokenizer.ggml.token_type"):
        kinds = ckpt.metadata_type("tokenizer.ggml.token_type")
        types = ckpt.metadata("tokenizer.ggml.token_type")
        if len(kinds) != 2 or kinds[0] != GGUFValueType.ARRAY or kinds[1] not in _INTEGERS:
            raise fail(
                "tokenizer.ggml.token_type",
                f"must be an array of integers (one per token), got {' of '.join(k.name for k in kinds)}",
            )
        if len(types) != len(tokens):
            raise fail(
                "tokenizer.ggml.token_type",
                f"{len(types)} token types for {len(tokens)} tokens (tokenizer.ggml.tokens)",
            )
    for wanted, special in ((_CONTROL, True), (_USER_DEFINED, False)):
        added = [
            AddedToken(token, special=special, normalized=False)
            for token, kind_ in zip(tokens, cast(list[int], types), strict=True)
            if kind_ == wanted
        ]
        if added:
            tok.add_special_tokens(added) if special else tok.add_tokens(added)

    def token(key: str) -> str | None:
        value: Any = ckpt.metadata(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
            raise fail(
                f"tokenizer.ggml.{key}", f"{value!r} is not an id of the {len(tokens)}-token vocabulary"
            )
        return tokens[value]

    bos, eos, pad = token("bos_token_id"), token("eos_token_id"), token("padding_token_id")
    add_bos = ckpt.metadata("tokenizer.ggml.add_bos_token", False) is True and bos is not None
    add_eos = ckpt.metadata("tokenizer.ggml.add_eos_token", False) is True and eos is not None
    if add_bos or add_eos:
        first = [f"{bos}:0"] if add_bos else []
        last = [f"{eos}:0"] if add_eos else []
        special = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on and t is not None]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join([*first, "$A:0", *last]),
            pair=" ".join([*first, "$A:0", *last, *first, "$B:1", *last]),
            special_tokens=special,
        )
    template = ckpt.metadata("tokenizer.chat_template")
    config = {
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "chat_template": template if isinstance(template, str) else None,
    }
    return tok, config


def _strings(ckpt: GGUFCheckpoint, key: str, fail: Any) -> list[str]:
    if ckpt.metadata_type(key) != [GGUFValueType.ARRAY, GGUFValueType.STRING]:
        raise fail(key, "missing, or not an array of strings")
    return cast(list[str], ckpt.metadata(key))
