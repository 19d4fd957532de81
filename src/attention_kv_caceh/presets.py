"""Attention shapes of real models, to relate the lab's toy shapes to real ones.

Numbers from each model's published `config.json` (num_attention_heads, num_key_value_heads, head_dim or
hidden_size / num_attention_heads, num_hidden_layers, max_position_embeddings). Only the attention
shape matters here; the lab times one layer's attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["MODEL_PRESETS", "AttentionShape", "get_preset"]


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
        per_layer = 2 * self.num_kv_heads * self.head_dim * np.dtype(dtype).itemsize
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
