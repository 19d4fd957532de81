"""Request and error shapes of the OpenAI-compatible server (pydantic models).

Corresponds to vLLM's `vllm/entrypoints/openai/protocol.py`, reduced to the fields this server honours:
sampling (`max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop` strings,
`ignore_eos`), `n = 1`, streaming with `stream_options` (`include_usage`, `continuous_usage_stats`), and
vLLM's `/tokenize` and `/detokenize` bodies. Unknown fields are ignored (as vLLM does); a known field of the
wrong type is a 400. Errors use OpenAI's body: `{"error": {"message", "type", "param", "code"}}`, with the
`type` names the openai client gives its exceptions and the HTTP status as `code` (as vLLM does).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

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
]

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
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
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    n: int = 1
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

    role: str
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

    messages: list[ChatMessage]
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
