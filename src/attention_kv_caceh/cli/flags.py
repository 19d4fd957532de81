"""The one builder of flags: argparse options made from config dataclass fields (`options.option`).

    add_options(parser, ScanConfig)                   # one flag per option field, defaults from the class
    config = config_from_args(ScanConfig, args)       # ConfigError -> UsageError naming the flag

This is the CLI half of `options.py`, as vLLM's `EngineArgs.add_cli_args` reads its dataclass fields.
argparse only turns text into values here (an int, a float, the option's `parse`); every bound and
choice is checked once, by the config's `__post_init__` (`options.check_options`), and its message,
which names the field, is shown with the field's flag. Exit code 2 for both, through UsageError.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from attention_kv_caceh.cli.common import UsageError
from attention_kv_caceh.options import ConfigError, Option, flag_of, option_fields

__all__ = ["add_options", "add_shaped_options", "config_from_args", "shaped_config", "usage_error"]

T = TypeVar("T")

Target = argparse.ArgumentParser | argparse._ArgumentGroup  # pyright: ignore[reportPrivateUsage]


def _value_type(cls: type, name: str) -> type | None:
    """The field's annotated type with None taken out (`int | None` -> int); None when it is not one
    plain type."""
    try:
        hint: Any = typing.get_type_hints(cls)[name]
    except NameError:  # an annotation naming a type imported only for type checking
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_args(hint) else [hint]
    return args[0] if len(args) == 1 and isinstance(args[0], type) else None


def _converter(name: str, meta: Option, value_type: type | None) -> Callable[[str], Any]:
    """argparse `type=` of one field: the option's `parse`, else its annotated type (int, float, str)."""
    base: Callable[[str], Any] = meta.parse or (value_type if value_type in (int, float) else str)  # pyright: ignore[reportAssignmentType]
    what = "an integer" if base is int else "a number" if base is float else ""

    def convert(text: str) -> Any:
        try:
            return base(text)
        except ValueError as exc:
            reason = f"expected {what}, got {text!r}" if what else str(exc)
            raise argparse.ArgumentTypeError(reason) from None

    convert.__name__ = name  # argparse names the type in some messages
    return convert


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def add_options(
    target: Target,
    cls: type,
    *,
    only: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
    default_texts: Mapping[str, str] | None = None,
    dest_prefix: str = "",
) -> None:
    """Declare one flag per option field of dataclass `cls` on `target` (a parser or an argument group).

    `only`/`exclude`: field names to declare or leave out. `defaults`: field -> the flag's default when
    it differs from the field's (None: "not given", which the help shows as the option's
    `default_text`, else as the field's own default when the help names none). `default_texts`: field
    -> the shown default when it differs from the option's `default_text` (a field shared by commands
    whose defaults differ). The flag's dest is the field's name, after `dest_prefix` (two configs in one
    parser whose fields share a name: `trace_` + `block_size`). An option's `required` makes a required
    flag (or a required exclusive group), its `extend` argparse's "extend" action.
    """
    wanted = None if only is None else set(only)
    skipped = set(exclude)
    groups: dict[str, Any] = {}
    for field, meta in option_fields(cls):
        if (wanted is not None and field.name not in wanted) or field.name in skipped:
            continue
        default = (defaults or {}).get(field.name, _default(field))
        flag = flag_of(cls, field.name)
        place: Any = target
        if meta.exclusive is not None:
            if meta.exclusive not in groups:
                groups[meta.exclusive] = target.add_mutually_exclusive_group()
            place = groups[meta.exclusive]
            if meta.required:
                place.required = True
        text = (default_texts or {}).get(field.name, meta.default_text)
        help_text = meta.help if text is None else f"{meta.help} (default: {text})"
        shown = _default(field)
        if default is None and shown not in (None, False) and "(default" not in help_text:
            help_text = f"{help_text} (default: {shown})"  # not given here: the config applies its own
        if meta.hidden:
            help_text = argparse.SUPPRESS
        value_type = _value_type(cls, field.name)
        dest = dest_prefix + field.name
        if value_type is bool:
            action: Any = "store_false" if flag.startswith("--no-") else "store_true"
            if meta.negatable:
                action = argparse.BooleanOptionalAction
            place.add_argument(flag, dest=dest, action=action, default=default, help=help_text)
            continue
        kwargs: dict[str, Any] = {"dest": dest, "default": default, "help": help_text}
        if meta.required and meta.exclusive is None:
            kwargs["required"] = True
        if meta.extend:
            kwargs["action"] = "extend"
        if meta.choices is not None and meta.parse is None:
            kwargs["choices"] = meta.choices
        else:
            kwargs["type"] = _converter(field.name, meta, value_type)
            kwargs["metavar"] = meta.metavar or ("N" if value_type is int else None)
        if meta.nargs is not None:
            kwargs["nargs"] = meta.nargs
        place.add_argument(flag, **kwargs)


def usage_error(cls: type, exc: ValueError, *owners: type) -> UsageError:
    """The UsageError of a config's refusal: a ConfigError's field shown as its flag (looked up in its
    owner, else in `cls` and `owners`); any other ValueError as it is."""
    if isinstance(exc, ConfigError):
        for candidate in (exc.owner, cls, *owners):
            if candidate is not None and flag_of(candidate, exc.field) != exc.field:
                return UsageError(f"{flag_of(candidate, exc.field)}: {exc.message}")
    return UsageError(str(exc))


def config_from_args(
    cls: type[T], args: argparse.Namespace, *owners: type, dest_prefix: str = "", **values: Any
) -> T:
    """`cls` built from the parsed flags (every option field present in `args`, under `dest_prefix` +
    its name) and `values`, which win. Raises UsageError (exit 2) naming the flag when the config
    refuses a value; `owners`: nested config classes whose fields a ConfigError may name."""
    kwargs = {
        f.name: getattr(args, dest_prefix + f.name)
        for f, _ in option_fields(cls)
        if hasattr(args, dest_prefix + f.name)
    }
    kwargs.update(values)
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise usage_error(cls, exc, *owners) from None


def add_shaped_options(
    parser: Target, config: type, options: type, lead: tuple[str, ...], num_heads: int, head_dim: int
) -> None:
    """The flags of a lab command over a model's attention shape (the scan, cache), in --help's order:
    `options`' --csv, `config`'s `lead` fields, the shape (`ShapeOptions`, whose help shows the command's
    defaults `num_heads` and `head_dim`), then the rest of `config`'s fields and of `options`'."""
    from attention_kv_caceh.experiments.shape import ShapeOptions

    add_options(parser, options, only=("csv",))
    add_options(parser, config, only=lead)
    add_options(parser, ShapeOptions, default_texts=ShapeOptions.default_texts(num_heads, head_dim))
    add_options(parser, config, exclude=lead)
    add_options(parser, options, exclude=("csv",))


def shaped_config(cls: type[T], args: argparse.Namespace, num_heads: int, head_dim: int) -> T:
    """The validated `cls` (ScanConfig, CacheGrowthConfig) of parsed flags, its shape resolved by
    `ShapeOptions.resolve` (explicit flags, then the --model preset, then the command's `num_heads` and
    `head_dim`). Raises UsageError naming the flag of a value either refuses."""
    from attention_kv_caceh.experiments.shape import ShapeOptions

    shape = config_from_args(ShapeOptions, args).resolve(num_heads, head_dim)
    return config_from_args(cls, args, ShapeOptions, **dataclasses.asdict(shape))
