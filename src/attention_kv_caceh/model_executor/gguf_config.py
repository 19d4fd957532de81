"""ModelConfig from a GGUF file's metadata: llama.cpp's keys for the settings a Hugging Face config.json holds.

What vLLM leaves to transformers' `integrations/ggml.py` (GGUF metadata -> a config) for the six
architectures the engine runs (llama, qwen2, qwen3, gemma2, gemma3, phi3). The keys are llama.cpp's
(`gguf.Keys.LLM`, prefixed by the architecture, `llama.block_count`):

    config.json                GGUF metadata
    hidden_size                {arch}.embedding_length
    num_hidden_layers          {arch}.block_count
    intermediate_size          {arch}.feed_forward_length
    num_attention_heads        {arch}.attention.head_count
    num_key_value_heads        {arch}.attention.head_count_kv       (default: head_count)
    head_dim                   {arch}.attention.key_length          (default: hidden / heads)
    rms_norm_eps               {arch}.attention.layer_norm_rms_epsilon
    rope_theta                 {arch}.rope.freq_base                (default: 10000)
    max_position_embeddings    {arch}.context_length
    vocab_size                 {arch}.vocab_size                    (default: token_embd's rows)
    tie_word_embeddings        no `output.weight` tensor (llama.cpp writes it only when untied)
    eos_token_id               tokenizer.ggml.eos_token_id, then eot / eom ids (end-of-turn tokens)
    bos_token_id               tokenizer.ggml.bos_token_id
    attention_bias             a `blk.0.attn_q.bias` (phi3: or `attn_qkv.bias`) / `blk.0.attn_output.bias`
                               tensor (Qwen2: q/k/v)
    rope_scaling (linear)      {arch}.rope.scaling.type "linear", {arch}.rope.scaling.factor

Gemma 2 / Gemma 3 (llama.cpp's `src/models/gemma2.cpp` / `gemma3.cpp` decide what a file leaves out):

    sliding_window             {arch}.attention.sliding_window (Gemma 2 default 4096; Gemma 3 without
                               it: no sliding layers)
    layer_types                {arch}.attention.sliding_window_pattern: a per-layer list of bools
                               (true = sliding) or n (layer i sliding when i % n < n - 1); default
                               n = 2 (Gemma 2), 6 (Gemma 3)
    rope_local_base_freq       {arch}.rope.freq_base_swa (Gemma 3, default 10000; Gemma 2: freq_base)
    attn / final_logit_softcapping   {arch}.attn_logit_softcapping (Gemma 2, default 50),
                               {arch}.final_logit_softcapping (Gemma 2 default 30; Gemma 3 none, 0 = off)
    query_pre_attn_scalar      not stored: llama.cpp scales by 1/sqrt(head_dim), or by
                               1/sqrt(hidden / heads) for the 27B models (46 layers Gemma 2, 62 Gemma 3)

Phi-3 (llama.cpp's `phi3`, `convert_hf_to_gguf.py`'s Phi3MiniModel, also Phi-4):

    sliding_window             {arch}.attention.sliding_window on every layer, as transformers' Phi3
                               applies config.json's (0 or absent: none; the converter writes 0 for
                               Phi-4's null). llama.cpp itself currently ignores the key for phi3
                               (`src/models/phi3.cpp` logs "Phi SWA is currently disabled" and runs
                               full attention), as does transformers' GGUF reader: past the window
                               their tokens for such a file differ from the folder's; these do not.
    head_dim                   hidden / heads (the converter writes no key_length)
    rope.scaling.original_context_length   written always; nothing to do without LongRoPE

Refused, naming the key or tensor: a missing or mistyped required key, per-layer head counts that
differ, a RoPE over part of a head (`rope.dimension_count` below head_dim: Phi-3's
partial_rotary_factor), RoPE scaling (`rope.scaling.type` other than none or linear, a
`rope.scaling.attn_factor` other than 1, llama3's `rope_freqs.weight` tensor, Phi-3's LongRoPE
`rope_factors_long.weight` / `rope_factors_short.weight`), a sliding window outside Gemma and Phi-3,
mixture-of-experts, and values ModelConfig refuses (heads that do not divide, ...).

Left out: the many other architectures transformers maps (Qwen2-MoE, Phi-2, Falcon, ...), RoPE scaling
from GGUF metadata other than linear (a config.json's llama3 scaling is honoured, model_config.py), and
transformers' conversion of the GGUF vocabulary into a fast tokenizer, which gguf_tokenizer.py does here.
"""

