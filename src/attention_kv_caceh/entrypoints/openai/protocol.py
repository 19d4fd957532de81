"""Request and error shapes of the OpenAI-compatible server (pydantic models).

Corresponds to vLLM's `vllm/entrypoints/openai/protocol.py`, reduced to the fields this server honours:
sampling (`max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `n`, `stop`
strings, `stop_token_ids`, `min_tokens`, `ignore_eos`, the frequency / presence / repetition penalties,
`logit_bias`), output (`logprobs`, chat's `top_logprobs`, completions' `echo`,
`include_stop_str_in_output`, `skip_special_tokens`), streaming with `stream_options` (`include_usage`,
`continuous_usage_stats`), and vLLM's `/tokenize` and `/detokenize` bodies. `prompt` takes vLLM's four
forms: a string, a list of strings, a list of token ids, a list of token-id lists.

Structured outputs: OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `name`,
`schema`, `strict`) and vLLM's `structured_outputs` object (ResponseFormat, StructuredOutputsRequest; turned
into the engine's StructuredOutputsParams by structured_outputs.py). Tools (chat): `tools`, `tool_choice`,
`parallel_tool_calls`, and assistant messages with `tool_calls` and `tool` messages with `tool_call_id`.

Fields other servers accept and this one does not serve (`best_of`, `suffix`, a request-level
`chat_template`, vLLM's removed `guided_*` fields) are parsed so that setting them is a 400 naming the field
(`refused_field`), not silently ignored. Any other unknown top-level field is kept in `model_extra`: the
server logs one warning naming them, as vLLM does, and serves the request.

Types are strict: an integer field (token ids included) refuses a bool, a float such as `true` or `5.0`,
and a value outside the signed 64-bit range [-2**63, 2**63 - 1] (vLLM's range for `seed`; the engine's
msgpack wire format carries no more; serving.py then checks each field's own range), a float field refuses
bools, NaN and +-Infinity (Python's json module accepts those literals), and a string must be encodable as
UTF-8 (a lone UTF-16 surrogate such as "\ud800" is refused). `validation_error` turns pydantic's errors into
one plain sentence naming the field and its accepted forms. Errors use OpenAI's body:
`{"error": {"message", "type", "param", "code"}}`, with the `type` names the openai client gives its
exceptions and the HTTP status as `code` (as vLLM does).

Left out: the request bodies of vLLM's other endpoints (embeddings, pooling, score and rerank, transcription,
the Responses API), and of these two vLLM's beam search, `min_p`, `prompt_logprobs`,
`truncate_prompt_tokens` and multimodal content; such a field is refused or warned
about as above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Strict,
    StrictBool,
    Tag,
)

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatTool",
    "CompletionRequest",
    "DetokenizeRequest",
    "GenerationRequest",
    "Int",
    "JsonSchemaFormat",
    "NamedToolChoice",
    "ResponseFormat",
    "StreamOptions",
    "StructuredOutputsRequest",
    "TokenizeRequest",
    "ToolCall",
    "error_body",
    "error_response",
    "refused_field",
    "validation_error",
]

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object for HTTP `status`."""
    error_type = _ERROR_TYPES.get(status, "APIError")
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """A JSON response carrying `error_body(status, message, param)`."""
    return JSONResponse(error_body(status, message, param), status_code=status)


INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

# A JSON integer (not a bool, not 5.0) in the signed 64-bit range (vLLM's range for `seed`; every integer
# field is held to it, so a value the engine's wire format cannot carry is a 400 naming the field).
Int = Annotated[int, Strict(), Field(ge=INT64_MIN, le=INT64_MAX)]

# A JSON number that is finite and not a bool (JSON ints are accepted as floats).
FiniteFloat = Annotated[float, Strict(), AllowInfNan(False)]

# OpenAI's chat roles ("developer" is the newer name of "system"; "tool"/"function" carry tool results).
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


# What each field accepts, in plain words (the message of a 400 for a value of the wrong type).
_FIELD_FORMS = {
    "model": "a string",
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "messages": "a non-empty list of messages, each {role, content} with role one of system, developer, "
    "user, assistant, tool, function and content a string or a list of text parts",
    "max_tokens": "an integer",
    "max_completion_tokens": "an integer",
    "temperature": "a finite number",
    "top_p": "a finite number",
    "top_k": "an integer",
    "seed": "an integer",
    "n": "an integer",
    "stop": "a string or a list of strings",
    "stop_token_ids": "a list of integer token ids",
    "min_tokens": "an integer",
    "frequency_penalty": "a finite number",
    "presence_penalty": "a finite number",
    "repetition_penalty": "a finite number",
    "logit_bias": "an object mapping token ids to finite numbers",
    "logprobs": "an integer (completions) or true / false (chat)",
    "top_logprobs": "an integer",
    "echo": "true or false",
    "ignore_eos": "true or false",
    "include_stop_str_in_output": "true or false",
    "skip_special_tokens": "true or false",
    "stream": "true or false",
    "stream_options": "an object {include_usage, continuous_usage_stats} of booleans",
    "add_generation_prompt": "true or false",
    "add_special_tokens": "true or false",
    "return_token_strs": "true or false",
    "tokens": "a list of token ids",
    "last": "an integer",
}


