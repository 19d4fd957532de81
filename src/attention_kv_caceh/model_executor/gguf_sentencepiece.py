"""A SentencePiece vocabulary from GGUF metadata (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral,
TinyLlama, Gemma, Phi-3) as a `tokenizers` BPE with byte fallback, the way transformers builds it.

vLLM hands a GGUF file's tokenizer to transformers (`AutoTokenizer.from_pretrained(..., gguf_file=...)`,
`vllm/transformers_utils/tokenizer.py`); transformers' GGUF converter (`integrations/gguf`, with
`LlamaTokenizer` and `generate_merges`) builds a fast tokenizer, and so does this, from llama.cpp's keys:

    tokenizer.ggml.tokens          the pieces, id = position ("▁the": "▁" stands for a space)
    tokenizer.ggml.scores          one float per piece (SentencePiece's log-probabilities)
    tokenizer.ggml.token_type      1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte ("<0x0A>")
    tokenizer.ggml.bos_token_id / eos_token_id / unknown_token_id / padding_token_id
    tokenizer.ggml.add_bos_token   default true for this model, as llama.cpp and transformers add BOS
    tokenizer.ggml.add_eos_token   default false
    tokenizer.ggml.add_space_prefix  default true: "▁" before the text's first piece (llama.cpp's meaning)

The pipeline: no normalizer; a Metaspace pre-tokenizer (each space becomes "▁", one "▁" before the first
piece, the text kept in one piece); a BPE model over the pieces with `byte_fallback` (a character
without a piece becomes its UTF-8 bytes' "<0xNN>" pieces) and `fuse_unk`; merges derived from the
vocabulary (a file of this model lists none): every split of a piece into two pieces is a merge, ranked
by the whole piece's score, highest first, then the longer left part, then the longer right part, then
the file order of the piece and the ids of the parts (transformers' `generate_merges`). Control pieces
become special added tokens, user-defined ones plain added tokens (both matched whole in text). The
decoder maps "▁" back to a space, "<0xNN>" pieces to their bytes, and strips the prefix space. A text
that starts with a space gets no second "▁" (Metaspace prepends only where none is), so its decode
lacks that space, as transformers' does.

Left out: Unigram models (`tokenizer.ggml.model = "t5"`), WordPiece ("bert"), the precompiled
normalization map (`tokenizer.ggml.precompiled_charsmap`), and the per-family adjustments transformers
makes for Gemma (pieces of several spaces, merges in file order) and Phi-3 (a Prepend normalizer):
those families' models are not implemented here. Where transformers 5.24 ignores
`add_space_prefix = false` (its builder does not read it), this follows llama.cpp and adds no prefix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from attention_kv_caceh.model_executor.checkpoint import CheckpointError

if TYPE_CHECKING:
    from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint

__all__ = ["SPACE", "sentencepiece_from_gguf", "sentencepiece_merges"]

SPACE = "\u2581"  # "▁", SentencePiece's space
_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies (the order of the module docstring).

    tokens[i] has score scores[i]; a token listed twice keeps its last id and last score (as a dict
    built from the list does). Returns (left, right) pairs, the first merged first.
    """
    ids = {token: i for i, token in enumerate(tokens)}
    score_of = dict(zip(tokens, scores, strict=True))
    ranked: list[tuple[float, int, int, int, int, int, str, str]] = []
    for order, (piece, score) in enumerate(score_of.items()):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                # sort key: score, len(left), len(right) descending; then piece order, part ids ascending
                ranked.append((-score, -len(left), -len(right), order, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def sentencepiece_from_gguf(ckpt: GGUFCheckpoint, tokens: list[str]) -> tuple[HFTokenizer, dict[str, Any]]:
    """The Tokenizer of a GGUF file whose `tokenizer.ggml.model` is "llama", and a tokenizer_config-like
    dict (`bos_token`, `eos_token`, `pad_token`, `unk_token`, `chat_template`). `tokens` is the file's
    vocabulary.

    Raises CheckpointError naming the key: scores missing or not one number per token, token types of
    another length, a special-token id outside the vocabulary.
    """
    source = ckpt.source

    def fail(key: str, why: str) -> CheckpointError:
        return CheckpointError(f"{source}: key {key!r}: {why}")

    scores = ckpt.metadata_array("tokenizer.ggml.scores")
    if scores is None or scores.dtype.kind != "f" or scores.shape != (len(tokens),):
        raise fail(
            "tokenizer.ggml.scores",
            f"must be one float per token ({len(tokens)}), got {ckpt.metadata_type('tokenizer.ggml.scores')}",
        )
    types = ckpt.metadata_array("tokenizer.ggml.token_type")
    if types is not None and types.shape != (len(tokens),):
        raise fail("tokenizer.ggml.token_type", f"{types.shape[0]} types for {len(tokens)} tokens")

    def token(key: str) -> str | None:
        value: Any = ckpt.metadata(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
            raise fail(
                f"tokenizer.ggml.{key}", f"{value!r} is not an id of the {len(tokens)}-token vocabulary"
            )
        return tokens[value]

    def flag(key: str, default: bool) -> bool:
        value: Any = ckpt.metadata(f"tokenizer.ggml.{key}", default)
        if not isinstance(value, bool):
            raise fail(f"tokenizer.ggml.{key}", f"must be a boolean, got {value!r}")
        return value

    bos, eos = token("bos_token_id"), token("eos_token_id")
    unk, pad = token("unknown_token_id"), token("padding_token_id")
    prefix = flag("add_space_prefix", True)
    vocab = {piece: i for i, piece in enumerate(tokens)}
    merges = sentencepiece_merges(tokens, cast(list[float], scores.tolist()))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(content=" ", left=1)] if prefix else steps)
    kinds = [] if types is None else cast(list[int], types.tolist())
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, kinds, strict=False)
        if k == _CONTROL
    ]
    # bos/eos/unk/pad are special even where the file types them otherwise (transformers adds them so)
    named = {t for t in (bos, eos, unk, pad) if t is not None} - {a.content for a in control}
    control += [AddedToken(t, special=True, normalized=False) for t in sorted(named, key=vocab.__getitem__)]
    if control:
        tok.add_special_tokens(control)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, kinds, strict=False)
        if k == _USER_DEFINED
    ]
    if user:
        tok.add_tokens(user)
    add_bos = flag("add_bos_token", True) and bos is not None
    add_eos = flag("add_eos_token", False) and eos is not None
    first = [f"{bos}:0"] if add_bos else []
    last = [f"{eos}:0"] if add_eos else []
    special = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on and t is not None]
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join([*first, "$A:0", *last]),
        pair=" ".join([*first, "$A:0", *last, *[f"{bos}:1"] * add_bos, "$B:1", *[f"{eos}:1"] * add_eos]),
        special_tokens=special,
    )
    template = ckpt.metadata("tokenizer.chat_template")
    config = {
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        "chat_template": template if isinstance(template, str) else None,
    }
    return tok, config
