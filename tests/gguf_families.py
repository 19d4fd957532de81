"""GGUF files of Gemma 2 / Gemma 3 / Phi-3 Hugging Face folders, as llama.cpp's converter writes them (GGUFWriter).

Written from what `convert_hf_to_gguf.py` (its `Gemma2Model` / `Gemma3Model` classes and the base
`TextModel.set_gguf_parameters`) stores: llama.cpp's tensor names for these architectures (the gguf
library's `TensorNameMap`; note `ffn_norm` is Gemma's pre_feedforward_layernorm and
`post_attention_norm` its post_attention_layernorm), every `*norm.weight` stored as 1 + w (Gemma's
RMSNorm scales by 1 + w; the converter adds the 1), no permutation of q/k rows (Gemma's RoPE is
NeoX-style), no `output.weight` (tied), and the keys block_count, context_length, embedding_length,
feed_forward_length, head counts, key/value length, rms epsilon, rope.freq_base (the global layers'),
rope.freq_base_swa (Gemma 3: the sliding layers'), rope.scaling.{type,factor} (linear), sliding_window
and the soft-capping keys.

Phi-3 (`Phi3MiniModel`, which replaces the base class's keys with its own): context_length,
rope.scaling.original_context_length, embedding_length, feed_forward_length, block_count, head counts,
rms epsilon, rope.dimension_count (int(partial_rotary_factor * hidden) // heads), rope.freq_base,
sliding_window (0 for none) and, for a LongRoPE config, rope.scaling.attn_factor and the
`rope_factors_long.weight` / `rope_factors_short.weight` tensors; tensors by `TensorNameMap`
(`qkv_proj` is `attn_qkv`, `gate_up_proj` is `ffn_up`), norms as they are, `output.weight` when untied;
`separate_qkv` splits `attn_qkv` into `attn_q` / `attn_k` / `attn_v`, as some converters write it.

The vocabulary is the tiny SentencePiece one of `gguf_files`. Importable without the project (only
gguf, numpy, safetensors): the scratch script that writes the references uses it to check these files
against transformers' own GGUF loader.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, RopeScalingType, get_tensor_name_map
from gguf.constants import MODEL_TENSOR, TENSOR_NAMES
from gguf.quants import quantize

try:
    from tests.gguf_files import sentencepiece_tokens
except ImportError:  # run as a script's sibling module
    from gguf_files import sentencepiece_tokens  # type: ignore[no-redef]

GGUF_ARCH = {
    "Gemma2ForCausalLM": ("gemma2", MODEL_ARCH.GEMMA2),
    "Gemma3ForCausalLM": ("gemma3", MODEL_ARCH.GEMMA3),
}


def load_float32(folder: Path) -> dict[str, np.ndarray]:
    """The folder's `model.safetensors` tensors as float32 (F32, or BF16 widened exactly), read from
    the format's header (8-byte length, JSON) since NumPy has no bfloat16."""
    data = (folder / "model.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    header: dict[str, Any] = json.loads(data[8 : 8 + size])
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        raw = data[8 + size + lo : 8 + size + hi]
        if info["dtype"] == "BF16":
            array = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif info["dtype"] == "F32":
            array = np.frombuffer(raw, dtype=np.float32).copy()
        else:
            raise ValueError(f"{name}: dtype {info['dtype']} not handled")
        out[name] = array.reshape(info["shape"])
    return out


def family_gguf(folder: Path, out: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """`gemma_gguf` or `phi3_gguf`, as folder `folder`'s config.json names the architecture."""
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    return (phi3_gguf if arch == "Phi3ForCausalLM" else gemma_gguf)(folder, out, qtype)


def gemma_gguf(folder: Path, out: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """The GGUF file llama.cpp's converter writes for Gemma 2 / 3 folder `folder` (module docstring);
    2-D weights stored as `qtype`, norms F32."""
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    arch_name, arch = GGUF_ARCH[config["architectures"][0]]
    layers = config["num_hidden_layers"]
    names = get_tensor_name_map(arch, layers)
    writer = GGUFWriter(str(out), arch_name)
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    rope: dict[str, Any] = config.get("rope_parameters") or {}
    full: dict[str, Any] = rope.get("full_attention", rope)
    writer.add_rope_freq_base(full["rope_theta"])
    if "sliding_attention" in rope:
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(full["factor"]))
    if arch_name == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    elif config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])
    _add_tokenizer(writer, config)
    writer.add_add_space_prefix(False)
    tensors = {name: a for name, a in load_float32(folder).items() if name != "lm_head.weight"}  # tied
    for name, array in sorted(tensors.items()):
        if name.endswith("norm.weight"):
            tensors[name] = array + np.float32(1.0)  # the converter's `data_torch + 1`
    return _write(writer, names, tensors, qtype, out)


