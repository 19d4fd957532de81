"""Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 and Phi-3 decoders in NumPy: one forward over a step's flattened batch.

What vLLM keeps in `model_executor/models/llama.py`, `qwen2.py` / `qwen3.py` and `gemma2.py` / `gemma3.py`, `phi3.py`:
the decoder stack reads
the tokens of every scheduled request as one `[N, D_model]` matrix with per-token positions, so prefill
chunks and decode tokens of different requests share each weight read; only attention looks at which
request a token belongs to (`paged_attention`). The architectures differ in three switches:
Qwen2 adds biases to the q/k/v projections, Qwen3 RMS-normalises each query and key head before RoPE
(`q_norm`/`k_norm`) and sets `head_dim` explicitly; Mistral's tensors are Llama's, its sliding window on
every layer; Phi-3 stores q/k/v and gate/up fused (`qkv_proj`, `gate_up_proj`; a GGUF file's
`attn_qkv`, or q/k/v apart, and `ffn_up`), as the model fuses them. Gemma (`ModelConfig.gemma_norms`) scales the embeddings by sqrt(D_model), normalises with
(1 + w) (the 1 added here at load for a Hugging Face folder; llama.cpp's converter stores 1 + w in a
GGUF file), adds a norm after attention and after the MLP, gates with the tanh GELU, scales scores by
query_pre_attn_scalar^-1/2, interleaves sliding-window layers with global ones (Gemma 3: each kind
with its own RoPE base), and Gemma 2 soft-caps scores and logits. Left out: tensor parallelism, RoPE
scalings other than "llama3" and linear, and Gemma 3's vision tower.

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
RoPE after Qwen3's per-head norm. Requests with one query in the step (decoding) use the compiled
`decode_attention.paged_decode_attention_into` (one call per layer: online softmax over each request's blocks
read in place through its block table, no gather), in a step that also prefills too: a request's decode
then computes the same bits whatever else the step holds (batch invariance); the test-only NumPy reference
`oracle.reference_paged_decode_attention` is its oracle. `forward` trusts its inputs: the model runner validates
a step once (`ModelRunner.prepare_inputs`).

Shape legend: N scheduled tokens, R scheduled requests, D_model hidden size, H query heads, H_kv KV
heads, D head dim, I MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.kernels.block_formats import BLOCK_FORMATS
from attention_kv_caceh.kernels.block_gemm import prepare_block_linear
from attention_kv_caceh.kernels.block_gemm_int import INT_PAIRS
from attention_kv_caceh.kernels.decode_attention import paged_decode_attention_into
from attention_kv_caceh.kernels.dispatch import check_activations, compute_dtype, resolve_gemm_path
from attention_kv_caceh.kernels.gemm import prepare_packed_linear
from attention_kv_caceh.model_executor.checkpoint import SafetensorsCheckpoint, read_config_json
from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint
from attention_kv_caceh.model_executor.gguf_config import model_config_from_gguf
from attention_kv_caceh.model_executor.layers import (
    LinearWeight,
    apply_rotary,
    compiled_rms_norm,
    compiled_rotary,
    compiled_silu_and_mul,
    gelu_tanh_and_mul,
    linear,
    prepare_compiled_layers,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    silu_and_mul,
    softcap,
)
from attention_kv_caceh.model_executor.model_config import ModelConfig
from attention_kv_caceh.model_executor.model_weights import WeightReader
from attention_kv_caceh.model_executor.paged_attention import AttentionMetadata, paged_attention, write_kv

__all__ = ["Model", "ModelConfig"]

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.floating[Any]]


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
    post_attention_layernorm: FloatArray  # [D_model], before the MLP (Gemma: pre_feedforward_layernorm)
    gate_up_proj: LinearWeight  # [2 I, D_model] = gate_proj; up_proj
    down_proj: LinearWeight  # [D_model, I]
    attn_out_norm: FloatArray | None = None  # [D_model]   (Gemma: post_attention_layernorm)
    mlp_out_norm: FloatArray | None = None  # [D_model]   (Gemma: post_feedforward_layernorm)
    window: int | None = None  # sliding window of this layer, None for full attention
    local_rope: bool = False  # RoPE with rope_local_theta (Gemma 3's sliding layers)

    def tensors(self) -> list[FloatArray | LinearWeight]:
        """The layer's weights that are set (norms, biases, linear layers), in field order; not the
        window and RoPE settings."""
        values = [getattr(self, f.name) for f in dataclasses.fields(self)]
        return [v for v in values if isinstance(v, np.ndarray | LinearWeight)]


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
        activations: str | None = None,
    ) -> None:
        """Read every tensor `config` needs from `checkpoint`, converted to `compute_dtype(dtype)`; store
        the linear layers' weights as `dispatch.weight_format(dtype, quantization)` for the GEMM path
        (`resolve_gemm_path(gemm, dtype, quantization)`): packed for its kernel, or as floats for NumPy.

        activations: how the linear layers over GGUF blocks treat x (`dispatch.ACTIVATION_CHOICES`,
        `layers.linear`); None: float32. Given explicitly where no weight has an integer kernel, a logged
        warning says it has no effect.

        Raises ValueError for an activations setting outside ACTIVATION_CHOICES, a dtype, quantization or gemm `resolve_gemm_path` refuses (or a block
        format with an input width that is not a multiple of 32), CheckpointError (naming the file
        and key) for a missing tensor or one of the wrong shape.
        """
        self.gemm_path, self.gemm_note, self.weight_format = resolve_gemm_path(gemm, dtype, quantization)
        self.activations = check_activations(activations)
        self.config = config
        self.dtype = compute_dtype(dtype)
        c = config
        read = WeightReader(checkpoint, self.dtype, self.gemm_path, self.weight_format)
        get = read.tensor
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        hidden, inter = c.hidden_size, c.intermediate_size
        gemma, phi3 = c.gemma_norms, c.architecture == "Phi3ForCausalLM"
        # Gemma's RMSNorm scales by (1 + w); a GGUF file holds 1 + w already (llama.cpp's converter adds it)
        offset = 1.0 if gemma and not isinstance(checkpoint, GGUFCheckpoint) else 0.0

        def norm_weight(name: str, size: int) -> FloatArray:
            weight = get(name, (size,))
            return weight + self.dtype.type(offset) if offset else weight

        self.embedding = read.embedding("model.embed_tokens.weight", (c.vocab_size, hidden))  # [V, D_model]
        self.embed_tokens = self.embedding.table  # [V, D_model] floats, or None when kept as GGUF blocks
        self.layers: list[_Layer] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            proj = ("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)
            qkv_parts = [(f"{a}{n}.weight", (rows, hidden)) for n, rows in proj]
            gate_up_parts = [(f"{p}mlp.{n}.weight", (inter, hidden)) for n in ("gate_proj", "up_proj")]
            if phi3:  # stored fused, in the order the model fuses them (a GGUF file may hold q/k/v apart)
                if a + "qkv_proj.weight" in checkpoint:
                    qkv_parts = [(a + "qkv_proj.weight", (q_dim + 2 * kv_dim, hidden))]
                gate_up_parts = [(p + "mlp.gate_up_proj.weight", (2 * inter, hidden))]
            qkv_bias = None
            if c.qkv_bias and a + "qkv_proj.bias" in checkpoint:  # Phi-3's GGUF attn_qkv.bias
                qkv_bias = get(a + "qkv_proj.bias", (q_dim + 2 * kv_dim,))
            elif c.qkv_bias:
                qkv_bias = np.concatenate([get(f"{a}{n}.bias", (rows,)) for n, rows in proj])
            pre_mlp = p + ("pre_feedforward_layernorm" if gemma else "post_attention_layernorm") + ".weight"
            self.layers.append(
                _Layer(
                    input_layernorm=norm_weight(p + "input_layernorm.weight", hidden),
                    qkv_proj=read.linear(qkv_parts),
                    qkv_bias=qkv_bias,
                    q_norm=norm_weight(a + "q_norm.weight", c.head_dim) if c.qk_norm else None,
                    k_norm=norm_weight(a + "k_norm.weight", c.head_dim) if c.qk_norm else None,
                    o_proj=read.linear([(a + "o_proj.weight", (hidden, q_dim))]),
                    o_bias=get(a + "o_proj.bias", (hidden,)) if c.o_proj_bias else None,
                    post_attention_layernorm=norm_weight(pre_mlp, hidden),
                    gate_up_proj=read.linear(gate_up_parts),
                    down_proj=read.linear([(p + "mlp.down_proj.weight", (hidden, inter))]),
                    attn_out_norm=norm_weight(p + "post_attention_layernorm.weight", hidden)
                    if gemma
                    else None,
                    mlp_out_norm=norm_weight(p + "post_feedforward_layernorm.weight", hidden)
                    if gemma
                    else None,
                    window=c.layer_window(i),
                    local_rope=c.rope_local_theta is not None and c.layer_window(i) is not None,
                )
            )
        self.norm = norm_weight("model.norm.weight", hidden)  # [D_model]
        # Tied embeddings: the LM head is the embedding matrix, as in transformers, which ties them
        # even when a file also stores lm_head.weight (usually it is omitted).
        if c.tie_word_embeddings:
            self.lm_head = read.tied_head(self.embedding)  # [V, D_model]
        else:
            self.lm_head = read.linear([("lm_head.weight", (c.vocab_size, hidden))])  # [V, D_model]
        self.weight_notes = read.notes  # layers that could not keep the file's format
        if self.has_int_kernel_weights:
            how = "8 bits, integer dot products" if self.activations == "int8" else "float32"
            self.gemm_note += f"; activations against the blocks: {how}"
        elif activations is not None:
            why = (
                f"the numpy GEMM path multiplies weights decoded to {self.dtype} ({self.gemm_note})"
                if self.gemm_path == "numpy"
                else f"no linear layer keeps GGUF blocks with an integer kernel (weight format {self.weight_format}; "
                "they come with --quantization gguf or a block format)"
            )
            logger.warning("--activations %s has no effect: %s", activations, why)
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)  # [D/2], float64
        # Gemma 3's sliding layers: their own base, unscaled
        local = c.rope_local_theta
        self.local_inv_freq = None if local is None else rope_inv_freq(c.head_dim, local)  # [D/2]
        self.embed_scale = self.dtype.type(math.sqrt(hidden)) if gemma else None  # in the activation dtype
        self.act_and_mul = gelu_tanh_and_mul if c.hidden_act == "gelu_pytorch_tanh" else None
        self.gemm_compile_s = 0.0
        self.threads = 1  # Numba threads of the GEMMs and the decode attention (the model runner sets it)
        if self.gemm_path == "packed":
            kernels = sum(
                prepare_block_linear(f) if f in BLOCK_FORMATS else prepare_packed_linear(f)
                for f in read.kernels
            )
            self.gemm_compile_s = kernels + prepare_compiled_layers(self.dtype)

    @property
    def int8_products(self) -> bool:
        """Whether some linear layer multiplies 8-bit activations by integer dot products."""
        return self.activations == "int8" and self.has_int_kernel_weights

    @property
    def has_int_kernel_weights(self) -> bool:
        """Whether some linear layer keeps GGUF blocks of a type with an integer-dot kernel."""
        weights = [
            w
            for layer in self.layers
            for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        ]
        parts = [
            p for w in (*weights, self.lm_head) for p in (w.stacked or ((w.blocks,) if w.blocks else ()))
        ]
        return any(p.format in INT_PAIRS for p in parts)

    @classmethod
    def load(
        cls,
        path: str | Path,
        dtype: str = "float32",
        gemm: str = "auto",
        quantization: str | None = None,
        activations: str | None = None,
    ) -> Model:
        """Load a checkpoint in engine `dtype`, GEMM path `gemm`, linear weights as `quantization` says: a
        Hugging Face folder (config.json + safetensors) or a GGUF file, a folder holding one, or a model
        name (`model_source.resolve_model`). quantization None: weights in the dtype (a GGUF file's are
        dequantized here); a block format: quantized at load; "gguf": a GGUF file's tensors of every block type
        tensors kept as the file stores them.

        Raises CheckpointError for anything the checkpoint lacks or the model does not implement,
        ValueError as `Model()` does ("gguf" on a checkpoint that is no GGUF file: WeightReader's check).
        """
        from attention_kv_caceh.model_executor.model_source import gguf_file_of

        gguf = gguf_file_of(path)
        if gguf is not None:
            checkpoint = GGUFCheckpoint(gguf)
            return cls(model_config_from_gguf(checkpoint), checkpoint, dtype, gemm, quantization, activations)
        config = ModelConfig.from_hf_config(read_config_json(path), source=Path(path) / "config.json")
        return cls(config, SafetensorsCheckpoint(path), dtype, gemm, quantization, activations)

    @property
    def num_parameters(self) -> int:
        """Parameters of the checkpoint, counting a tied LM head once (a packed copy is not a parameter)."""
        sizes = [self.embedding.size, self.norm.size]
        if not self.config.tie_word_embeddings:
            sizes.append(self.lm_head.size)
        for layer in self.layers:
            sizes += [a.size for a in layer.tensors()]
        return sum(int(size) for size in sizes)

    def forward(
        self,
        input_ids: npt.NDArray[np.integer[Any]],
        positions: npt.NDArray[np.integer[Any]],
        kv_caches: list[tuple[FloatArray, FloatArray]],
        metadata: AttentionMetadata,
        layer_metadata: Sequence[AttentionMetadata] = (),
    ) -> FloatArray:
        """Hidden states after the final norm, `[N, D_model]`, for the step's N flattened tokens.

        input_ids, positions `[N]`; kv_caches one (K, V) pair per layer as
        `paged_attention.allocate_kv_cache` makes them, in the compute dtype: this step's K/V are written into them
        at the slot_mapping of the layer's metadata: layer_metadata[i] for layer i (one per layer: the
        block tables of the layer's KV cache group), or `metadata` for every layer when it is empty. Each layer (Touvron et al., 2023, Llama):
            h = x + o_proj(attention(rope(q), rope(k), v)),  q, k, v = qkv_proj(rms_norm(x))
            x' = h + down_proj(silu(gate_proj(rms_norm(h))) * up_proj(rms_norm(h)))
        Gemma (Gemma Team, 2024) wraps each of the two in a second norm, gates with the tanh GELU:
            h = x + rms_norm(o_proj(attention(...))),  x' = h + rms_norm(down_proj(gelu(...) * up_proj(...)))
        No checks: the arguments are those `ModelRunner.prepare_inputs` validated (token ids in the
        vocabulary, positions and slots inside each request's blocks) and caches of the engine dtype.
        """
        c = self.config
        n = input_ids.shape[0]
        h, h_kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        eps = c.rms_norm_eps
        compiled = self.gemm_path == "packed"  # float32: the compiled small layers too
        norm = compiled_rms_norm if compiled else rms_norm
        act_mul = self.act_and_mul or (compiled_silu_and_mul if compiled else silu_and_mul)
        tables = rope_cos_sin(positions, self.inv_freq, self.dtype)  # cos, sin [N, D] each
        local = (
            None if self.local_inv_freq is None else rope_cos_sin(positions, self.local_inv_freq, self.dtype)
        )
        x = self.embedding.lookup(input_ids)  # [N, D_model]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        decode = metadata.is_pure_decode
        # A step that mixes prefill and decode: its one-query requests (R1 of them, their rows `rows`)
        # go through the decode kernel too, the others (`longer`) through `paged_attention`.
        query_lens = np.diff(metadata.query_start_loc)  # [R]
        single = np.flatnonzero(query_lens == 1)  # [R1]
        mixed = not decode and single.shape[0] > 0
        rows = metadata.query_start_loc[single]  # [R1]
        longer = np.flatnonzero(query_lens != 1) if mixed else None
        # The compiled decode kernel's arguments, made once per step: int32 lengths, its output buffer
        # (rewritten by every layer) and the scale (1 / sqrt(D) but for Gemma).
        context_lens = metadata.context_lens[single].astype(np.int32)  # [R1]
        decode_out = np.empty(
            (single.shape[0] if decode or mixed else 0, h, d), dtype=self.dtype
        )  # [R1, H, D]
        scale, cap = c.attention_scale, c.attn_logit_softcapping
        metas = tuple(layer_metadata) or (metadata,) * len(self.layers)
        for layer, (k_cache, v_cache), meta in zip(self.layers, kv_caches, metas, strict=True):
            cos, sin = local if layer.local_rope and local is not None else tables
            qkv = linear(
                norm(x, layer.input_layernorm, eps), layer.qkv_proj, self.threads, self.activations
            )  # [N, (H + 2 H_kv) D]
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
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            if decode or mixed:  # the one-query requests: [R1, H, D] (R1 == R == N in a decode step)
                paged_decode_attention_into(
                    np.ascontiguousarray(q if decode else q[rows]),
                    k_cache,
                    v_cache,
                    meta.block_tables if decode else meta.block_tables[single],  # [R1, max_blocks]
                    context_lens,
                    decode_out,
                    scale,
                    self.threads,
                    window=layer.window,
                    softcap=cap,
                )
            if decode:
                attn = decode_out
            else:  # [N, H, D]
                attn = paged_attention(
                    q, k_cache, v_cache, meta, scale=scale, window=layer.window, softcap=cap, requests=longer
                )
                if mixed:
                    attn[rows] = decode_out
            out = linear(attn.reshape(n, h * d), layer.o_proj, self.threads, self.activations)  # [N, D_model]
            out = out if layer.o_bias is None else out + layer.o_bias
            x = x + (out if layer.attn_out_norm is None else norm(out, layer.attn_out_norm, eps))
            gate_up = linear(
                norm(x, layer.post_attention_layernorm, eps),
                layer.gate_up_proj,
                self.threads,
                self.activations,
            )  # [N, 2 I]
            mlp = linear(
                act_mul(gate_up), layer.down_proj, self.threads, self.activations
            )  # [N, I] -> [N, D_model]
            x = x + (mlp if layer.mlp_out_norm is None else norm(mlp, layer.mlp_out_norm, eps))
        return norm(x, self.norm, eps)  # [N, D_model]

    def compute_logits(self, hidden: FloatArray) -> FloatArray:
        """LM head: hidden `[R, D_model]` -> logits `[R, V]` = hidden @ lm_head^T, in the engine dtype
        (Gemma 2: soft-capped, cap * tanh(logits / cap))."""
        logits = linear(hidden, self.lm_head, self.threads, self.activations)  # [R, V]
        cap = self.config.final_logit_softcapping
        return logits if cap is None else softcap(logits, cap)
