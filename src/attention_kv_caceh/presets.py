"""Attention shapes of real models, to relate the lab's toy shapes to real ones.

Numbers from each model's published `config.json` (num_attention_heads, num_key_value_heads, head_dim or
hidden_size / num_attention_heads, num_hidden_layers, max_position_embeddings). Only the attention
shape matters here; the lab times one layer's attention.

`resolve_shape` is the one place a command turns `--model` / `--num-heads` / `--num-kv-heads` /
`--head-dim` into a shape, and `kv_cache_bytes` the one formula for the bytes of a KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "MODEL_PRESETS",
    "AttentionShape",
    "ResolvedShape",
    "get_preset",
    "kv_cache_bytes",
    "resolve_shape",
]


@dataclass(frozen=True)
class AttentionShape:
    """One model's attention shape: H query heads, H_kv KV heads, head dim D, and its layers."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    max_position_embeddings: int

    def __post_init__(self) -> None:
        for field in (
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_layers",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            if value < 1:
                raise ValueError(f"{field} must be >= 1, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )

    def kv_bytes_per_token(self, dtype: npt.DTypeLike = np.float16, *, all_layers: bool = True) -> int:
        """Bytes of K and V one token occupies: 2 * H_kv * D * itemsize (* layers if all_layers)."""
        per_layer = kv_cache_bytes(1, self.num_kv_heads, 1, self.head_dim, np.dtype(dtype).itemsize)
        return per_layer * (self.num_layers if all_layers else 1)


MODEL_PRESETS: dict[str, AttentionShape] = {
    shape.name: shape
    for shape in (
        AttentionShape(
            "gpt2",
            num_heads=12,
            num_kv_heads=12,
            head_dim=64,
            num_layers=12,
            max_position_embeddings=1024,
        ),
        AttentionShape(
            "llama-3-8b",
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            num_layers=32,
            max_position_embeddings=8192,
        ),
        AttentionShape(
            "llama-3-70b",
            num_heads=64,
            num_kv_heads=8,
            head_dim=128,
            num_layers=80,
            max_position_embeddings=8192,
        ),
        AttentionShape(
            "qwen3-0.6b",
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            num_layers=28,
            max_position_embeddings=40960,
        ),
        AttentionShape(
            "qwen3-8b",
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            num_layers=36,
            max_position_embeddings=40960,
        ),
        AttentionShape(
            "mistral-7b",
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            num_layers=32,
            max_position_embeddings=32768,
        ),
    )
}


def get_preset(name: str) -> AttentionShape:
    """Look up a preset by name (case-insensitive). Raises ValueError listing the known names."""
    key = name.lower()
    if key not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(MODEL_PRESETS)}")
    return MODEL_PRESETS[key]


def kv_cache_bytes(batch_size: int, num_kv_heads: int, positions: int, head_dim: int, itemsize: int) -> int:
    """Bytes of K and V for `positions` cached positions of one layer: 2 x B x H_kv x T x D x itemsize.

    The factor 2 is K and V; multiply by the number of layers for a whole model.
    """
    return 2 * batch_size * num_kv_heads * positions * head_dim * itemsize


@dataclass(frozen=True)
class ResolvedShape:
    """The attention shape a command runs: H, H_kv, D, and the preset's canonical name (or "")."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    model: str = ""


def resolve_shape(
    model: str | None,
    num_heads: int | None,
    num_kv_heads: int | None,
    head_dim: int | None,
    *,
    default_num_heads: int,
    default_head_dim: int,
) -> ResolvedShape:
    """The shape every command uses, with one precedence.

    Explicit values (not None) win; otherwise H and D come from the preset `model` (case-insensitive),
    or from the defaults when no preset is named; H_kv comes from the preset, or equals H when no preset
    is named. So `--model llama-3-8b --num-heads 16` gives H=16, H_kv=8, D=128 in every command.
    Validity (H a multiple of H_kv, sizes >= 1) is checked by the config the shape goes into.

    Raises ValueError for an unknown preset name (listing the known ones).
    """
    preset = get_preset(model) if model else None
    heads = num_heads if num_heads is not None else (preset.num_heads if preset else default_num_heads)
    fallback_kv_heads = preset.num_kv_heads if preset else heads
    kv_heads = num_kv_heads if num_kv_heads is not None else fallback_kv_heads
    dim = head_dim if head_dim is not None else (preset.head_dim if preset else default_head_dim)
    return ResolvedShape(heads, kv_heads, dim, preset.name if preset else "")
