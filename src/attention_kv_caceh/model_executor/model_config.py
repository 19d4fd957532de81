"""ModelConfig: the architecture settings of a Hugging Face `config.json` that the NumPy model implements.

What vLLM's `transformers_utils/config.py` + `config/model.py` do for one folder: read the keys the Llama /
Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 / Phi-3 classes of Hugging Face transformers define (`LlamaConfig`,
`Gemma3TextConfig`, ...), fill their documented defaults, and refuse, with one CheckpointError naming the
file and key, a setting the NumPy model would silently get wrong (another architecture, activation, a RoPE
scaling other than llama3's or linear, a sliding window where it is not implemented). The Gemma keys are
read by `family_config.py`.

Left out: hub configs and `trust_remote_code`, every architecture but these seven, RoPE scaling other than
llama3's and linear (Phi-3's LongRoPE), Qwen2's sliding windows, mixture-of-experts, quantization configs, and the rest of vLLM's
ModelConfig (dtype resolution, max_model_len derivation, tokenizer mode, pooling and multimodal settings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from attention_kv_caceh.model_executor.checkpoint import CheckpointError
from attention_kv_caceh.model_executor.family_config import gemma_settings, rope_settings

__all__ = ["GEMMA_ARCHITECTURES", "LAYER_TYPES", "SUPPORTED_ARCHITECTURES", "ModelConfig"]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder shapes and settings (Hugging Face config.json names).

    qkv_bias / o_proj_bias: biases on the q/k/v and o projections (Qwen2: q/k/v only; Llama, Mistral
    and Qwen3: both or neither, `attention_bias`). qk_norm: Qwen3's per-head RMSNorm of q and k.
    rope_scaling: None, the "llama3" parameters, or {"factor": f} (linear: every frequency divided by f);
    of the full-attention layers only when rope_local_theta is set. eos_token_ids: every end-of-sequence
    id listed.

    sliding_window / layer_types (transformers' names): layer_types is empty (every layer
    "full_attention") or one of LAYER_TYPES per layer; a "sliding_attention" layer's query at position p
    attends to the keys at positions p - sliding_window < s <= p (transformers' `sliding_window_overlay`,
    llama.cpp's LLAMA_SWA_TYPE_STANDARD). hidden_act: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU with
    the tanh GELU). gemma_norms: Gemma's decoder: RMSNorm scales by (1 + w), norms after attention and
    after the MLP too, embeddings times sqrt(hidden_size). query_pre_attn_scalar: the attention scale is
    its inverse square root (None: head_dim's). attn_logit_softcapping / final_logit_softcapping: scores
    and logits become cap * tanh(x / cap) (None: off). rope_local_theta: the RoPE base of the sliding
    layers, unscaled (Gemma 3; None: rope_theta and rope_scaling on every layer).

    Raises ValueError for non-positive sizes, heads that do not divide, or layer types that do not fit.
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
    hidden_act: str = "silu"
    gemma_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None

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
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError(
                f"rope_theta and rms_norm_eps must be > 0, got {self.rope_theta}, {self.rms_norm_eps}"
            )
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types {bad[0]!r} is not one of {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and (
            self.sliding_window is None or self.sliding_window < 1
        ):
            raise ValueError(f"sliding layers need a sliding_window >= 1, got {self.sliding_window}")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act must be 'silu' or 'gelu_pytorch_tanh', got {self.hidden_act!r}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`, None for a full-attention layer."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def attention_scale(self) -> float:
        """The factor of q k^T: query_pre_attn_scalar^-1/2 (Gemma), else head_dim^-1/2."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id, or None."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], source: str | Path = "config.json") -> ModelConfig:
        """Build from a parsed config.json; `source` names the file in error messages.

        Defaults follow transformers' config classes: num_key_value_heads = num_attention_heads,
        head_dim = hidden_size // num_attention_heads, tie_word_embeddings False, attention_bias False
        (Gemma's: `family_config.gemma_settings`). Raises CheckpointError (naming `source` and the key) for
        a missing required key, an unsupported architecture, hidden_act other than "silu" (Gemma:
        hidden_activation other than "gelu_pytorch_tanh"), mlp_bias, a sliding window on Qwen2 / Qwen3,
        or a rope_scaling type other than none/"default"/"llama3"/"linear".
        """

        def fail(key: str, why: str) -> CheckpointError:
            return CheckpointError(f"{source}: key {key!r}: {why}")

        def need(key: str) -> Any:
            if key not in hf:
                raise fail(key, "missing")
            return hf[key]

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

        archs: Any = need("architectures")
        arch = _first_architecture(archs)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise fail(
                "architectures", f"unsupported {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if hf.get("mlp_bias", False):
            raise fail("mlp_bias", "MLP biases are not implemented")
        heads = integer("num_attention_heads", need("num_attention_heads"))
        hidden = integer("hidden_size", need("hidden_size"))
        layers = integer("num_hidden_layers", need("num_hidden_layers"))
        if heads <= 0:
            raise fail("num_attention_heads", f"must be >= 1, got {heads}")
        extra: dict[str, Any]
        if arch in GEMMA_ARCHITECTURES:
            extra = gemma_settings(hf, arch, layers, fail, integer, number)
        else:
            extra = _llama_settings(hf, arch, layers, fail, integer, number)
        eos: Any = hf.get("eos_token_id")
        eos_ids = (
            tuple(integer("eos_token_id", e) for e in cast("list[Any]", eos))
            if isinstance(eos, list)
            else (() if eos is None else (integer("eos_token_id", eos),))
        )
        bias = flag("attention_bias", False)
        bos = hf.get("bos_token_id")
        kv_heads: Any = hf.get("num_key_value_heads")
        head_dim: Any = hf.get("head_dim", extra.pop("default_head_dim", None))
        try:
            return cls(
                architecture=arch,
                vocab_size=integer("vocab_size", need("vocab_size")),
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=heads if kv_heads is None else integer("num_key_value_heads", kv_heads),
                head_dim=hidden // heads if head_dim is None else integer("head_dim", head_dim),
                intermediate_size=integer("intermediate_size", need("intermediate_size")),
                rms_norm_eps=number("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=integer(
                    "max_position_embeddings", hf.get("max_position_embeddings", extra.pop("default_max_pos"))
                ),
                tie_word_embeddings=flag("tie_word_embeddings", extra.pop("default_tie")),
                eos_token_ids=eos_ids,
                bos_token_id=None if bos is None else integer("bos_token_id", bos),
                qkv_bias=True if arch == "Qwen2ForCausalLM" else bias,
                o_proj_bias=False if arch == "Qwen2ForCausalLM" else bias,
                qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
                **extra,
            )
        except ValueError as err:  # __post_init__: a value out of range
            raise CheckpointError(f"{source}: {err}") from err


def _llama_settings(
    hf: dict[str, Any], arch: str, layers: int, fail: Any, integer: Any, number: Any
) -> dict[str, Any]:
    """The ModelConfig fields of a Llama / Mistral / Qwen2 / Qwen3 / Phi-3 config that differ by family:
    the activation (SiLU only), RoPE (Phi-3's LongRoPE is refused by key) and the sliding window
    (Mistral's and Phi-3's, on every layer; refused on Qwen2 / Qwen3, whose `max_window_layers` split is
    not implemented), plus the defaults of absent keys."""
    if hf.get("hidden_act", "silu") != "silu":
        raise fail("hidden_act", f"only 'silu' (SwiGLU) is implemented, got {hf['hidden_act']!r}")
    every_layer = ("MistralForCausalLM", "Phi3ForCausalLM")  # transformers applies their window everywhere
    window_on = hf.get("use_sliding_window", arch in every_layer)
    window: Any = hf.get("sliding_window")
    partial: Any = hf.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise fail("partial_rotary_factor", f"RoPE over part of a head ({partial!r}) is not implemented")
    sliding: dict[str, Any] = {}
    if window_on and window is not None:
        if arch not in every_layer:
            raise fail("sliding_window", f"sliding-window attention of {arch} is not implemented ({window})")
        sliding = {
            "sliding_window": integer("sliding_window", window),
            "layer_types": ("sliding_attention",) * layers,
        }
    rope_theta, rope_scaling = rope_settings(hf, fail, number)
    return {
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "default_max_pos": 2048,
        "default_tie": False,
        **sliding,
    }


def _first_architecture(archs: object) -> str:
    """config.json lists `architectures`; the first names the model class."""
    text = repr(archs)
    if isinstance(archs, list):
        items = cast("list[object]", archs)
        text = str(items[0]) if items else text
    return text
