"""GGUF files of Gemma 2 / Gemma 3 Hugging Face folders, as llama.cpp's converter writes them (GGUFWriter).

Written from what `convert_hf_to_gguf.py` (its `Gemma2Model` / `Gemma3Model` classes and the base
`TextModel.set_gguf_parameters`) stores: llama.cpp's tensor names for these architectures (the gguf
library's `TensorNameMap`; note `ffn_norm` is Gemma's pre_feedforward_layernorm and
`post_attention_norm` its post_attention_layernorm), every `*norm.weight` stored as 1 + w (Gemma's
RMSNorm scales by 1 + w; the converter adds the 1), no permutation of q/k rows (Gemma's RoPE is
NeoX-style), no `output.weight` (tied), and the keys block_count, context_length, embedding_length,
feed_forward_length, head counts, key/value length, rms epsilon, rope.freq_base (the global layers'),
rope.freq_base_swa (Gemma 3: the sliding layers'), rope.scaling.{type,factor} (linear), sliding_window
and the soft-capping keys. The vocabulary is the tiny SentencePiece one of `gguf_files`. Importable
without the project (only gguf, numpy, safetensors): the scratch script that writes the references
uses it to check these files against transformers' own GGUF loader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, RopeScalingType, get_tensor_name_map
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
    tokens, scores, types = sentencepiece_tokens()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(False)
    for name, array in sorted(load_float32(folder).items()):
        if name == "lm_head.weight":
            continue  # tied
        base, kind = name.rsplit(".", 1)
        gguf = names.get_name(base)
        assert gguf is not None, name
        if name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # the converter's `data_torch + 1`
        if array.ndim == 2 and qtype != GGMLQuantizationType.F32:
            writer.add_tensor(f"{gguf}.{kind}", quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(f"{gguf}.{kind}", np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
