"""Options declared once, on the config dataclass: each field carries its flag, help and bounds.

vLLM derives its engine flags from the fields of its config dataclasses (`vllm/engine/arg_utils.py`,
`EngineArgs.add_cli_args`); this module is the library half of the same idea, with no argparse in it:

    @dataclass(frozen=True)
    class ScanConfig:
        seq_len: int = option(128, help="cached positions T before the step", metavar="T", minimum=1)

        def __post_init__(self) -> None:
            check_options(self)            # bounds and choices of every option field
            if self.num_heads % self.num_kv_heads:
                raise ConfigError("num_kv_heads", f"must divide num_heads={self.num_heads}")

`cli/flags.py` builds the parser from these fields (`add_options`) and the config from the parsed
flags (`config_from_args`), turning a ConfigError's field into its flag (`--seq-len: must be >= 1, got
0`). A library caller sees the field (`seq_len: must be >= 1, got 0`). A new flag is one field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass
from typing import Any, cast

__all__ = ["ConfigError", "Option", "check_field", "check_options", "flag_of", "option", "option_fields"]


class ConfigError(ValueError):
    """A config field holds a value the config refuses.

    `field` is the dataclass field's name, `message` the reason without the name (it names the bad
    value); `owner` the config class that declares the field (None: the class being built). str() is
    "field: message"; the CLI prints "--flag: message" instead (`cli.flags.config_from_args`).
    """

    def __init__(self, field: str, message: str, owner: type | None = None) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.owner = owner


@dataclass(frozen=True)
class Option:
    """What a config field says about its command-line flag (stored in the field's metadata).

    `parse` turns the flag's text into the field's value (raising ValueError with a reason); None: the
    type of the default (int, float or str). `minimum`/`maximum` (inclusive) and `choices` are checked by
    `check_options` on every construction, from the CLI or not. A bool field is a switch: `--flag` sets
    True, or, for a flag starting `--no-`, False. `exclusive` names a group of flags of which at most
    one may be given (argparse's mutually exclusive group). `default_text` replaces the shown default.
    `required`: the flag must be given (for a member of an `exclusive` group: one of the group must be).
    `hidden`: the flag is parsed but left out of --help (a flag kept only to be refused with advice).
    `extend`: with `nargs`, the flag may be given again, each adding its values (argparse's "extend").
    `negatable`: a bool field with both `--flag` (True) and `--no-flag` (False).
    """

    help: str
    flag: str | None = None
    metavar: str | None = None
    choices: tuple[Any, ...] | None = None
    parse: Callable[[str], Any] | None = None
    minimum: float | None = None
    maximum: float | None = None
    nargs: str | None = None
    exclusive: str | None = None
    default_text: str | None = None
    required: bool = False
    extend: bool = False
    hidden: bool = False
    negatable: bool = False


def option(
    default: Any = MISSING,
    *,
    help: str,
    default_factory: Callable[[], Any] | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    choices: Sequence[Any] | None = None,
    parse: Callable[[str], Any] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    nargs: str | None = None,
    exclusive: str | None = None,
    default_text: str | None = None,
    required: bool = False,
    extend: bool = False,
    hidden: bool = False,
    negatable: bool = False,
    repr: bool = True,
) -> Any:
    """A dataclass field that is also a command-line option (see `Option` for the arguments)."""
    meta = Option(
        help=help,
        flag=flag,
        metavar=metavar,
        choices=None if choices is None else tuple(choices),
        parse=parse,
        minimum=minimum,
        maximum=maximum,
        nargs=nargs,
        exclusive=exclusive,
        default_text=default_text,
        required=required,
        extend=extend,
        hidden=hidden,
        negatable=negatable,
    )
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={"option": meta}, repr=repr)
    return dataclasses.field(default=default, metadata={"option": meta}, repr=repr)


def option_fields(cls: type) -> list[tuple[dataclasses.Field[Any], Option]]:
    """The fields of dataclass `cls` declared with `option`, in declaration order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata]


def flag_of(cls: type, field: str) -> str:
    """The flag of `cls`'s field `field` (`--` + the name with dashes unless the option names one);
    the field's own name when it is not an option."""
    for f, meta in option_fields(cls):
        if f.name == field:
            return meta.flag or "--" + f.name.replace("_", "-")
    return field


def _check_value(name: str, value: Any, meta: Option, owner: type) -> None:
    if meta.choices is not None and value not in meta.choices:
        shown = ", ".join(str(c) for c in meta.choices)
        raise ConfigError(name, f"must be one of {shown}, got {value!r}", owner)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError(name, "must be a number, got nan", owner)
    if meta.minimum is not None and value < meta.minimum:
        raise ConfigError(name, f"must be >= {_number(meta.minimum)}, got {value!r}", owner)
    if meta.maximum is not None and value > meta.maximum:
        raise ConfigError(name, f"must be <= {_number(meta.maximum)}, got {value!r}", owner)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**63 else str(x)


def check_field(cls: type, name: str, value: Any) -> None:
    """Check one value of field `name` of dataclass `cls` against its bounds and choices (None passes),
    without building the config: for a value passed on before its config is built.

    Raises:
        ConfigError: naming the field and the value.
    """
    for f, meta in option_fields(cls):
        if f.name == name and value is not None:
            items = cast(tuple[Any, ...], tuple(value) if isinstance(value, tuple | list) else (value,))  # pyright: ignore[reportUnknownArgumentType]
            for item in items:
                _check_value(name, item, meta, cls)


def check_options(config: Any) -> None:
    """Check every option field of dataclass instance `config` against its bounds and choices (each
    element of a tuple or list value on its own); None is "not given" and passes.

    Raises:
        ConfigError: naming the first field out of bounds and its value.
    """
    owner: type[Any] = type(config)  # pyright: ignore[reportUnknownVariableType]
    for f, meta in option_fields(owner):
        value: Any = getattr(config, f.name)
        if value is None:
            continue
        items = cast(tuple[Any, ...], tuple(value) if isinstance(value, tuple | list) else (value,))  # pyright: ignore[reportUnknownArgumentType]
        for item in items:
            _check_value(f.name, item, meta, owner)
