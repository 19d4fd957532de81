"""Read a GGUF file (llama.cpp's one-file checkpoint): tensors by Hugging Face name, the model config from metadata.

What vLLM's `model_executor/model_loader/gguf_loader.py` and `weight_utils.gguf_quant_weights_iterator`
do, at this project's size: the header is read by `gguf_metadata.py` (lazily, over a memory map; the
`gguf` library's `GGUFReader` parses every key, seconds for a large vocabulary), a split model's parts
are joined by `gguf_split.py`, tensors are renamed from llama.cpp's names (`blk.3.attn_q.weight`)
to Hugging Face's (`model.layers.3.self_attn.q_proj.weight`) and dequantized with `gguf.quants.dequantize`
(every type the library implements: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K to
Q6_K, the IQ and TQ types, MXFP4, NVFP4; F64 is read as it is). `quantized(name)` hands out a tensor as
the file stores it (its type, its shape, its raw blocks), for kernels that compute on the blocks.
Gemma 2 / Gemma 3 name their norms differently (`ffn_norm` is Gemma's pre_feedforward_layernorm,
`post_attention_norm` its post_attention_layernorm, `post_ffw_norm` its post_feedforward_layernorm:
the gguf library's `TensorNameMap`), and the converter stores each Gemma norm weight as 1 + w (the
model adds no 1 for a GGUF file). Phi-3 (`phi3`) stores q/k/v fused row-wise (`attn_qkv`: q; k; v,
Hugging Face's `qkv_proj`; files that hold `attn_q` / `attn_k` / `attn_v` apart are read too) and gate/up
fused (`ffn_up`: 2 I rows, gate first, as llama.cpp's SwiGLU splits it: Hugging Face's `gate_up_proj`).
Left out: architectures other than llama / qwen2 / qwen3 / gemma2 / gemma3 / phi3 and anything those do
not use (MoE experts, RoPE scaling other than linear).

**llama.cpp's Q/K row order.** llama.cpp rotates adjacent pairs (x[2i], x[2i+1]) of a head, Hugging
Face's Llama the two halves (x[i], x[i + D/2]); its converter (`convert_hf_to_gguf.py`,
`LlamaModel.permute`) therefore reorders the rows of q_proj and k_proj (and their biases) within each
head. For head h, 0 <= i < D/2 and j in {0, 1}:

    GGUF row  h*D + 2*i + j  =  Hugging Face row  h*D + j*D/2 + i

`unpermute_rows` undoes it (heads = num_attention_heads for q, num_key_value_heads for k). Only the
llama architecture is permuted: llama.cpp runs qwen2, qwen3, gemma2, gemma3 and phi3 with the halves
convention (NeoX RoPE).

Every problem with the file (not GGUF, truncated, a tensor type the library does not define or cannot
dequantize, an architecture or setting the model does not implement, a missing or mistyped metadata
key, a tensor whose data offset is not a multiple of `general.alignment`) is one `CheckpointError`
naming the file and the value, raised when the file is opened, before any weight is read.
`check_finite` then scans what costs one pass over the memory map: every F32 / F16 / F64 / BF16
tensor, and the float16 scales of the block types in `_BLOCK_SCALES` (their integer quants cannot be
non-finite); the other types' blocks (IQ, TQ, MXFP4, NVFP4) are not scanned.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from attention_kv_caceh.model_executor.checkpoint import CheckpointError
from attention_kv_caceh.model_executor.gguf_metadata import TensorInfo, open_gguf
from attention_kv_caceh.model_executor.gguf_split import split_parts

__all__ = [
    "GGUF_ARCHITECTURES",
    "ROPE_FACTOR_TENSORS",
    "GGUFCheckpoint",
    "QuantizedTensor",
    "dequantizable_types",
    "gguf_name",
    "unpermute_rows",
]

logger = logging.getLogger(__name__)

# general.architecture -> the Hugging Face class whose tensors and settings it carries
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.{i}.<llama.cpp name>.{weight,bias} -> model.layers.{i}.<Hugging Face name>.{weight,bias}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's four norms per layer (llama.cpp's names for its sandwich norms)
_GEMMA_LAYER_NAMES = _LAYER_NAMES | {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3's fused q/k/v and gate/up (llama.cpp's `ffn_up` holds both; there is no `ffn_gate`)
_PHI3_LAYER_NAMES = {k: v for k, v in _LAYER_NAMES.items() if k != "ffn_gate"} | {
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
_ARCH_LAYER_NAMES = {"gemma2": _GEMMA_LAYER_NAMES, "gemma3": _GEMMA_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES}
# per-frequency RoPE factors -> the scaling they carry (gguf_config refuses them; not logged as ignored)
ROPE_FACTOR_TENSORS = {
    "rope_freqs.weight": "llama3 RoPE scaling (per-frequency factors)",
    "rope_factors_long.weight": "LongRoPE (Phi-3's per-frequency factors past the original context)",
    "rope_factors_short.weight": "LongRoPE (Phi-3's per-frequency factors within the original context)",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_PLAIN_FLOATS = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.F64}
_Q = GGMLQuantizationType
# block type -> byte offsets of its float16 scales inside one block (ggml-common.h's block_* structs)
_BLOCK_SCALES: dict[GGMLQuantizationType, tuple[int, ...]] = {
    _Q.Q4_0: (0,),
    _Q.Q4_1: (0, 2),
    _Q.Q5_0: (0,),
    _Q.Q5_1: (0, 2),
    _Q.Q8_0: (0,),
    _Q.Q2_K: (80, 82),
    _Q.Q3_K: (108,),
    _Q.Q4_K: (0, 2),
    _Q.Q5_K: (0, 2),
    _Q.Q6_K: (208,),
}


def dequantizable_types() -> tuple[str, ...]:
    """Names of the tensor types this reader widens to floats: F32, F16, F64 and every type the installed
    `gguf` library dequantizes."""
    library = {t for t in GGMLQuantizationType if t not in _PLAIN_FLOATS and _dequantizes(t)}
    return tuple(t.name for t in GGMLQuantizationType if t in _PLAIN_FLOATS or t in library)


def _dequantizes(qtype: GGMLQuantizationType) -> bool:
    import gguf.quants

    return qtype in gguf.quants._type_traits  # pyright: ignore[reportPrivateUsage]


def unpermute_rows(rows: npt.NDArray[Any], heads: int) -> npt.NDArray[Any]:
    """Rows of a llama-architecture q/k projection (or bias) from llama.cpp's order back to Hugging Face's.

    `rows`: `[heads * D, ...]` of any dtype (float weights, a bias, or raw quantized blocks: only whole
    rows move). GGUF row h*D + 2*i + j becomes row h*D + j*D/2 + i (see the module docstring). Returns
    a new array. Raises ValueError when the rows do not split into `heads` heads of even size.
    """
    n = rows.shape[0]
    if heads < 1 or n % heads or (n // heads) % 2:
        raise ValueError(f"{n} rows do not split into {heads} heads of an even size")
    d = n // heads
    return np.ascontiguousarray(
        rows.reshape(heads, d // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
    )


@dataclass(frozen=True)
class QuantizedTensor:
    """One tensor as the file stores it, rows in Hugging Face order.

    ggml_type: the GGML type name ("Q4_1", "Q8_0", "F32", ...). shape: the logical `(out, in)` (or
    `(n,)`) shape in Hugging Face layout. data: F32/F16/F64 tensors as that float dtype, `shape`;
    block-quantized ones as uint8 `[out, in // block_size * type_size]`, each row `in // block_size`
    blocks of `type_size` bytes, each block `block_size` weights (GGML's block layout, e.g. Q8_0: a
    float16 scale d then 32 int8 q, weight = d * q; Q4_1: float16 d and m, then 16 bytes of nibbles,
    weight = d * q + m). A view of the memory-mapped file, except q/k rows that were reordered (a copy).
    """

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    data: npt.NDArray[Any]
    block_size: int
    type_size: int


class GGUFCheckpoint:
    """The tensors and metadata of one GGUF file, tensors by Hugging Face name.

    Same interface as `SafetensorsCheckpoint` (`names`, `in`, `shape(name)`, `get(name, dtype)`,
    `source`), plus `quantized(name)` and `metadata(key)` (its ModelConfig: `gguf_config.model_config_from_gguf`). The file is parsed once per
    process and version (a small cache), memory-mapped, and each tensor is read when asked for.

    Raises CheckpointError (from the constructor) for a file that is not GGUF, truncated or corrupt, an
    architecture outside GGUF_ARCHITECTURES, or a tensor the model reads whose type cannot be
    dequantized. Tensors the model does not read are logged as a warning and ignored (but for the RoPE
    factors of ROPE_FACTOR_TENSORS, which the config refuses).
    """

    def __init__(self, file: str | Path) -> None:
        self.source = Path(file)
        self._file = open_gguf(self.source)
        self.parts = split_parts(self._file)
        self.arch = self._architecture()
        self._tensors: dict[str, TensorInfo] = {}
        ignored: list[str] = []
        self._layer_names = _ARCH_LAYER_NAMES.get(self.arch, _LAYER_NAMES)
        for tensor in (t for part in self.parts for t in part.tensors):
            hf = _hf_name(tensor.name, self._layer_names)
            if hf is not None:
                self._tensors[hf] = tensor
            elif tensor.name not in ROPE_FACTOR_TENSORS:  # those: refused by the config
                ignored.append(tensor.name)
        if ignored:
            logger.warning(
                "%s: ignoring tensors the model does not read: %s", self.source, ", ".join(ignored)
            )
        readable = set(dequantizable_types())
        for tensor in self._tensors.values():  # each lies inside its file (gguf_metadata checks)
            if tensor.tensor_type.name not in readable:
                raise CheckpointError(
                    f"{self.source}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which "
                    f"cannot be dequantized (readable: {', '.join(sorted(readable))})"
                )

    def check_finite(self) -> None:
        """Raise CheckpointError naming the first tensor the model reads that holds a NaN or an infinity:
        a float tensor (F32, F16, F64, BF16) with such a value, or a block type of `_BLOCK_SCALES` with
        such a scale (module docstring). One pass over those bytes of the memory-mapped file; other
        block types are not scanned."""
        for tensor in self._tensors.values():
            bad = _non_finite(tensor)
            if bad is None:
                continue
            count, first, what = bad
            row_len = int(tensor.dims[0])  # GGUF lists the innermost dimension first
            block = GGML_QUANT_SIZES[tensor.tensor_type][0]
            row = first * (1 if what == "values" else block) // row_len
            raise CheckpointError(
                f"{self.source}: tensor {tensor.name!r} ({tensor.tensor_type.name}): {count:,} NaN or "
                f"infinite {what}, the first in row {row}"
            )

    # -- metadata --------------------------------------------------------------------------------

    def metadata(self, key: str, default: Any = None) -> Any:
        """Metadata value `key` as Python (int, float, bool, str, or a list of them), or `default`.
        The keys are the first part's (a split file's other parts hold only the split.* keys)."""
        return self._file.value(key, default)

    def metadata_type(self, key: str) -> list[GGUFValueType]:
        """The GGUF value types of `key` ([ARRAY, STRING] for a list of strings), [] when absent."""
        return self._file.types(key)

    def metadata_array(self, key: str) -> npt.NDArray[Any] | None:
        """A numeric array key as a read-only NumPy view of the file (token scores), or None."""
        return self._file.array(key)

    def _architecture(self) -> str:
        arch = self.metadata("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise CheckpointError(
                f"{self.source}: key 'general.architecture': unsupported {arch!r}; supported: "
                f"{', '.join(GGUF_ARCHITECTURES)}"
            )
        return cast(str, arch)

    # -- tensors ---------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """Every tensor the model can read, by Hugging Face name, sorted."""
        return sorted(self._tensors)

    @property
    def gguf_names(self) -> list[str]:
        """Every tensor name in the file (llama.cpp's names), in file order (part after part)."""
        return [t.name for part in self.parts for t in part.tensors]

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def _tensor(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(
                f"{self.source}: missing tensor {name!r} ({gguf_name(name, self.arch)})"
            ) from None

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor `name` in Hugging Face layout (`[out, in]`; GGUF lists dims innermost first)."""
        return tuple(reversed(self._tensor(name).dims))

    def quantized(self, name: str) -> QuantizedTensor:
        """Tensor `name` as stored (see QuantizedTensor), q/k rows reordered as `get` reorders them."""
        tensor = self._tensor(name)
        block_size, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
        shape = self.shape(name)
        data = self._unpermute(name, tensor.data.reshape(shape[0], -1) if len(shape) == 2 else tensor.data)
        return QuantizedTensor(name, tensor.tensor_type.name, shape, data, block_size, type_size)

    def get(self, name: str, dtype: npt.DTypeLike) -> npt.NDArray[np.floating[Any]]:
        """Tensor `name` as a C-contiguous array of floating `dtype`, Hugging Face layout and row order.

        Quantized types are dequantized by `gguf.quants.dequantize` (float32), then converted to `dtype`
        (exactly when widening): a new array. A tensor the file already stores in `dtype`, in that row
        order, comes back as a read-only view of the memory-mapped file (copy it to write to it).
        Raises CheckpointError when the tensor is absent.
        """
        tensor = self._tensor(name)
        shape = self.shape(name)
        if tensor.tensor_type in _PLAIN_FLOATS:
            values: npt.NDArray[Any] = np.asarray(tensor.data)
        else:
            values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
        values = self._unpermute(name, values.reshape(shape))
        return np.ascontiguousarray(values, dtype=dtype)

    def _unpermute(self, name: str, rows: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """llama's q_proj / k_proj rows (weight or bias) back to Hugging Face order; others unchanged."""
        if self.arch != "llama":
            return rows
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            heads = self._heads("attention.head_count")
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            heads = self._heads("attention.head_count_kv", "attention.head_count")
        else:
            return rows
        try:
            return unpermute_rows(rows, heads)
        except ValueError as err:
            raise CheckpointError(f"{self.source}: tensor {gguf_name(name, self.arch)!r}: {err}") from err

    def _heads(self, key: str, fallback: str | None = None) -> int:
        value: Any = self.metadata(f"{self.arch}.{key}")
        if value is None and fallback is not None:
            value = self.metadata(f"{self.arch}.{fallback}")
        if isinstance(value, list):  # one count per layer; the config check refuses unequal ones
            value = cast(list[Any], value)[0] if value else None
        if not isinstance(value, int):
            raise CheckpointError(
                f"{self.source}: key '{self.arch}.{key}': must be an integer, got {value!r}"
            )
        return value


def _non_finite(tensor: TensorInfo) -> tuple[int, int, str] | None:
    """(how many, flat index of the first, "values" or "block scales") of a tensor's non-finite
    values (float types) or scales (`_BLOCK_SCALES`), None when all are finite or not scanned."""
    qtype = tensor.tensor_type
    data = np.asarray(tensor.data)
    if qtype in _PLAIN_FLOATS:
        bad = ~np.isfinite(data.reshape(-1))
        what = "values"
    elif qtype == _Q.BF16:
        bits = data.reshape(-1).view(np.uint16)
        bad = (bits & 0x7F80) == 0x7F80  # exponent all ones: an infinity or a NaN
        what = "values"
    elif qtype in _BLOCK_SCALES:
        type_size = GGML_QUANT_SIZES[qtype][1]
        blocks = data.reshape(-1).view(np.uint8).reshape(-1, type_size)
        bad = np.zeros(blocks.shape[0], dtype=bool)
        for at in _BLOCK_SCALES[qtype]:
            scale = np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16).reshape(-1)
            bad |= ~np.isfinite(scale)
        what = "block scales"
    else:
        return None
    count = int(np.count_nonzero(bad))
    return None if count == 0 else (count, int(np.argmax(bad)), what)


def _hf_name(gguf_name: str, layer_names: dict[str, str] = _LAYER_NAMES) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name (`layer_names`: the architecture's per-layer
    names), or None for one the model does not read."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in layer_names:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{layer_names[part]}.{kind}"


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """The llama.cpp name of a Hugging Face tensor name in a file of architecture `arch` (for
    messages): "blk.3.ffn_up.weight"; `hf_name` itself when it has none."""
    for name, hf in _GLOBAL_NAMES.items():
        if hf == hf_name:
            return name
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
    if match:
        for part, hf in _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES).items():
            if hf == match.group(2):
                return f"blk.{match.group(1)}.{part}.{match.group(3)}"
    return hf_name