def phi3_gguf(
    folder: Path,
    out: Path,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    separate_qkv: bool = False,
    edit: Callable[[dict[str, np.ndarray]], None] | None = None,
    **changes: Any,
) -> Path:
    """The GGUF file llama.cpp's converter writes for Phi-3 folder `folder` (module docstring), its
    config.json updated with `changes` first (a LongRoPE `rope_parameters`, a partial_rotary_factor);
    2-D weights stored as `qtype`, norms F32. `edit` may change or add float32 tensors (by Hugging
    Face name, in place) before they are stored."""
    config: dict[str, Any] = json.loads((folder / "config.json").read_text()) | changes
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    rope: dict[str, Any] = dict(config.get("rope_parameters") or {})
    for key in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings"):
        if key not in rope and key in config:  # the converter's rope_parameters take the top-level keys
            rope[key] = config[key]
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads
    writer = GGUFWriter(str(out), "phi3")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(rope_dims)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(config.get("sliding_window") or 0)
    _add_tokenizer(writer, config)
    writer.add_tokenizer_pre("default")
    if config.get("pad_token_id") is not None:  # gguf.SpecialVocab reads config.json's ids too
        writer.add_pad_token_id(config["pad_token_id"])
    tensors = load_float32(folder)
    if rope.get("long_factor"):  # generate_extra_tensors: LongRoPE's factors and attention factor
        scale = config["max_position_embeddings"] / rope["original_max_position_embeddings"]
        orig = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
        )
        for key, tensor in (
            ("long_factor", MODEL_TENSOR.ROPE_FACTORS_LONG),
            ("short_factor", MODEL_TENSOR.ROPE_FACTORS_SHORT),
        ):
            tensors[TENSOR_NAMES[tensor] + ".weight"] = np.asarray(rope[key], dtype=np.float32)
    if separate_qkv:
        q, kv = hidden, config["num_key_value_heads"] * hidden // heads
        for i in range(layers):
            a = f"model.layers.{i}.self_attn."
            fused = tensors.pop(a + "qkv_proj.weight")
            for n, part in zip(("q_proj", "k_proj", "v_proj"), np.split(fused, [q, q + kv]), strict=True):
                tensors[f"{a}{n}.weight"] = part
    if edit is not None:
        edit(tensors)
    return _write(writer, get_tensor_name_map(MODEL_ARCH.PHI3, layers), tensors, qtype, out)


def _add_tokenizer(writer: GGUFWriter, config: dict[str, Any]) -> None:
    """The tiny SentencePiece vocabulary (`gguf_files.sentencepiece_tokens`) and the config's BOS / EOS."""
    tokens, scores, types = sentencepiece_tokens()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_unk_token_id(0)


def _write(
    writer: GGUFWriter, names: Any, tensors: dict[str, np.ndarray], qtype: GGMLQuantizationType, out: Path
) -> Path:
    """Store `tensors` (Hugging Face names, or llama.cpp's for names the map does not know) by
    llama.cpp name, 2-D ones as `qtype`, then write and close the file `out`."""
    for name, array in sorted(tensors.items()):
        base, kind = name.rsplit(".", 1)
        gguf = base if base.startswith("rope_factors") else names.get_name(base)
        assert gguf is not None, name
        if array.ndim == 2 and qtype != GGMLQuantizationType.F32:
            writer.add_tensor(f"{gguf}.{kind}", quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(f"{gguf}.{kind}", np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