def validation_error(errors: Sequence[Any]) -> tuple[int, str, str | None]:
    """(status, message, param) of FastAPI's request-validation `errors` (pydantic's error dicts).

    The message names the top-level body field (or query parameter) at fault and what it accepts
    (`param` is that field; an integer outside the signed 64-bit range says so), or
    says the body is not JSON (its `loc` holds a character offset, which the message gives; `param`
    None). A value our own checks refused (a string that is not valid Unicode) keeps that check's words.
    """
    first: dict[str, Any] = dict(errors[0]) if errors else {}
    loc: list[Any] = list(first.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]  # where FastAPI found it; `param` is the field (or query parameter) itself
    message = str(first.get("msg", "invalid request"))
    ctx: dict[str, Any] = dict(first.get("ctx") or {})
    if first.get("type") == "json_invalid":
        where = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
        return 400, f"the body is not valid JSON: {ctx.get('error', message)}{where}", None
    param = loc[0] if loc and isinstance(loc[0], str) else None
    if param is None:
        return 400, "the body must be a JSON object", None
    if first.get("type") == "missing":
        return 400, f"`{param}` is required: {_FIELD_FORMS.get(param, 'a value')}", param
    if first.get("type") in ("greater_than_equal", "less_than_equal"):
        got = first.get("input")
        return 400, f"`{param}` must hold integers in [{INT64_MIN}, {INT64_MAX}] (64-bit), got {got}", param
    if first.get("type") == "value_error" and "error" in ctx:
        return 400, f"`{param}`: {ctx['error']}", param
    forms = _FIELD_FORMS.get(param)
    if forms is None:
        return 400, f"`{param}` has a value of the wrong type", param
    return 400, f"`{param}` must be {forms}", param


def _encodable(text: str) -> str:
    """`text`, unless it cannot be encoded as UTF-8 (a lone surrogate such as "\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise ValueError(
            f"the text holds {bad!r} at character {exc.start}, which is not valid Unicode (a lone surrogate)"
        ) from None
    return text


# A string that can be encoded as UTF-8 (JSON's "\ud800" escape gives a lone surrogate, which cannot).
Text = Annotated[str, AfterValidator(_encodable)]


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _TopLevel(BaseModel):
    """A request body: unknown fields are kept in `model_extra` so the server can warn about them."""

    model_config = ConfigDict(extra="allow")

    @property
    def ignored_fields(self) -> list[str]:
        """The body's fields this server does not know, sorted; the fields it refuses by name (`_REFUSED`,
        a 400 when set to a value that asks for something) are known, never called ignored."""
        return sorted(name for name in self.model_extra or {} if name not in _REFUSED)


class StreamOptions(_Base):
    """`include_usage`: a last chunk with `choices: []` and the usage (vLLM's default: on when the object
    is given); `continuous_usage_stats`: the cumulative usage on every chunk (a vLLM extension)."""

    include_usage: bool = True
    continuous_usage_stats: bool = False


# Fields other servers accept that this one does not serve, and the values that ask for nothing
# (those pass; any other value is a 400 naming the field).
_REFUSED: dict[str, tuple[object, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "chat_template": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
}


def refused_field(body: BaseModel) -> str | None:
    """The first field of `_REFUSED` that `body` sets to a value asking for something, or None."""
    extra: dict[str, Any] = dict(body.model_extra or {})
    for name, neutral in _REFUSED.items():
        value = getattr(body, name, extra.get(name))
        if value not in neutral:
            return name
    return None


class JsonSchemaFormat(_Base):
    """`response_format.json_schema`: `name`, `description`, `schema` (a JSON Schema object), `strict`."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: Text = "response"
    description: Text | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Base):
    """OpenAI's `response_format`: `{"type": "text" | "json_object" | "json_schema", "json_schema": ...}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Base):
    """vLLM's `structured_outputs` body (the fields of its StructuredOutputsParams): exactly one of `json`
    (a schema object or its JSON text), `regex`, `choice`, `grammar`, `json_object`, `structural_tag`;
    with the options `disable_any_whitespace`, `disable_additional_properties`, `whitespace_pattern`,
    `disable_fallback` (accepted: one backend, nothing to fall back to)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: StrictBool | None = None
    structural_tag: dict[str, Any] | Text | None = None
    disable_any_whitespace: StrictBool = False
    disable_additional_properties: StrictBool = False
    whitespace_pattern: Text | None = None
    disable_fallback: StrictBool = False


