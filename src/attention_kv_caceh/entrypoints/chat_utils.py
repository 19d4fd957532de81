"""Chat prompts: the checkpoint's Jinja2 chat template, or a documented plain one.

Corresponds to vLLM's `vllm/entrypoints/chat_utils.py` (apply_hf_chat_template) at a small size. A Hugging
Face checkpoint keeps its template in `tokenizer_config.json` under `chat_template` (a string, or a list of
`{"name", "template"}` of which "default" is used), a GGUF file in its `tokenizer.chat_template` metadata.
It is rendered the way transformers renders it: a
sandboxed Jinja2 environment with `trim_blocks` and `lstrip_blocks`, `raise_exception(msg)`, a `tojson`
that keeps non-ASCII characters, `strftime_now(fmt)`, and the variables `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, and `tools` when the request gives them (as
`apply_chat_template(tools=...)`; assistant messages keep their `tool_calls`, tool messages their
`tool_call_id`).

Without a template the server uses `PLAIN_CHAT_TEMPLATE`: one line `role: content` per message, then
`assistant: ` when a generation prompt is asked for.

Left out: multimodal content parts (images, audio, video), `chat_template_kwargs`, a template given on the command line (`--chat-template`), and the detection of the
template's content format (a list of text parts is joined into one string here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint

__all__ = ["PLAIN_CHAT_TEMPLATE", "ChatTemplate", "load_chat_template"]

PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja2 chat template and the special tokens it may use."""

    source: str = PLAIN_CHAT_TEMPLATE
    bos_token: str = ""
    eos_token: str = ""

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for `messages` (each with `role` and `content`, maybe `tool_calls`), with
        `tools` (OpenAI's tool objects) when given.

        Raises ValueError when the template fails (a syntax error, or its own `raise_exception`).
        """
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception  # pyright: ignore[reportArgumentType]
        env.globals["strftime_now"] = _strftime_now  # pyright: ignore[reportArgumentType]
        try:
            template = env.from_string(self.source)
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=tools,
            )
        except TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc


def _token_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        content = cast(dict[str, Any], value).get("content")
        return content if isinstance(content, str) else ""
    return ""


def load_chat_template(model_dir: str | Path) -> ChatTemplate | None:
    """The chat template of a Hugging Face folder, or None when there is none: `model_dir/chat_template.jinja`
    when that file exists (transformers writes the template there and, when loading, prefers it over the
    `chat_template` key of `tokenizer_config.json`), else that key; the BOS/EOS texts from
    `tokenizer_config.json`. For a GGUF file (`model_source.gguf_file_of`: a file, a folder holding one, a
    model name), the template in its `tokenizer.chat_template` metadata.

    Raises ValueError when tokenizer_config.json exists but is not a JSON object, chat_template.jinja is not
    readable UTF-8 text, or the GGUF file is unreadable.
    """
    from attention_kv_caceh.model_executor.model_source import gguf_file_of

    gguf = gguf_file_of(model_dir)
    if gguf is not None:
        from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint

        return _chat_template_from_gguf(GGUFCheckpoint(gguf))
    path = Path(model_dir) / "tokenizer_config.json"
    jinja = Path(model_dir) / "chat_template.jinja"
    config: dict[str, Any] = {}
    if path.is_file():
        try:
            raw: Any = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not readable JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object")
        config = cast(dict[str, Any], raw)
    template: Any = config.get("chat_template")
    if jinja.is_file():
        try:
            template = jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{jinja}: not readable UTF-8 text ({exc})") from exc
    if isinstance(template, list):
        named: dict[str, str] = {}
        for item in cast(list[Any], template):
            if isinstance(item, dict):
                entry = cast(dict[str, Any], item)
                name, source = entry.get("name"), entry.get("template")
                if isinstance(name, str) and isinstance(source, str):
                    named[name] = source
        template = named.get("default")
    if not isinstance(template, str):
        return None
    return ChatTemplate(
        template,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
    )


def _chat_template_from_gguf(ckpt: GGUFCheckpoint) -> ChatTemplate | None:
    """The file's `tokenizer.chat_template` with its BOS / EOS token text, or None when it has none."""
    template = ckpt.metadata("tokenizer.chat_template")
    if not isinstance(template, str):
        return None
    tokens: Any = ckpt.metadata("tokenizer.ggml.tokens") or []

    def text(key: str) -> str:
        value: Any = ckpt.metadata(f"tokenizer.ggml.{key}")
        return tokens[value] if isinstance(value, int) and 0 <= value < len(tokens) else ""

    return ChatTemplate(template, bos_token=text("bos_token_id"), eos_token=text("eos_token_id"))
