"""The llguidance backend: a request's constraint compiled to a grammar, and the matcher that walks it.

Corresponds to vLLM's `vllm/v1/structured_output/backend_guidance.py` (GuidanceBackend, GuidanceGrammar,
serialize_guidance_grammar, validate_guidance_grammar) and the llguidance part of
`backend_types.py`. Left out: the xgrammar and outlines backends (llguidance compiles every kind here),
vLLM's reasoning-parser hook (no reasoning models), and the per-request `disable_fallback`.

llguidance (https://github.com/guidance-ai/llguidance) builds a token-level matcher from a grammar and the
tokenizer's vocabulary: `fill_bitmask` writes one bit per token id (1: the token may come next), packed 32
to an int32 word (`[ceil(V / 32)]`, token t is bit t % 32 of word t // 32), the layout vLLM's bitmask uses.

JSON whitespace: llguidance's "flexible" JSON allows any whitespace between tokens; unbounded, a small
model can fill max_tokens with newlines (the failure users report of JSON modes). Every JSON grammar here
bounds one run by DEFAULT_WHITESPACE_PATTERN unless the request gives its own `whitespace_pattern`, and
`disable_any_whitespace` allows none (the compact separators `,` and `:`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, cast

import llguidance
import numpy as np
import numpy.typing as npt

from .params import StructuredOutputsParams

__all__ = [
    "DEFAULT_WHITESPACE_PATTERN",
    "GrammarCompileError",
    "GuidanceGrammar",
    "build_llg_tokenizer",
    "compile_grammar",
    "serialize_guidance_grammar",
    "validate_guidance_grammar",
]

# One run of whitespace between JSON tokens: at most 16 characters (room for a newline and an indented
# line of a nested pretty-printed value, never an endless run).
DEFAULT_WHITESPACE_PATTERN = r"[\x20\x0A\x0D\x09]{0,16}"


class GrammarCompileError(ValueError):
    """A constraint llguidance cannot compile (its message names the problem)."""


def build_llg_tokenizer(tokenizer_json: str, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a `tokenizers` tokenizer from its JSON (`tokenizers.Tokenizer.to_str()`),
    what `llguidance.hf.from_tokenizer` builds from a transformers tokenizer; `eos_token_ids` end the
    output once the grammar is complete. About 0.4 s for a 49k vocabulary: build it once.

    Raises GrammarCompileError when llguidance cannot read the tokenizer."""
    try:
        return llguidance.LLTokenizer(tokenizer_json, eos_token=list(eos_token_ids) or None)
    except Exception as exc:  # the Rust side raises a bare Exception / ValueError
        raise GrammarCompileError(f"llguidance cannot use this tokenizer: {exc}") from exc


def _no_additional_properties(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object schema that sets none (vLLM's
    process_for_additional_properties)."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in cast(list[Any], schema)]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in cast(dict[str, Any], schema).items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _json_grammar(schema: str, params: StructuredOutputsParams) -> str:
    options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
    if not params.disable_any_whitespace:
        options["whitespace_pattern"] = params.whitespace_pattern or DEFAULT_WHITESPACE_PATTERN
    parsed: Any = json.loads(schema)
    if params.disable_additional_properties:
        parsed = _no_additional_properties(parsed)
    return llguidance.LLMatcher.grammar_from_json_schema(
        parsed,
        defaults=cast(Any, options),
    )


def _structural_tag_grammar(text: str) -> str:
    tag: Any = json.loads(text)
    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list):
        raise GrammarCompileError('structural_tag must be {"structures": [...], "triggers": [...]}')
    spec = cast(dict[str, Any], tag)
    triggers = [t for t in cast(list[Any], spec.get("triggers") or []) if isinstance(t, str)]
    tags: list[llguidance.StructTag] = []
    for item in cast(list[Any], spec["structures"]):
        if not isinstance(item, dict):
            raise GrammarCompileError("structural_tag.structures holds a non-object")
        s = cast(dict[str, Any], item)
        begin, end = s.get("begin"), s.get("end", "")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise GrammarCompileError("each structural_tag structure needs a string `begin` and `end`")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise GrammarCompileError(
                f"structure begin {begin!r} starts with none of the triggers {triggers}"
            )
        tags.append(
            llguidance.StructTag(trigger=trigger, begin=begin, grammar=s.get("schema") or {}, end=end)
        )
    if not tags:
        raise GrammarCompileError("structural_tag.structures is empty")
    return llguidance.StructTag.to_grammar(tags)


def serialize_guidance_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) of a request's constraint (vLLM's
    serialize_guidance_grammar); not yet checked against a tokenizer.

    Raises GrammarCompileError for a grammar text llguidance cannot even read (a GBNF it cannot convert,
    a malformed structural tag)."""
    try:
        if params.json is not None:
            return _json_grammar(params.json, params)
        if params.json_object:
            return _json_grammar('{"type": "object"}', params)
        if params.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if params.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(list(params.choice)))
        if params.grammar is not None:
            return llguidance.grammar_from("grammar", params.grammar)
        assert params.structural_tag is not None
        return _structural_tag_grammar(params.structural_tag)
    except GrammarCompileError:
        raise
    except (ValueError, AssertionError, TypeError) as exc:
        raise GrammarCompileError(f"{params.kind}: {exc}") from exc


def validate_guidance_grammar(params: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer) -> str:
    """The grammar of `params`, checked by llguidance against the tokenizer (vLLM's
    validate_guidance_grammar): what the API process runs before admitting a request.

    Raises GrammarCompileError naming the kind and llguidance's message (an unsupported schema keyword,
    a look-around in a regex, a Lark syntax error, ...)."""
    grammar = serialize_guidance_grammar(params)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise GrammarCompileError(f"{params.kind}: {error}")
    return grammar


class GuidanceGrammar:
    """One request's matcher: the tokens its grammar allows next, advanced token by token (vLLM's
    GuidanceGrammar).

    Args:
        tokenizer: the LLTokenizer the grammar was checked against.
        grammar: a grammar from validate_guidance_grammar.

    Raises:
        GrammarCompileError: llguidance refuses the grammar.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarCompileError(self.matcher.get_error())
        self.vocab_size = tokenizer.vocab_size
        self.num_processed_tokens = 0

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advance over sampled tokens; False when one is not allowed (the matcher then stays in error)."""
        for token in tokens:
            if self.matcher.is_stopped():  # the grammar ended: a trailing eos or stop token is not its own
                return True
            if not self.matcher.consume_token(token):
                return False
            self.num_processed_tokens += 1
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar allows from here, without advancing (vLLM cuts a
        request's draft tokens to it)."""
        return list(tokens[: self.matcher.validate_tokens(list(tokens))])

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)
            self.num_processed_tokens -= num_tokens

    def fill_bitmask(self, bitmask: npt.NDArray[np.int32], row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (`[B, ceil(V / 32)]` int32, C-contiguous)."""
        target = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)

    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (the request then stops)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        """llguidance's error, "" while the matcher is fine."""
        return self.matcher.get_error()


def compile_grammar(params: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer) -> GuidanceGrammar:
    """A fresh matcher for `params` (validate, then build). Raises GrammarCompileError."""
    return GuidanceGrammar(tokenizer, validate_guidance_grammar(params, tokenizer))
