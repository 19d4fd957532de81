"""The attention shape a lab command measures, as options: H, H_kv and D, or a real model's preset.

One group of fields for every command that takes a shape (the scan, `cache`): each field is a flag
(`options.option`), None meaning "not given", so that `resolve` can tell an explicit value from a
preset's (`presets.resolve_shape`: explicit values win, then the preset, then the command's defaults).
The resolved numbers go into the command's config (`ScanConfig`, `CacheGrowthConfig`), which checks
them (H a multiple of H_kv).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attention_kv_caceh.options import ConfigError, check_options, option
from attention_kv_caceh.presets import MODEL_PRESETS, ResolvedShape, get_preset, resolve_shape

__all__ = ["SHAPE_FIELDS", "ShapeOptions", "check_shape", "preset_name"]


def preset_name(text: str) -> str:
    """A model preset name in any case -> its canonical (lower-case) name. Raises ValueError listing
    the known presets."""
    return get_preset(text).name


@dataclass(frozen=True)
class ShapeOptions:
    """H, H_kv, D and a preset as given (None: not given); `resolve` gives the shape a command runs."""

    num_heads: int | None = option(
        None, help="query heads", metavar="H", minimum=1, default_text="the model's"
    )
    num_kv_heads: int | None = option(
        None, help="KV heads", metavar="H_KV", minimum=1, default_text="the model's, or H"
    )
    head_dim: int | None = option(None, help="head dim", metavar="D", minimum=1, default_text="the model's")
    model: str | None = option(
        None,
        help="take H, H_kv and D from a real model (any case): "
        f"{', '.join(sorted(MODEL_PRESETS))}; explicit flags win",
        metavar="PRESET",
        parse=preset_name,
        default_text="none",
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.model is not None:
            try:
                get_preset(self.model)
            except ValueError as exc:
                raise ConfigError("model", str(exc)) from None

    def resolve(self, default_num_heads: int, default_head_dim: int) -> ResolvedShape:
        """The shape (`presets.resolve_shape`), with the command's defaults for what neither the
        fields nor the preset give."""
        return resolve_shape(
            self.model,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            default_num_heads=default_num_heads,
            default_head_dim=default_head_dim,
        )

    @staticmethod
    def default_texts(num_heads: int, head_dim: int) -> dict[str, str]:
        """What the help shows as the defaults of a command whose own defaults are H and D."""
        return {"num_heads": f"{num_heads}, or the model's", "head_dim": f"{head_dim}, or the model's"}


SHAPE_FIELDS = ("num_heads", "num_kv_heads", "head_dim", "model")


def check_shape(config: Any) -> None:
    """The shape fields of a lab config (`num_heads`, `num_kv_heads`, `head_dim`): sizes >= 1 and H a
    multiple of H_kv. Raises ConfigError naming the field."""
    for name in ("num_heads", "num_kv_heads", "head_dim"):
        value: Any = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
    if config.num_heads % config.num_kv_heads:
        raise ConfigError(
            "num_kv_heads",
            f"must divide the query heads (num_heads={config.num_heads}), got {config.num_kv_heads}",
        )
