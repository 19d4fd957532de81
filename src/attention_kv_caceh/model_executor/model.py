"""Llama, Mistral, Qwen2 and Qwen3 decoders in NumPy: one forward over a step's flattened batch.

What vLLM keeps in `model_executor/models/llama.py` and `qwen2.py` / `qwen3.py`: the decoder stack reads
the tokens of every scheduled request as one `[N, D_model]` matrix with per-token positions, so prefill
chunks and decode tokens of different requests share each weight read; only attention looks at which
request a token belongs to (`paged_attention`). The architectures differ in three switches:
Qwen2 adds biases to the q/k/v projections, Qwen3 RMS-normalises each query and key head before RoPE
(`q_norm`/`k_norm`) and sets `head_dim` explicitly; Mistral's tensors are Llama's. Left out: tensor
parallelism, sliding-window attention, and RoPE scalings other than "llama3".

Each linear layer is `layers.linear(x, W)` = x W^T over a `layers.LinearWeight`: on the "packed" GEMM
path (float32 activations on a CPU with AVX-512, AVX2 or NEON, the default there) the weights are kept
here, at load, as the compiled kernels read them (`model_weights`: float32 or bfloat16 panels for
`attention_kv_caceh.kernels.gemm`, GGUF blocks for `attention_kv_caceh.kernels.block_gemm`), each weight read once for
all N rows of a step; on the "numpy" path (float64, other CPUs, or asked for) W keeps the Hugging Face
layout `[out, in]` (the floats a compact format decodes to) and the product is `x @ W.T`, the packed
path's oracle. q/k/v and gate/up are fused row-wise (one matmul each). A tied LM head shares the
embedding array on the numpy path and is a packed copy of it on the packed path (or, kept as a GGUF
file's blocks, the same blocks). The packed path also runs RMSNorm, RoPE and SiLU-and-mul as the compiled
passes of `layers` (`compiled_rms_norm`, ...), whose NumPy formulas the numpy path keeps, except
RoPE after Qwen3's per-head norm. A step whose requests all decode uses the compiled
`kernels.paged_decode_attention_into` (one call per layer: online softmax over each request's blocks
read in place through its block table, no gather); the test-only NumPy reference
`oracle.reference_paged_decode_attention` is its oracle. `forward` trusts its inputs: the model runner validates
a step once (`ModelRunner.prepare_inputs`).

Shape legend: N scheduled tokens, R scheduled requests, D_model hidden size, H query heads, H_kv KV
heads, D head dim, I MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.kernels.block_gemm import BLOCK_FORMATS, prepare_block_linear
from attention_kv_caceh.kernels.decode_attention import paged_decode_attention_into
from attention_kv_caceh.kernels.gemm import prepare_packed_linear
from attention_kv_caceh.kernels.isa import compiled_variant
from attention_kv_caceh.model_executor.checkpoint import SafetensorsCheckpoint, read_config_json
from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint
from attention_kv_caceh.model_executor.layers import (
    GEMM_PATHS,
    LinearWeight,
    apply_rotary,
    compiled_rms_norm,
    compiled_rotary,
    compiled_silu_and_mul,
    linear,
    prepare_compiled_layers,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    silu_and_mul,
)
from attention_kv_caceh.model_executor.model_config import ModelConfig
from attention_kv_caceh.model_executor.model_weights import WeightReader
from attention_kv_caceh.model_executor.paged_attention import AttentionMetadata, paged_attention, write_kv

__all__ = [
    "ENGINE_DTYPES",
    "GEMM_CHOICES",
    "QUANTIZATIONS",
    "Model",
    "ModelConfig",
    "compute_dtype",
    "resolve_gemm_path",
    "weight_format",
]

FloatArray = npt.NDArray[np.floating[Any]]
ENGINE_DTYPES = ("float32", "float64", "bfloat16")
"""vLLM's `--dtype` words: float32 and float64 keep weights, activations and KV cache in that dtype;
bfloat16 keeps the linear layers' weights in bfloat16 and computes in float32 (activations, sums, KV)."""
GEMM_CHOICES = ("auto", *GEMM_PATHS)
QUANTIZATIONS = (*BLOCK_FORMATS, "gguf")
"""`quantization` values (vLLM's `--quantization`): a GGUF block format (llama.cpp's names) the linear
layers' weights are kept in, a float checkpoint quantized at load (`block_gemm.quantize_weight`); or
"gguf": a GGUF file's own Q8_0 / Q4_0 / Q4_1 tensors, as its bytes (`engine.model_weights`)."""


