"""The config.json keys of Gemma 2 and Gemma 3 and of RoPE (transformers' `Gemma2Config`, `Gemma3TextConfig`) as ModelConfig fields.

What vLLM reads from these configs in `model_executor/models/gemma2.py` and `gemma3.py` (via transformers'
config classes): the GeGLU activation, `query_pre_attn_scalar`, the logit soft-capping of Gemma 2, the
interleaved sliding-window and global layers (`layer_types`, or the older `sliding_window_pattern`),
and Gemma 3's two RoPE settings (a local base for the sliding layers, the global base and an optional
scaling for the others). Defaults of absent keys are the config classes' (transformers 5).

Left out: Gemma 3's multimodal wrapper (`Gemma3ForConditionalGeneration`, whose text config is nested),
bidirectional attention (`use_bidirectional_attention`), Gemma 3's `attn_logit_softcapping` (transformers
ignores it, so it is refused rather than honoured or dropped), RoPE scalings other than linear and llama3.
"""

from __future__ import annotations

from typing import Any, cast

__all__ = ["gemma_layer_types", "gemma_settings", "rope_settings"]

_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    # the config classes' defaults (Gemma2Config, Gemma3TextConfig)
    "Gemma2ForCausalLM": {
        "pattern": 2,
        "max_pos": 8192,
        "attn_softcap": 50.0,
        "final_softcap": 30.0,
        "theta": 10000.0,
    },
    "Gemma3ForCausalLM": {
        "pattern": 6,
        "max_pos": 131072,
        "attn_softcap": None,
        "final_softcap": None,
        "theta": 1_000_000.0,
        "local_theta": 10000.0,
    },
}


def gemma_layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    """transformers' default `layer_types` for `sliding_window_pattern` = `pattern`: layer i is global when
    (i + 1) % pattern == 0, sliding otherwise (llama.cpp's `set_swa_pattern`: il % n < n - 1)."""
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