class FunctionDefinition(_Base):
    """A tool's `function`: `name`, `description`, `parameters` (a JSON Schema object), `strict`."""

    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatTool(_Base):
    """One entry of `tools`: `{"type": "function", "function": {...}}`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Base):
    name: Text


class NamedToolChoice(_Base):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"] = "function"
    function: NamedFunction


class GenerationRequest(_TopLevel):
    """The fields completions and chat share (model, sampling, streaming, output options)."""

    model: str | None = None
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    top_k: Int | None = None
    seed: Int | None = None
    n: Int = 1
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Int] | None = None
    min_tokens: Int = 0
    ignore_eos: StrictBool = False
    frequency_penalty: FiniteFloat | None = None
    presence_penalty: FiniteFloat | None = None
    repetition_penalty: FiniteFloat | None = None
    logit_bias: dict[str, FiniteFloat] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # refused unless neutral (refused_field)
    best_of: Any = None
    suffix: Any = None
    chat_template: Any = None

    @property
    def requested_max_tokens(self) -> tuple[str, int | None]:
        """(the field's name, its value): `max_completion_tokens` when given (it wins, as in OpenAI's
        API), else `max_tokens` (None: neither given)."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list of strings, empty ones included (serving refuses them, as vLLM does)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def num_logprobs(self) -> int | None:
        """How many top alternatives each token's logprobs carry, or None when logprobs are off."""
        return None


def _list_form(value: Any) -> str | None:
    """Which form a `prompt` (or /detokenize `tokens`) value has, told by its type and its first item,
    so that pydantic validates that one form only. Validating a union tries each form in turn, and a
    failed form keeps one error per item: a list of 4 M token ids cost 130 times its body in errors
    while it was tried as a list of strings."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    items: list[Any] = value  # pyright: ignore[reportUnknownVariableType]
    if items and isinstance(items[0], str):
        return "texts"
    if items and isinstance(items[0], list):
        return "id_lists"
    return "ids"  # ints, an empty list, or a wrong item the ids form names


# A prompt in vLLM's four forms (one validated, by `_list_form`).
Prompt = Annotated[
    Annotated[Text, Tag("text")]
    | Annotated[list[Text], Tag("texts")]
    | Annotated[list[Int], Tag("ids")]
    | Annotated[list[list[Int]], Tag("id_lists")],
    Discriminator(_list_form),
]
TokenIds = Annotated[
    Annotated[list[Int], Tag("ids")] | Annotated[list[list[Int]], Tag("id_lists")], Discriminator(_list_form)
]


class CompletionRequest(GenerationRequest):
    """POST /v1/completions. `logprobs`: k top alternatives per token (0 gives the chosen token's
    logprob alone); `echo`: the prompt's text (and with logprobs, its tokens' logprobs) before each choice."""

    prompt: Prompt
    logprobs: Int | None = None
    echo: StrictBool = False

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class _TextPart(_Base):
    type: Literal["text"] = "text"
    text: Text


class ToolCallFunction(_Base):
    name: Text
    arguments: Text


class ToolCall(_Base):
    """An assistant message's tool call: `id`, `type` "function", `function` `{name, arguments}`."""

    id: Text = ""
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Base):
    """One chat message; `content` is a string or a list of text parts (joined); an assistant message
    may carry `tool_calls`, a `tool` message its `tool_call_id` (and optionally `name`)."""

    role: ChatRole
    content: Text | list[_TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    name: Text | None = None

    def text(self) -> str:
        """The message's text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions. `logprobs: true` gives each token's logprob; `top_logprobs: k` (with
    `logprobs: true`) adds the k most probable alternatives."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    add_generation_prompt: StrictBool = True
    logprobs: StrictBool = False
    top_logprobs: Int | None = None
    echo: StrictBool = False  # vLLM's chat echo (the last message repeated) is refused when true

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_TopLevel):
    """POST /tokenize: vLLM's completion form (`prompt` in any form /v1/completions accepts, with
    `add_special_tokens`) or chat form (`messages`: the chat template writes the special tokens itself)."""

    model: str | None = None
    prompt: Prompt | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(_TopLevel):
    """POST /detokenize: `tokens` is a list of token ids (or, like `prompt`, a list of token-id lists)."""

    model: str | None = None
    tokens: TokenIds
