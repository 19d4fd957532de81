"""Write a seeded random checkpoint in the exact Hugging Face layout, with a locally trained tokenizer.

The engine needs real model folders for tests and benchmarks without downloading any: this writes
`config.json`, `model.safetensors` (or shards plus `model.safetensors.index.json`), `tokenizer.json` and
`tokenizer_config.json` with the tensor names, config keys and special tokens of Hugging Face's Llama,
Qwen2, Qwen3 and Gemma 3 (text) classes, so transformers or vLLM could load the same folder. The weights are random
(no language is learned) but scaled so logits spread widely and greedy choices are not near-ties.

Presets (shapes in PRESETS):
    tiny   ~0.5 M parameters, for tests: vocab 512, hidden 128, 2 layers, 4 heads x head_dim 32,
           2 KV heads. head_dim 32 rather than 16 because vLLM's CPU attention backend rejects 16.
    small  ~100-125 M parameters (tied / untied), for benchmarks: vocab 32000, hidden 768, 12 layers,
           12 heads x head_dim 64, 4 KV heads, MLP 2048.
Gemma 3 (`arch="gemma3"`, `Gemma3ForCausalLM`) interleaves sliding-window layers with global ones: layer i
is global when (i + 1) % 6 == 0 or it is the last layer (`gemma3_layer_types`: tiny's two layers are one
of each, small's twelve are 10 sliding and 2 global, Gemma 3's 5:1), with a window of
`GEMMA3_WINDOWS[preset]` tokens (64 for tiny, 512 for small, Gemma 3 1B's), q/k norms, four norms per
layer stored as Gemma's offsets from 1, tied embeddings and the two RoPE bases of transformers 5's
`rope_parameters`. Its embeddings are drawn smaller (the model scales them by sqrt(hidden)) and its
norms carry the gains (`_random_tensors`).
The tokenizer is a byte-level BPE trained on `TRAINING_TEXT`; it has fewer ids than either vocabulary,
so the rows above it are padding (as in real checkpoints whose vocab_size is rounded up), scaled down
by 10 in the LM head so that greedy decoding mostly picks tokens that decode to text.

vLLM has no counterpart that writes a checkpoint: its `--load-format dummy` fills a real model config with
random weights in memory, and its tests download small models from the hub.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError, TensorSpec, serialize_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from attention_kv_caceh.toy_model.training_text import TRAINING_TEXT

__all__ = [
    "ARCHITECTURES",
    "GEMMA3_WINDOWS",
    "PRESETS",
    "Preset",
    "bfloat16_bits",
    "gemma3_layer_types",
    "write_random_checkpoint",
]

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
GEMMA3_WINDOWS = {"tiny": 64, "small": 512}
"""sliding_window of a gemma3 checkpoint per preset (tokens)."""

# Residual-branch gain of o_proj and down_proj: layer outputs outweigh the token's own embedding in the
# residual stream, so tied-embedding models do not simply repeat their input token under greedy decoding.
OUT_GAIN = 3
_SAVE_DTYPES = ("float32", "float16", "bfloat16")  # safetensors TensorSpec dtype names


@dataclass(frozen=True)
class Preset:
    """Model shapes of a random checkpoint (Hugging Face config names)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int


PRESETS = {
    "tiny": Preset(512, 128, 2, 4, 2, 32, 384, 2048),
    "small": Preset(32000, 768, 12, 12, 4, 64, 2048, 4096),
}

