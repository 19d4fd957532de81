"""Request and error shapes of the OpenAI-compatible server (pydantic models).

Corresponds to vLLM's `vllm/entrypoints/openai/protocol.py`, reduced to the fields this server honours:
sampling (`max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop` strings,
`ignore_eos`), `n = 1`, streaming with `stream_options` (`include_usage`, `continuous_usage_stats`), and
vLLM's `/tokenize` and `/detokenize` bodies. Unknown fields are ignored (as vLLM does); a known field of the
wrong type is a 400: integer fields are strict (a bool or a float such as `true` or `5.0` is refused, not read
as 1 or 5), float fields refuse bools, NaN and +-Infinity (Python's json module accepts those literals).
`logprobs`, `top_logprobs` and `echo` are parsed only so that asking for them is a 400 "not supported"
instead of being silently ignored. Chat `messages` must be non-empty with roles from OpenAI's set. Errors use OpenAI's body: `{"error": {"message", "type", "param", "code"}}`, with the
`type` names the openai client gives its exceptions and the HTTP status as `code` (as vLLM does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "GenerationRequest",
    "StreamOptions",
    "TokenizeRequest",
    "error_body",
    "error_response",
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


# A JSON number that is finite and not a bool (JSON ints are accepted as floats).
FiniteFloat = Annotated[float, Strict(), AllowInfNan(False)]

# OpenAI's chat roles ("developer" is the newer name of "system"; "tool"/"function" carry tool results).
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


def validation_error(errors: Sequence[Any]) -> tuple[int, str, str | None]:
    """(status, message, param) of FastAPI's request-validation `errors` (pydantic's error dicts).

    `param` is the top-level body field at fault, or None when no field is (a body that is not JSON: its
    `loc` holds a character offset, which the message gives instead).
    """
    first: dict[str, Any] = dict(errors[0]) if errors else {}
    loc: list[Any] = [part for part in first.get("loc", ()) if part != "body"]
    message = str(first.get("msg", "invalid request"))
    if first.get("type") == "json_invalid":
        ctx: dict[str, Any] = dict(first.get("ctx") or {})
        where = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
        return 400, f"the body is not valid JSON: {ctx.get('error', message)}{where}", None
    if loc:
        message = f"{'.'.join(str(part) for part in loc)}: {message}"
    param = loc[0] if loc and isinstance(loc[0], str) else None
    return 400, message, param


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    """`include_usage`: a last chunk with `choices: []` and the usage (vLLM's default: on when the object
    is given); `continuous_usage_stats`: the cumulative usage on every chunk (a vLLM extension)."""

    include_usage: bool = True
    continuous_usage_stats: bool = False


class GenerationRequest(_Base):
    """The fields completions and chat share (model, sampling, streaming)."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    n: StrictInt = 1
    # not supported: parsed so that a request for them is refused (sampling_params_for), not ignored
    logprobs: StrictBool | StrictInt | None = None
    top_logprobs: StrictInt | None = None
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list of non-empty strings."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]


class CompletionRequest(GenerationRequest):
    """POST /v1/completions: `prompt` is a text or a list of token ids."""

    prompt: str | list[int]


class _TextPart(_Base):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(_Base):
    """One chat message; `content` is a string or a list of text parts (joined)."""

    role: ChatRole
    content: str | list[_TextPart] | None = None

    def text(self) -> str:
        """The message's text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True


class TokenizeRequest(_Base):
    """POST /tokenize: vLLM's completion form (`prompt`, with `add_special_tokens`) or chat form
    (`messages`: the chat template writes the special tokens itself)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Base):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]
