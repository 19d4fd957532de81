"""A request's `response_format` / `structured_outputs` as the engine's StructuredOutputsParams, checked first.

Corresponds to the structured-output part of vLLM's `ChatCompletionRequest.to_sampling_params` /
`CompletionRequest.to_sampling_params` (`vllm/entrypoints/openai/protocol.py`: response_format to
StructuredOutputsParams) and of `vllm/v1/engine/processor.py` (`_validate_structured_output`: the grammar
is compiled in the API process, so a bad one is a 400 before the request is admitted). Left out: the
per-request backend choice and fallbacks (llguidance compiles every kind here), and vLLM's removed
`guided_*` fields (refused with a 400 by protocol.py).

Fails closed: a schema, regex or grammar llguidance cannot compile is a 400 naming the field and
llguidance's message; nothing is ever served unconstrained in its place. The tokenizer view llguidance
needs is built once, on the first structured request (about 0.4 s), off the event loop.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import llguidance

from attention_kv_caceh.engine.structured_output.backend_guidance import (
    GrammarCompileError,
    build_llg_tokenizer,
    validate_guidance_grammar,
)
from attention_kv_caceh.engine.structured_output.params import StructuredOutputsParams
from attention_kv_caceh.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
)
from attention_kv_caceh.entrypoints.openai.serving import HTTPError

__all__ = ["StructuredOutputsValidator", "structured_outputs_params"]


def structured_outputs_params(body: GenerationRequest) -> tuple[StructuredOutputsParams | None, str]:
    """The constraint `body` asks for and the field that asked (`response_format` or
    `structured_outputs`), or (None, "") for none. Not yet compiled.

    Raises HTTPError(400) naming the field: both fields set, a `json_schema` without `schema`, no kind or
    several kinds in `structured_outputs` (vLLM's message), min_tokens with a constraint."""
    fmt, so = body.response_format, body.structured_outputs
    asks_format = fmt is not None and fmt.type != "text"
    if asks_format and so is not None:
        raise HTTPError(
            400, "response_format and structured_outputs cannot both be given", "structured_outputs"
        )
    params: StructuredOutputsParams | None = None
    param = ""
    try:
        if fmt is not None and asks_format:
            param = "response_format"
            if fmt.type == "json_object":
                params = StructuredOutputsParams(json_object=True)
            else:
                spec = fmt.json_schema
                if spec is None or spec.json_schema is None:
                    raise HTTPError(400, "response_format json_schema needs `json_schema.schema`", param)
                params = StructuredOutputsParams(json=json.dumps(spec.json_schema))
        elif so is not None:
            param = "structured_outputs"
            schema: Any = so.json_
            tag: Any = so.structural_tag
            params = StructuredOutputsParams(
                json=json.dumps(schema) if isinstance(schema, dict) else schema,
                regex=so.regex,
                choice=None if so.choice is None else tuple(so.choice),
                grammar=so.grammar,
                json_object=so.json_object,
                structural_tag=json.dumps(tag) if isinstance(tag, dict) else tag,
                disable_any_whitespace=so.disable_any_whitespace,
                disable_additional_properties=so.disable_additional_properties,
                whitespace_pattern=so.whitespace_pattern,
            )
    except ValueError as exc:
        raise HTTPError(400, str(exc), param) from exc
    if params is not None and body.min_tokens:
        raise HTTPError(400, f"min_tokens cannot be combined with {param}", "min_tokens")
    return params, param


class StructuredOutputsValidator:
    """Compiles a request's constraint against the served tokenizer before admission (fails closed).

    Args:
        tokenizer_json: the tokenizer as `tokenizers` JSON, or None when the served tokenizer is not one
            (then every structured request is a 400 saying so).
        eos_token_ids: the ids that end a complete output.
    """

    def __init__(self, tokenizer_json: str | None, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer_json = tokenizer_json
        self._eos = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                if self._tokenizer_json is None:
                    raise GrammarCompileError("structured outputs need the model's own tokenizer")
                self._tokenizer = build_llg_tokenizer(self._tokenizer_json, self._eos)
            return self._tokenizer

    def check(self, params: StructuredOutputsParams, param: str) -> None:
        """Compile `params` with llguidance (blocking: call it in a thread). Raises HTTPError(400) naming
        `param` and llguidance's message when it does not compile."""
        try:
            validate_guidance_grammar(params, self._llg_tokenizer())
        except GrammarCompileError as exc:
            raise HTTPError(400, f"{param} cannot be served: {exc}", param) from exc

    def params_for(self, body: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
        """`structured_outputs_params(body)`, compiled once here (blocking). Raises HTTPError(400)."""
        params, param = structured_outputs_params(body)
        if params is not None:
            self.check(params, param)
        return params