# Special tokens per family: (tokens, bos, eos). Llama 3 and Qwen2 names; ids are 0, 1, 2 in order.
_SPECIAL = {
    "llama": (["<|begin_of_text|>", "<|end_of_text|>"], "<|begin_of_text|>", "<|end_of_text|>"),
    "qwen": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
    "gemma": (["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>"),
}
_CHAT_TEMPLATES = {
    "llama": "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}",
    "qwen": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "gemma": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
}


def gemma3_layer_types(num_layers: int) -> list[str]:
    """Gemma 3's interleaving for a random checkpoint: layer i global when (i + 1) % 6 == 0 or it is the
    last layer, sliding otherwise (so every checkpoint has both kinds)."""
    return [
        "full_attention" if (i + 1) % 6 == 0 or i == num_layers - 1 else "sliding_attention"
        for i in range(num_layers)
    ]


def bfloat16_bits(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """float32 -> bfloat16 bit patterns, rounding to nearest, ties to even (finite inputs).

    Adds 0x7FFF plus the lowest kept bit before dropping the 16 low bits (the rounding PyTorch uses).
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _train_tokenizer(family: str, vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 / Llama 3 / Qwen2 style) trained on TRAINING_TEXT, deterministic."""
    special, bos, _ = _SPECIAL[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    if bos is not None:  # Llama prepends its begin-of-text token to every encoding
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, special.index(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _random_tensors(
    arch: str, p: Preset, tie: bool, num_text_tokens: int, rng: np.random.Generator
) -> dict[str, npt.NDArray[np.float32]]:
    """Hugging Face tensor names -> float32 weights, drawn in a fixed order from `rng`.

    Projections ~ N(0, 1/in) keep activations O(1) (o_proj and down_proj times OUT_GAIN); embeddings
    and LM head ~ N(0, 16/hidden) give logits of standard deviation about 4; norm weights
    1 + N(0, 0.01); biases N(0, 0.01). Gemma 3 (tied): embeddings ~ N(0, 1/hidden), scaled by
    sqrt(hidden) in the model; its norms are stored as offsets w of the scale 1 + w, the scale
    1 + N(0, 0.01) but OUT_GAIN after attention and after the MLP (its branches' gain) and 4 for the
    final norm (logits of standard deviation about 4); each layer has the pre/post feed-forward norms
    and q/k norms of transformers' Gemma3DecoderLayer.
    """
    gemma = arch == "gemma3"

    def normal(shape: tuple[int, ...], std: float) -> npt.NDArray[np.float32]:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def norm_weight(size: int, scale: float = 1.0) -> npt.NDArray[np.float32]:
        return normal((size,), 0.1) + np.float32(scale - 1 if gemma else scale)

    hidden, inter = p.hidden_size, p.intermediate_size
    q_dim, kv_dim = p.num_attention_heads * p.head_dim, p.num_key_value_heads * p.head_dim
    head_std = (1 if gemma else 4) / np.sqrt(hidden)
    t: dict[str, npt.NDArray[np.float32]] = {
        "model.embed_tokens.weight": normal((p.vocab_size, hidden), head_std)
    }
    for i in range(p.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        t[f"model.layers.{i}.input_layernorm.weight"] = norm_weight(hidden)
        for name, rows in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            t[f"{a}{name}.weight"] = normal((rows, hidden), 1 / np.sqrt(hidden))
            if arch == "qwen2":
                t[f"{a}{name}.bias"] = normal((rows,), 0.1)
        if arch in ("qwen3", "gemma3"):
            t[f"{a}q_norm.weight"] = norm_weight(p.head_dim)
            t[f"{a}k_norm.weight"] = norm_weight(p.head_dim)
        t[f"{a}o_proj.weight"] = normal((hidden, q_dim), OUT_GAIN / np.sqrt(q_dim))
        # Gemma: the norm after attention (scale OUT_GAIN, as o_proj's gain elsewhere), then the MLP's two
        t[f"model.layers.{i}.post_attention_layernorm.weight"] = norm_weight(hidden, OUT_GAIN if gemma else 1)
        if gemma:
            t[f"model.layers.{i}.pre_feedforward_layernorm.weight"] = norm_weight(hidden)
            t[f"model.layers.{i}.post_feedforward_layernorm.weight"] = norm_weight(hidden, OUT_GAIN)
        t[f"{m}gate_proj.weight"] = normal((inter, hidden), 1 / np.sqrt(hidden))
        t[f"{m}up_proj.weight"] = normal((inter, hidden), 1 / np.sqrt(hidden))
        t[f"{m}down_proj.weight"] = normal((hidden, inter), OUT_GAIN / np.sqrt(inter))
    t["model.norm.weight"] = norm_weight(hidden, 4 if gemma else 1)  # Gemma: logits' spread about 4
    head = "model.embed_tokens.weight" if tie else "lm_head.weight"
    if not tie:
        t[head] = normal((p.vocab_size, hidden), head_std)
    t[head][num_text_tokens:] *= np.float32(0.1)  # padding rows of the vocabulary: rarely the argmax
    return t


def _gemma3_config_json(
    p: Preset, preset: str, tie: bool, dtype: str, bos_id: int, eos_id: int, pad_id: int
) -> dict[str, Any]:
    """config.json keys of transformers' Gemma3TextConfig (transformers 5: one RoPE object per layer type)."""
    return {
        "architectures": [ARCHITECTURES["gemma3"]],
        "model_type": "gemma3_text",
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": p.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": p.head_dim,
        "sliding_window": GEMMA3_WINDOWS[preset],
        "layer_types": gemma3_layer_types(p.num_hidden_layers),
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "tie_word_embeddings": tie,
        "dtype": dtype,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }


def _config_json(
    arch: str, p: Preset, tie: bool, dtype: str, bos_id: int | None, eos_id: int
) -> dict[str, Any]:
    """config.json keys of transformers' LlamaConfig / Qwen2Config / Qwen3Config."""
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5 if arch == "llama" else 1e-6,
        "rope_theta": 500000.0 if arch == "llama" else 1000000.0,
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "tie_word_embeddings": tie,
        "torch_dtype": dtype,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = False
    if arch == "llama":
        config["mlp_bias"] = False
        config["pretraining_tp"] = 1
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=p.num_hidden_layers)
    return config


def write_random_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    preset: str = "tiny",
    seed: int = 0,
    *,
    dtype: str = "float32",
    tie_word_embeddings: bool | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a random `arch` model of `preset` shapes into `out_dir` (created if needed); return the folder.

    arch: "llama" | "qwen2" | "qwen3" | "gemma3" (module docstring). dtype: "float32" | "float16" | "bfloat16" on disk (the weights
    are drawn in float32 and rounded to nearest). tie_word_embeddings: None = the family's habit for
    small models (Llama untied, Qwen and Gemma tied). max_shard_bytes: split tensors over
    `model-0000i-of-0000n.safetensors` files plus `model.safetensors.index.json` once a shard would
    exceed it; None writes one `model.safetensors`. The same arguments write byte-identical files.

    Raises ValueError for an unknown arch, preset or dtype, or max_shard_bytes < 1; OSError when a file
    cannot be written (a full disk: the safetensors library's SafetensorError is raised as an OSError).
    """
    if arch not in ARCHITECTURES or preset not in PRESETS or dtype not in _SAVE_DTYPES:
        raise ValueError(
            f"arch must be in {sorted(ARCHITECTURES)}, preset in {sorted(PRESETS)}, dtype in "
            f"{_SAVE_DTYPES}; got {arch!r}, {preset!r}, {dtype!r}"
        )
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1 or None, got {max_shard_bytes}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    family = {"llama": "llama", "gemma3": "gemma"}.get(arch, "qwen")
    tie = (arch != "llama") if tie_word_embeddings is None else tie_word_embeddings
    p = PRESETS[preset]
    special, bos, eos = _SPECIAL[family]

    tok = _train_tokenizer(family, min(p.vocab_size, 1024))
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": special[0] if family in ("qwen", "gemma") else eos,
        "model_max_length": p.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": _CHAT_TEMPLATES[family],
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8"
    )

    bos_id = special.index(bos) if bos is not None else 0  # Qwen lists <|endoftext|> as bos_token_id
    if arch == "gemma3":
        config = _gemma3_config_json(p, preset, tie, dtype, bos_id, special.index(eos), 0)
    else:
        config = _config_json(arch, p, tie, dtype, bos_id, special.index(eos))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    tensors = _random_tensors(arch, p, tie, tok.get_vocab_size(), np.random.default_rng(seed))
    _write_safetensors(out, tensors, dtype, max_shard_bytes)
    return out


def _umask() -> int:
    """The process umask (read by setting and restoring it; there is no getter)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_safetensors(
    out: Path, tensors: dict[str, npt.NDArray[np.float32]], dtype: str, max_shard_bytes: int | None
) -> None:
    """Save `tensors` in `dtype`, as one file or as shards with an index (transformers' file names)."""
    stored: dict[str, npt.NDArray[Any]] = {
        name: bfloat16_bits(a) if dtype == "bfloat16" else np.ascontiguousarray(a, dtype=dtype)
        for name, a in tensors.items()
    }
    shards: list[list[str]] = [[]]
    size = 0
    for name, a in stored.items():
        if max_shard_bytes is not None and shards[-1] and size + a.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += a.nbytes
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for file, names in zip(files, shards, strict=True):
        specs = {
            n: TensorSpec(
                dtype=dtype, shape=stored[n].shape, data_ptr=stored[n].ctypes.data, data_len=stored[n].nbytes
            )
            for n in names
        }
        try:
            serialize_file(specs, str(out / file), metadata={"format": "pt"})
        except SafetensorError as exc:  # the library's own error for a failed write (a full disk, say)
            raise OSError(f"{out / file}: {exc}") from exc
        os.chmod(out / file, 0o666 & ~_umask())  # the library writes 0600; give what open() would give
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(a.nbytes for a in stored.values())},
            "weight_map": {n: f for f, names in zip(files, shards, strict=True) for n in names},
        }
        (out / "model.safetensors.index.json").write_text(
            json.dumps(index, indent=2) + "\n", encoding="utf-8"
        )
