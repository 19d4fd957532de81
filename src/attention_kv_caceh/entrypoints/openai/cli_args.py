"""ServeConfig: the flags of `serve` that are not the engine's (vLLM's `FrontendArgs`).

vLLM declares its server's own flags (host, port, API key, limits of the HTTP front end) on a dataclass
in `vllm/entrypoints/openai/cli_args.py`, beside the engine's (`EngineArgs`); here they are the fields
of `ServeConfig` (`options.option`: flag, help, bounds), and the engine's are EngineConfig's. Each check
is in `__post_init__`, naming the field (the CLI shows its flag).

Left out, against vLLM's FrontendArgs: TLS, CORS, the root path, the tool-call and reasoning parsers,
LoRA modules, a chat template given as a flag (the checkpoint's own is read), uvicorn's log level and
access log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from attention_kv_caceh.engine.config import model_option
from attention_kv_caceh.options import ConfigError, check_options, option

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "DEFAULT_MAX_SEQS_PER_REQUEST", "ServeConfig"]

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024  # the server's default (not imported: it loads FastAPI)
DEFAULT_MAX_SEQS_PER_REQUEST = 4096  # the serving layer's default

_API_KEY_REFUSED = (
    "not taken here: put the key in an environment variable and give its name with --api-key-env VAR "
    "(a key on the command line shows in ps)"
)


def _refuse_api_key(_value: str) -> str:
    """vLLM's `--api-key KEY` is refused with what to give instead (the flag parser would otherwise read it as
    an abbreviation of --api-key-env and name the key as a variable)."""
    raise ValueError(_API_KEY_REFUSED)


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """What `serve` listens on and the limits of its HTTP front end (the engine's are EngineConfig's)."""

    model: str = model_option()
    served_model_name: str | None = option(
        None,
        help="model name clients send (default: the model's name, the .gguf file's stem or the folder's name)",
        metavar="NAME",
    )
    host: str = option(
        "127.0.0.1", help="address to listen on; a non-loopback one without --api-key-env prints a warning"
    )
    port: int = option(
        8000, help="port in 0..65535 (0: any free port)", metavar="PORT", minimum=0, maximum=65535
    )
    engine_core_cpu: int | None = option(
        None,
        help="pin the engine-core process to this CPU (os.sched_setaffinity) and the API process to the "
        "others (default: no pinning, the OS places both)",
        metavar="CPU",
        minimum=0,
    )
    api_key_env: str | None = option(
        None,
        help="require `Authorization: Bearer <key>` with the key read from this environment variable "
        "(default: no key)",
        metavar="VAR",
    )
    api_key: str | None = option(None, help="", hidden=True, parse=_refuse_api_key, repr=False)
    max_queue: int | None = option(
        None, help="answer 503 when more than N requests would wait (default: no limit)", minimum=0
    )
    max_logprobs: int = option(
        20,
        help="most `logprobs` / `top_logprobs` a request may ask for (vLLM's flag; above it: 400)",
        metavar="K",
        minimum=0,
    )
    max_seqs_per_request: int = option(
        DEFAULT_MAX_SEQS_PER_REQUEST,
        help="most engine requests one request may fan out to (its prompts times `n`; above it: 400)",
        minimum=1,
    )
    enable_auto_tool_choice: bool = option(
        False,
        help="serve `tool_choice: auto` (vLLM's flag; needs --tool-call-parser)",
        default_text="off",
    )
    tool_call_parser: str | None = option(
        None,
        help="how tool calls are read from the model's text for `tool_choice: auto` (vLLM's flag)",
        choices=("hermes",),
        default_text="none",
    )
    drain_timeout: float = option(
        30.0, help="seconds running requests get to finish at Ctrl-C / SIGTERM", metavar="S", minimum=0.0
    )
    max_request_bytes: int = option(
        DEFAULT_MAX_REQUEST_BYTES,
        help="refuse a request body larger than N bytes with 413, before reading or parsing it",
        minimum=1,
    )
    max_request_bytes_in_flight: int | None = option(
        None,
        help="bodies of 256 KiB or more served at once may total N bytes; one past it gets 503 with "
        "Retry-After (default: 4 x --max-request-bytes; at least --max-request-bytes)",
        minimum=1,
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("served_model_name", f"must name the model, got {self.served_model_name!r}")
        if self.api_key is not None:
            raise ConfigError("api_key", _API_KEY_REFUSED)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("enable_auto_tool_choice", "needs --tool-call-parser (hermes)")
        if not math.isfinite(self.drain_timeout):
            raise ConfigError("drain_timeout", f"must be a finite number, got {self.drain_timeout}")
        if self.bytes_in_flight < self.max_request_bytes:
            raise ConfigError(
                "max_request_bytes_in_flight",
                f"{self.bytes_in_flight} is below --max-request-bytes {self.max_request_bytes}: a body of "
                "the largest size could never be served",
            )

    @property
    def bytes_in_flight(self) -> int:
        """--max-request-bytes-in-flight, or its default: 4 x --max-request-bytes."""
        return self.max_request_bytes_in_flight or 4 * self.max_request_bytes