from __future__ import annotations

import math
from typing import Any, cast

from attention_kv_caceh.model_executor.checkpoint import CheckpointError
from attention_kv_caceh.model_executor.gguf_checkpoint import (
    GGUF_ARCHITECTURES,
    ROPE_FACTOR_TENSORS,
    GGUFCheckpoint,
)
from attention_kv_caceh.model_executor.model_config import ModelConfig

__all__ = ["model_config_from_gguf"]


def model_config_from_gguf(ckpt: GGUFCheckpoint) -> ModelConfig:
    """The ModelConfig of GGUF file `ckpt` (keys in the module docstring). Raises CheckpointError."""
    arch = ckpt.arch
    source = ckpt.source

    def fail(key: str, why: str) -> CheckpointError:
        return CheckpointError(f"{source}: key {key!r}: {why}")

    def integer(key: str, default: int | None = None, *, per_layer: bool = False) -> int:
        value: Any = ckpt.metadata(key)
        if value is None:
            if default is None:
                raise fail(key, "missing")
            return default
        if per_layer and isinstance(value, list):
            counts = set(cast(list[Any], value))
            if len(counts) != 1:
                raise fail(key, f"per-layer values that differ are not implemented ({sorted(counts)})")
            value = counts.pop()
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail(key, f"must be an integer, got {value!r}")
        return value

    def number(key: str, default: float | None = None) -> float:
        value: Any = ckpt.metadata(key)
        if value is None:
            if default is None:
                raise fail(key, "missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise fail(key, f"must be a finite number, got {value!r}")
        return float(value)

    p = f"{arch}."
    gemma, phi3 = arch in ("gemma2", "gemma3"), arch == "phi3"
    windowed = gemma or phi3
    for key in (p + "expert_count",) if windowed else (p + "expert_count", p + "attention.sliding_window"):
        if ckpt.metadata(key):
            raise fail(key, f"not implemented ({ckpt.metadata(key)!r})")
    scaling = ckpt.metadata(p + "rope.scaling.type")
    rope_scaling: dict[str, float] | None = None
    if scaling == "linear":
        factor = number(p + "rope.scaling.factor")
        if factor <= 0:
            raise fail(p + "rope.scaling.factor", f"must be > 0, got {factor}")
        rope_scaling = {"factor": factor}
    elif scaling not in (None, "none"):
        raise fail(p + "rope.scaling.type", f"RoPE scaling {scaling!r} is not implemented")
    for tensor, what in ROPE_FACTOR_TENSORS.items():
        if tensor in ckpt.gguf_names:
            raise CheckpointError(f"{source}: tensor {tensor!r}: {what} is not implemented")
    attn_factor = number(p + "rope.scaling.attn_factor", 1.0)
    if attn_factor != 1.0:
        raise fail(
            p + "rope.scaling.attn_factor", f"a RoPE attention factor ({attn_factor}) is not implemented"
        )
    hidden = integer(p + "embedding_length")
    heads = integer(p + "attention.head_count", per_layer=True)
    if heads < 1:
        raise fail(p + "attention.head_count", f"must be >= 1, got {heads}")
    head_dim = integer(p + "attention.key_length", hidden // heads)
    value_dim = integer(p + "attention.value_length", head_dim)
    if value_dim != head_dim:
        raise fail(p + "attention.value_length", f"{value_dim} differs from key_length {head_dim}")
    rotary = integer(p + "rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise fail(
            p + "rope.dimension_count", f"RoPE over {rotary} of {head_dim} head dims is not implemented"
        )
    if "model.embed_tokens.weight" not in ckpt:
        raise CheckpointError(f"{source}: missing tensor 'token_embd.weight'")
    vocab = integer(p + "vocab_size", ckpt.shape("model.embed_tokens.weight")[0])
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = ckpt.metadata(f"tokenizer.ggml.{key}")
        if token is not None and integer(f"tokenizer.ggml.{key}") not in eos_ids:
            eos_ids.append(int(token))
    bos = ckpt.metadata("tokenizer.ggml.bos_token_id")
    bias = any(f"model.layers.0.self_attn.{n}.bias" in ckpt for n in ("q_proj", "qkv_proj"))
    layers = integer(p + "block_count")
    extra: dict[str, Any] = {}
    if gemma:
        extra = _gemma_settings(ckpt, arch, layers, hidden, heads, head_dim, fail, integer, number)
    elif phi3:
        window = integer(p + "attention.sliding_window", 0)
        if window < 0:
            raise fail(p + "attention.sliding_window", f"must be >= 0, got {window}")
        if window:  # transformers' Phi3: the window on every layer
            extra = {"sliding_window": window, "layer_types": ("sliding_attention",) * layers}
    try:
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=integer(p + "attention.head_count_kv", heads, per_layer=True),
            head_dim=head_dim,
            intermediate_size=integer(p + "feed_forward_length", per_layer=True),
            rope_theta=number(p + "rope.freq_base", 10000.0),
            rms_norm_eps=number(p + "attention.layer_norm_rms_epsilon"),
            max_position_embeddings=integer(p + "context_length"),
            tie_word_embeddings="lm_head.weight" not in ckpt,
            eos_token_ids=tuple(eos_ids),
            bos_token_id=None if bos is None else integer("tokenizer.ggml.bos_token_id"),
            qkv_bias=arch == "qwen2" or bias,
            o_proj_bias="model.layers.0.self_attn.o_proj.bias" in ckpt,
            qk_norm=arch in ("qwen3", "gemma3"),
            rope_scaling=rope_scaling,
            **extra,
        )
    except ValueError as err:  # __post_init__: a value out of range
        raise CheckpointError(f"{source}: {err}") from err


def _gemma_settings(
    ckpt: GGUFCheckpoint,
    arch: str,
    layers: int,
    hidden: int,
    heads: int,
    head_dim: int,
    fail: Any,
    integer: Any,
    number: Any,
) -> dict[str, Any]:
    """The Gemma fields of ModelConfig from a gemma2 / gemma3 file (keys in the module docstring)."""
    p = f"{arch}."
    gemma2 = arch == "gemma2"
    window_key = p + "attention.sliding_window"
    window = integer(window_key, 4096 if gemma2 else 0)
    pattern_key = p + "attention.sliding_window_pattern"
    pattern: Any = ckpt.metadata(pattern_key)
    if window <= 0:
        layer_types: tuple[str, ...] = ()
    elif isinstance(pattern, list):
        flags = cast(list[Any], pattern)
        if len(flags) != layers or not all(isinstance(f, bool) for f in flags):
            raise fail(pattern_key, f"expected {layers} booleans, got {pattern!r}")
        layer_types = tuple("sliding_attention" if f else "full_attention" for f in flags)
    else:
        n = integer(pattern_key, 2 if gemma2 else 6)
        if n < 0:
            raise fail(pattern_key, f"must be >= 0, got {n}")
        # llama.cpp's set_swa_pattern: n = 0 makes every layer sliding
        layer_types = tuple(
            "sliding_attention" if n == 0 or i % n < n - 1 else "full_attention" for i in range(layers)
        )
    final_cap = number(p + "final_logit_softcapping", 30.0 if gemma2 else 0.0)
    big = layers == (46 if gemma2 else 62)  # the 27B models: llama.cpp's LLM_TYPE_27B
    theta = number(p + "rope.freq_base", 10000.0)
    if gemma2 and number(p + "rope.freq_base_swa", theta) != theta:
        raise fail(p + "rope.freq_base_swa", "a RoPE base of Gemma 2's sliding layers apart from freq_base")
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "gemma_norms": True,
        "query_pre_attn_scalar": float(hidden // heads if big else head_dim),
        "attn_logit_softcapping": number(p + "attn_logit_softcapping", 50.0) if gemma2 else None,
        "final_logit_softcapping": final_cap or None,
        "sliding_window": window if window > 0 else None,
        "layer_types": layer_types,
        "rope_local_theta": None if gemma2 else number(p + "rope.freq_base_swa", 10000.0),
    }