def compute_dtype(dtype: str) -> np.dtype[Any]:
    """The dtype activations, sums and the KV cache have for engine `dtype` (bfloat16 -> float32).
    Raises ValueError for a dtype outside ENGINE_DTYPES."""
    if dtype not in ENGINE_DTYPES:
        raise ValueError(f"dtype must be one of {ENGINE_DTYPES}, got {dtype!r}")
    return np.dtype(np.float32 if dtype == "bfloat16" else dtype)


def weight_format(dtype: str, quantization: str | None) -> str:
    """How the linear layers store their weights: the quantization's block format, else the dtype.
    Raises ValueError for an unknown dtype or quantization, or a quantization with bfloat16."""
    compute_dtype(dtype)
    if quantization is None:
        return dtype
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
    if dtype == "bfloat16":
        raise ValueError(
            f"quantization {quantization!r} keeps its own block format: use dtype float32, not bfloat16"
        )
    return quantization


def resolve_gemm_path(gemm: str, dtype: str, quantization: str | None = None) -> tuple[str, str]:
    """The GEMM path for `gemm` ("auto", "packed" or "numpy"), engine `dtype` and `quantization`, and a
    one-line note naming the kernel variant (`simd.compiled_variant`).

    "auto" takes "packed" where a kernel variant exists for the CPU Numba compiles for and the activations
    are float32 (dtype float32 or bfloat16), "numpy" otherwise: float64, a CPU without AVX2, AVX-512
    or NEON, or asked for; the numpy path multiplies by the floats the weight format decodes to.
    Raises ValueError for a `gemm` outside GEMM_CHOICES, an unknown dtype or quantization (as
    `weight_format`), or "packed" with float64 or without a kernel variant.
    """
    if gemm not in GEMM_CHOICES:
        raise ValueError(f"gemm must be one of {GEMM_CHOICES}, got {gemm!r}")
    fmt = weight_format(dtype, quantization)
    float32 = compute_dtype(dtype) == np.float32
    if gemm == "packed" and not float32:
        raise ValueError(
            f"the packed GEMM path needs float32 activations (dtype float32 or bfloat16), got {dtype!r}"
        )
    simd = compiled_variant()
    if gemm == "packed" and simd is None:
        raise ValueError("the packed GEMM path has no kernel for this CPU (no AVX2, AVX-512 or NEON variant)")
    if gemm == "numpy" or not float32 or simd is None:
        why = (
            "asked for" if gemm == "numpy" else (dtype if not float32 else "no AVX2, AVX-512 or NEON variant")
        )
        return (
            "numpy",
            f"GEMM path: numpy (x @ W.T on {fmt} weights decoded to {compute_dtype(dtype)}; {why})",
        )
    how = "GGUF blocks dequantized in registers" if fmt in BLOCK_FORMATS else f"{fmt} panels packed at load"
    if fmt == "gguf":
        how = "the file's Q8_0 / Q4_0 / Q4_1 blocks dequantized in registers, other types float32 panels"
    if fmt == "bfloat16":
        how += ", vdpbf16ps" if simd.bf16_dot else ", widened in registers"
    return "packed", f"GEMM path: packed {simd.isa} {fmt} ({how}; {simd.describe()})"


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights; q/k/v and gate/up are fused row-wise (one matmul each)."""

    input_layernorm: FloatArray  # [D_model]
    qkv_proj: LinearWeight  # [(H + 2 H_kv) D, D_model] = q_proj; k_proj; v_proj
    qkv_bias: FloatArray | None  # [(H + 2 H_kv) D]   (Qwen2)
    q_norm: FloatArray | None  # [D]   (Qwen3)
    k_norm: FloatArray | None  # [D]   (Qwen3)
    o_proj: LinearWeight  # [D_model, H D]
    o_bias: FloatArray | None  # [D_model]
    post_attention_layernorm: FloatArray  # [D_model]
    gate_up_proj: LinearWeight  # [2 I, D_model] = gate_proj; up_proj
    down_proj: LinearWeight  # [D_model, I]


class Model:
    """A decoder-only transformer with weights as NumPy arrays (float32 or float64), or compact linear
    layers (bfloat16, GGUF blocks) that compute in float32.

    Build with `Model.load(folder, dtype, gemm, quantization)`. `forward` runs the decoder stack over a
    flattened batch and writes the new K/V into the paged caches; `compute_logits` applies the LM head
    to chosen rows. dtype: the activations' and KV cache's NumPy dtype (`compute_dtype`); weight_format:
    how the linear layers keep their weights (`weight_format`). gemm_path is the GEMM path its linear
    layers take and gemm_note a one-line note saying so (for the CLI to print); gemm_compile_s the
    seconds the compile (or disk-cache load) of the packed path's kernels (the GEMM and the compiled
    small layers) took here.
    """

    def __init__(
        self,
        config: ModelConfig,
        checkpoint: SafetensorsCheckpoint | GGUFCheckpoint,
        dtype: str = "float32",
        gemm: str = "auto",
        quantization: str | None = None,
    ) -> None:
        """Read every tensor `config` needs from `checkpoint`, converted to `compute_dtype(dtype)`; store
        the linear layers' weights as `weight_format(dtype, quantization)` for the GEMM path
        (`resolve_gemm_path(gemm, dtype, quantization)`): packed for its kernel, or as floats for NumPy.

        Raises ValueError for a dtype, quantization or gemm `resolve_gemm_path` refuses (or a block
        format with an input width that is not a multiple of 32), CheckpointError (naming the file
        and key) for a missing tensor or one of the wrong shape.
        """
        self.gemm_path, self.gemm_note = resolve_gemm_path(gemm, dtype, quantization)
        self.weight_format = weight_format(dtype, quantization)
        self.config = config
        self.dtype = compute_dtype(dtype)
        c = config
        read = WeightReader(checkpoint, self.dtype, self.gemm_path, self.weight_format)
        get = read.tensor
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        hidden, inter = c.hidden_size, c.intermediate_size
        self.embedding = read.embedding("model.embed_tokens.weight", (c.vocab_size, hidden))  # [V, D_model]
        self.embed_tokens = self.embedding.table  # [V, D_model] floats, or None when kept as GGUF blocks
        self.layers: list[_Layer] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            proj = ("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)
            qkv_bias = (
                np.concatenate([get(f"{a}{n}.bias", (rows,)) for n, rows in proj]) if c.qkv_bias else None
            )
            self.layers.append(
                _Layer(
                    input_layernorm=get(p + "input_layernorm.weight", (hidden,)),
                    qkv_proj=read.linear([(f"{a}{n}.weight", (rows, hidden)) for n, rows in proj]),
                    qkv_bias=qkv_bias,
                    q_norm=get(a + "q_norm.weight", (c.head_dim,)) if c.qk_norm else None,
                    k_norm=get(a + "k_norm.weight", (c.head_dim,)) if c.qk_norm else None,
                    o_proj=read.linear([(a + "o_proj.weight", (hidden, q_dim))]),
                    o_bias=get(a + "o_proj.bias", (hidden,)) if c.o_proj_bias else None,
                    post_attention_layernorm=get(p + "post_attention_layernorm.weight", (hidden,)),
                    gate_up_proj=read.linear(
                        [
                            (f"{p}mlp.gate_proj.weight", (inter, hidden)),
                            (f"{p}mlp.up_proj.weight", (inter, hidden)),
                        ]
                    ),
                    down_proj=read.linear([(p + "mlp.down_proj.weight", (hidden, inter))]),
                )
            )
        self.norm = get("model.norm.weight", (hidden,))  # [D_model]
        # Tied embeddings: the LM head is the embedding matrix, as in transformers, which ties them
        # even when a file also stores lm_head.weight (usually it is omitted).
        if c.tie_word_embeddings:
            self.lm_head = read.tied_head(self.embedding)  # [V, D_model]
        else:
            self.lm_head = read.linear([("lm_head.weight", (c.vocab_size, hidden))])  # [V, D_model]
        self.weight_notes = read.notes  # layers that could not keep the file's format
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)  # [D/2], float64
        self.gemm_compile_s = 0.0
        if self.gemm_path == "packed":
            kernels = sum(
                prepare_block_linear(f) if f in BLOCK_FORMATS else prepare_packed_linear(f)
                for f in read.kernels
            )
            self.gemm_compile_s = kernels + prepare_compiled_layers(self.dtype)

    @classmethod
    def load(
        cls, path: str | Path, dtype: str = "float32", gemm: str = "auto", quantization: str | None = None
    ) -> Model:
        """Load a checkpoint in engine `dtype`, GEMM path `gemm`, linear weights as `quantization` says: a
        Hugging Face folder (config.json + safetensors) or a GGUF file, a folder holding one, or a model
        name (`model_source.resolve_model`). quantization None: weights in the dtype (a GGUF file's are
        dequantized here); a block format: quantized at load; "gguf": a GGUF file's Q8_0 / Q4_0 / Q4_1
        tensors kept as the file stores them.

        Raises CheckpointError for anything the checkpoint lacks or the model does not implement,
        ValueError as `Model()` does.
        """
        from attention_kv_caceh.model_executor.model_source import gguf_file_of

        gguf = gguf_file_of(path)
        if gguf is not None:
            checkpoint = GGUFCheckpoint(gguf)
            return cls(checkpoint.config(), checkpoint, dtype, gemm, quantization)
        if quantization == "gguf":
            raise ValueError(
                f"quantization 'gguf' keeps a GGUF file's blocks; {path} is not a GGUF checkpoint"
            )
        config = ModelConfig.from_hf_config(read_config_json(path), source=Path(path) / "config.json")
        return cls(config, SafetensorsCheckpoint(path), dtype, gemm, quantization)

    @property
    def num_parameters(self) -> int:
        """Parameters of the checkpoint, counting a tied LM head once (a packed copy is not a parameter)."""
        sizes = [self.embedding.size, self.norm.size]
        if not self.config.tie_word_embeddings:
            sizes.append(self.lm_head.size)
        for layer in self.layers:
            sizes += [a.size for a in vars(layer).values() if a is not None]
        return sum(int(size) for size in sizes)

    def forward(
        self,
        input_ids: npt.NDArray[np.integer[Any]],
        positions: npt.NDArray[np.integer[Any]],
        kv_caches: list[tuple[FloatArray, FloatArray]],
        metadata: AttentionMetadata,
    ) -> FloatArray:
        """Hidden states after the final norm, `[N, D_model]`, for the step's N flattened tokens.

        input_ids, positions `[N]`; kv_caches one (K, V) pair per layer as
        `paged_attention.allocate_kv_cache` makes them, in the compute dtype: this step's K/V are written into them
        at metadata.slot_mapping. Each layer (Touvron et al., 2023, Llama):
            h = x + o_proj(attention(rope(q), rope(k), v)),  q, k, v = qkv_proj(rms_norm(x))
            x' = h + down_proj(silu(gate_proj(rms_norm(h))) * up_proj(rms_norm(h)))
        No checks: the arguments are those `ModelRunner.prepare_inputs` validated (token ids in the
        vocabulary, positions and slots inside each request's blocks) and caches of the engine dtype.
        """
        c = self.config
        n = input_ids.shape[0]
        h, h_kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        eps = c.rms_norm_eps
        compiled = self.gemm_path == "packed"  # float32: the compiled small layers too
        norm = compiled_rms_norm if compiled else rms_norm
        silu_mul = compiled_silu_and_mul if compiled else silu_and_mul
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.dtype)  # [N, D] each
        x = self.embedding.lookup(input_ids)  # [N, D_model]
        decode = metadata.is_pure_decode
        # The compiled decode kernel's arguments, made once per step: int32 lengths, its output buffer
        # (rewritten by every layer; R == N in a decode step) and the scale 1 / sqrt(D).
        context_lens = metadata.context_lens.astype(np.int32)  # [R]
        decode_out = np.empty((n if decode else 0, h, d), dtype=self.dtype)  # [R, H, D]
        scale = 1.0 / math.sqrt(d)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            qkv = linear(norm(x, layer.input_layernorm, eps), layer.qkv_proj)  # [N, (H + 2 H_kv) D]
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            v = qkv[:, (h + h_kv) * d :].reshape(n, h_kv, d)  # [N, H_kv, D]
            if compiled and layer.q_norm is None:  # rotated straight out of qkv, into contiguous q and k
                q, k = compiled_rotary(qkv, 0, h, cos, sin), compiled_rotary(qkv, h * d, h_kv, cos, sin)
            else:
                q = qkv[:, : h * d].reshape(n, h, d)  # [N, H, D]
                k = qkv[:, h * d : (h + h_kv) * d].reshape(n, h_kv, d)  # [N, H_kv, D]
                if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3: RMSNorm over each head
                    q, k = rms_norm(q, layer.q_norm, eps), rms_norm(k, layer.k_norm, eps)
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # [N, H, D], [N, H_kv, D]
            write_kv(k_cache, v_cache, k, v, metadata.slot_mapping)
            if decode:  # one query per request: [R, H, D] with R == N
                q = np.ascontiguousarray(q)  # [R, H, D]
                tables = metadata.block_tables  # [R, max_blocks]
                paged_decode_attention_into(q, k_cache, v_cache, tables, context_lens, decode_out, scale)
                attn = decode_out
            else:
                attn = paged_attention(q, k_cache, v_cache, metadata)  # [N, H, D]
            out = linear(attn.reshape(n, h * d), layer.o_proj)  # [N, D_model]
            x = x + (out if layer.o_bias is None else out + layer.o_bias)
            gate_up = linear(norm(x, layer.post_attention_layernorm, eps), layer.gate_up_proj)  # [N, 2 I]
            x = x + linear(silu_mul(gate_up), layer.down_proj)  # [N, I] -> [N, D_model]
        return norm(x, self.norm, eps)  # [N, D_model]

    def compute_logits(self, hidden: FloatArray) -> FloatArray:
        """LM head: hidden `[R, D_model]` -> logits `[R, V]` = hidden @ lm_head^T, in the engine dtype."""
        return linear(hidden, self.lm_head)  # [R, V]