def gemma_settings(
    hf: dict[str, Any], arch: str, layers: int, fail: Any, integer: Any, number: Any
) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma 2 / Gemma 3 config.json `hf` that differ from Llama's (keyword
    arguments of ModelConfig, plus `default_head_dim`, `default_max_pos`, `default_tie` for the shared
    keys). `fail(key, why)` makes the CheckpointError; `integer` / `number` check a value by key.

    Raises (via `fail`) for hidden_activation other than "gelu_pytorch_tanh", bidirectional attention,
    Gemma 3's attn_logit_softcapping, layer_types of the wrong length or names, a RoPE scaling other than
    linear / llama3 (or any on Gemma 3's sliding layers), and values of the wrong type.
    """
    d = _GEMMA_DEFAULTS[arch]
    act: Any = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise fail("hidden_activation", f"only 'gelu_pytorch_tanh' (GeGLU) is implemented, got {act!r}")
    if hf.get("use_bidirectional_attention"):
        raise fail("use_bidirectional_attention", "bidirectional attention is not implemented")

    def optional(key: str, default: float | None) -> float | None:
        value: Any = hf.get(key, default)
        return None if value is None else number(key, value)

    attn_cap = optional("attn_logit_softcapping", d["attn_softcap"])
    if arch == "Gemma3ForCausalLM" and attn_cap is not None:
        raise fail("attn_logit_softcapping", f"Gemma 3 does not soft-cap attention scores (got {attn_cap})")
    window: Any = hf.get("sliding_window", 4096)
    types: Any = hf.get("layer_types")
    if types is None:
        pattern = integer("sliding_window_pattern", hf.get("sliding_window_pattern", d["pattern"]))
        if pattern < 1:
            raise fail("sliding_window_pattern", f"must be >= 1, got {pattern}")
        layer_types = gemma_layer_types(layers, pattern)
    elif isinstance(types, list) and len(cast("list[Any]", types)) == layers:
        layer_types = tuple(str(t) for t in cast("list[Any]", types))
        bad = [t for t in layer_types if t not in ("full_attention", "sliding_attention")]
        if bad:
            raise fail("layer_types", f"{bad[0]!r} is not 'full_attention' or 'sliding_attention'")
    else:
        raise fail("layer_types", f"expected a list of {layers} layer types, got {types!r}")
    if window is None and "sliding_attention" in layer_types:
        raise fail("sliding_window", "null, but layer_types has sliding layers")
    out: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "gemma_norms": True,
        "query_pre_attn_scalar": number("query_pre_attn_scalar", hf.get("query_pre_attn_scalar", 256)),
        "attn_logit_softcapping": attn_cap,
        "final_logit_softcapping": optional("final_logit_softcapping", d["final_softcap"]),
        "sliding_window": None if window is None else integer("sliding_window", window),
        "layer_types": layer_types,
        "default_head_dim": 256,
        "default_max_pos": d["max_pos"],
        "default_tie": True,
    }
    params: Any = hf.get("rope_parameters")
    if arch == "Gemma2ForCausalLM":
        out["rope_theta"], out["rope_scaling"] = rope_settings(hf, fail, number, d["theta"])
    elif isinstance(params, dict) and {"full_attention", "sliding_attention"} & set(
        cast("dict[str, Any]", params)
    ):
        # transformers >= 5: one RoPE object per layer type
        nested = cast("dict[str, Any]", params)
        full: Any = nested.get("full_attention") or {}
        local: Any = nested.get("sliding_attention") or {}
        out["rope_theta"], out["rope_scaling"] = rope_settings(
            {"rope_parameters": {"rope_theta": d["theta"], **full}}, fail, number
        )
        out["rope_local_theta"], local_scaling = rope_settings(
            {"rope_parameters": {"rope_theta": d["local_theta"], **local}}, fail, number
        )
        if local_scaling is not None:
            raise fail("rope_parameters", f"RoPE scaling of the sliding layers is not implemented ({local})")
    else:  # older configs: rope_theta and rope_scaling for the global layers, rope_local_base_freq
        out["rope_theta"], out["rope_scaling"] = rope_settings(hf, fail, number, d["theta"])
        out["rope_local_theta"] = number(
            "rope_local_base_freq", hf.get("rope_local_base_freq", d["local_theta"])
        )
    return out


def rope_settings(hf: dict[str, Any], fail: Any, number: Any, theta: float = 10000.0) -> tuple[float, Any]:
    """(rope_theta, rope_scaling) of a config with one RoPE for every layer.

    transformers >= 5 writes `rope_parameters` (rope_theta and the scaling type inside one object);
    older configs have a top-level `rope_theta` and an optional `rope_scaling`. `theta`: the default."""
    rope_key = "rope_parameters" if "rope_parameters" in hf else "rope_scaling"
    rope_params: Any = hf.get(rope_key)
    rope_scaling = _rope_scaling(rope_params, fail, rope_key)
    rope_theta: Any = hf.get("rope_theta", theta)
    if rope_key == "rope_parameters" and isinstance(rope_params, dict):
        rope_theta = cast("dict[str, Any]", rope_params).get("rope_theta", rope_theta)
    return number("rope_theta", rope_theta), rope_scaling


def _rope_scaling(value: Any, fail: Any, key: str = "rope_scaling") -> dict[str, float] | None:
    """None for no scaling ("default" or no type too), the llama3 parameters, {"factor": f} for "linear",
    or CheckpointError via `fail`; a `partial_rotary_factor` below 1 is refused too.

    `key` is the config key the object came from: `rope_scaling` (transformers < 5) or
    `rope_parameters` (transformers >= 5, which also holds `rope_theta`).
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise fail(key, f"expected an object or null, got {value!r}")
    params: dict[str, Any] = dict(value)  # pyright: ignore[reportUnknownArgumentType]
    partial: Any = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise fail(key, f"partial_rotary_factor {partial!r} (RoPE over part of a head) is not implemented")
    kind = params.get("rope_type", params.get("type"))
    if kind in ("default", None):
        return None
    if kind == "linear":
        factor: Any = params.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
            raise fail(key, f"linear scaling needs a factor > 0, got {factor!r}")
        return {"factor": float(factor)}
    if kind != "llama3":
        raise fail(
            key, f"rope type {kind!r} is not implemented (supported: none, 'default', 'llama3', 'linear')"
        )
    missing = [k for k in _LLAMA3_ROPE_KEYS if k not in params]
    if missing:
        raise fail(key, f"llama3 scaling lacks {missing}")
    return {k: float(params[k]) for k in _LLAMA3_ROPE_KEYS}
