"""ModelConfig: the architecture settings of a Hugging Face `config.json` that the NumPy model implements.

What vLLM's `transformers_utils/config.py` + `config/model.py` do for one folder: read the keys the Llama /
Mistral / Qwen2 / Qwen3 classes of Hugging Face transformers define (`LlamaConfig` etc.), fill their
documented defaults, and refuse, with one CheckpointError naming the file and key, a setting the NumPy model
would silently get wrong (another architecture, activation, a RoPE scaling other than llama3's, sliding
window).

Left out: hub configs and `trust_remote_code`, every architecture but these four, RoPE scaling other than
llama3's, sliding windows, mixture-of-experts, quantization configs, and the rest of vLLM's ModelConfig (dtype
resolution, max_model_len derivation, tokenizer mode, pooling and multimodal settings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from attention_kv_caceh.model_executor.checkpoint import CheckpointError

__all__ = ["LAYER_TYPES", "SUPPORTED_ARCHITECTURES", "ModelConfig"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
LAYER_TYPES = ("full_attention", "sliding_attention")
"""The entries of ModelConfig.layer_types (Hugging Face transformers' names)."""
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder shapes and settings (Hugging Face config.json names).

    qkv_bias / o_proj_bias: biases on the q/k/v and o projections (Qwen2: q/k/v only; Llama, Mistral
    and Qwen3: both or neither, `attention_bias`). qk_norm: Qwen3's per-head RMSNorm of q and k.
    rope_scaling: None or the "llama3" parameters. eos_token_ids: every end-of-sequence id listed.
    sliding_window: keys a sliding layer's query at position p attends, (p - sliding_window, p]; None:
    no sliding layer. layer_types: one entry per layer, "full_attention" or "sliding_attention"
    (transformers' `layer_types`); empty: every layer full attention.

    Raises ValueError for non-positive sizes or heads that do not divide.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    qkv_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, float] | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        sizes = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embedding, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers={self.num_hidden_layers}"
            )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types entry {bad[0]!r} is not one of {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError(
                f"rope_theta and rms_norm_eps must be > 0, got {self.rope_theta}, {self.rms_norm_eps}"
            )

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id, or None."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], source: str | Path = "config.json") -> ModelConfig:
        """Build from a parsed config.json; `source` names the file in error messages.

        Defaults follow transformers' config classes: num_key_value_heads = num_attention_heads,
        head_dim = hidden_size // num_attention_heads, tie_word_embeddings False, attention_bias False.
        Raises CheckpointError (naming `source` and the key) for a missing required key, an unsupported
        architecture, hidden_act other than "silu", mlp_bias, an active sliding window, or a
        rope_scaling type other than none/"default"/"llama3".
        """

        def fail(key: str, why: str) -> CheckpointError:
            return CheckpointError(f"{source}: key {key!r}: {why}")

        def need(key: str) -> Any:
            if key not in hf:
                raise fail(key, "missing")
            return hf[key]

        archs: Any = need("architectures")
        arch = _first_architecture(archs)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise fail(
                "architectures", f"unsupported {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise fail("hidden_act", f"only 'silu' (SwiGLU) is implemented, got {hf['hidden_act']!r}")
        if hf.get("mlp_bias", False):
            raise fail("mlp_bias", "MLP biases are not implemented")
        window_on = hf.get("use_sliding_window", arch == "MistralForCausalLM")
        if window_on and hf.get("sliding_window") is not None:
            raise fail(
                "sliding_window", f"sliding-window attention is not implemented ({hf['sliding_window']})"
            )
        # transformers >= 5 writes `rope_parameters` (rope_theta and the scaling type inside one
        # object); older configs have a top-level `rope_theta` and an optional `rope_scaling`.
        rope_key = "rope_parameters" if "rope_parameters" in hf else "rope_scaling"
        rope_params: Any = hf.get(rope_key)
        rope_scaling = _rope_scaling(rope_params, fail, rope_key)
        rope_theta: Any = hf.get("rope_theta", 10000.0)
        if rope_key == "rope_parameters" and isinstance(rope_params, dict):
            rope_theta = cast("dict[str, Any]", rope_params).get("rope_theta", rope_theta)

        def integer(key: str, value: Any) -> int:
            # JSON has one number type: 4.0 is an integer, 4.5, "4", true and null are not
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise fail(key, f"must be an integer, got {value!r}")
            if isinstance(value, float) and not value.is_integer():
                raise fail(key, f"must be an integer, got {value!r}")
            return int(value)

        def number(key: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise fail(key, f"must be a finite number, got {value!r}")
            return float(value)

        def flag(key: str, default: bool) -> bool:
            value: Any = hf.get(key, default)
            if not isinstance(value, bool):
                raise fail(key, f"must be true or false, got {value!r}")
            return value

        heads = integer("num_attention_heads", need("num_attention_heads"))
        hidden = integer("hidden_size", need("hidden_size"))
        eos: Any = hf.get("eos_token_id")
        eos_ids = (
            tuple(integer("eos_token_id", e) for e in cast("list[Any]", eos))
            if isinstance(eos, list)
            else (() if eos is None else (integer("eos_token_id", eos),))
        )
        bias = flag("attention_bias", False)
        bos = hf.get("bos_token_id")
        kv_heads: Any = hf.get("num_key_value_heads")
        head_dim: Any = hf.get("head_dim")
        if heads <= 0:
            raise fail("num_attention_heads", f"must be >= 1, got {heads}")
        try:
            return cls(
                architecture=arch,
                vocab_size=integer("vocab_size", need("vocab_size")),
                hidden_size=hidden,
                num_hidden_layers=integer("num_hidden_layers", need("num_hidden_layers")),
                num_attention_heads=heads,
                num_key_value_heads=heads if kv_heads is None else integer("num_key_value_heads", kv_heads),
                head_dim=hidden // heads if head_dim is None else integer("head_dim", head_dim),
                intermediate_size=integer("intermediate_size", need("intermediate_size")),
                rope_theta=number("rope_theta", rope_theta),
                rms_norm_eps=number("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=integer(
                    "max_position_embeddings", hf.get("max_position_embeddings", 2048)
                ),
                tie_word_embeddings=flag("tie_word_embeddings", False),
                eos_token_ids=eos_ids,
                bos_token_id=None if bos is None else integer("bos_token_id", bos),
                qkv_bias=True if arch == "Qwen2ForCausalLM" else bias,
                o_proj_bias=False if arch == "Qwen2ForCausalLM" else bias,
                qk_norm=arch == "Qwen3ForCausalLM",
                rope_scaling=rope_scaling,
            )
        except ValueError as err:  # __post_init__: a value out of range
            raise CheckpointError(f"{source}: {err}") from err


def _first_architecture(archs: object) -> str:
    """config.json lists `architectures`; the first names the model class."""
    text = repr(archs)
    if isinstance(archs, list):
        items = cast("list[object]", archs)
        text = str(items[0]) if items else text
    return text


def _rope_scaling(value: Any, fail: Any, key: str = "rope_scaling") -> dict[str, float] | None:
    """None for no scaling ("default" or no type too), the llama3 parameters, or CheckpointError via `fail`.

    `key` is the config key the object came from: `rope_scaling` (transformers < 5) or
    `rope_parameters` (transformers >= 5, which also holds `rope_theta`).
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise fail(key, f"expected an object or null, got {value!r}")
    params: dict[str, Any] = dict(value)  # pyright: ignore[reportUnknownArgumentType]
    kind = params.get("rope_type", params.get("type"))
    if kind in ("default", None):
        return None
    if kind != "llama3":
        raise fail(key, f"rope type {kind!r} is not implemented (supported: none, 'default', 'llama3')")
    missing = [k for k in _LLAMA3_ROPE_KEYS if k not in params]
    if missing:
        raise fail(key, f"llama3 scaling lacks {missing}")
    return {k: float(params[k]) for k in _LLAMA3_ROPE_KEYS}
