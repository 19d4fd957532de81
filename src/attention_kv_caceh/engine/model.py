"""Llama, Mistral, Qwen2 and Qwen3 decoders in NumPy: one forward over a step's flattened batch.

What vLLM keeps in `model_executor/models/llama.py` and `qwen2.py` / `qwen3.py`: the decoder stack reads
the tokens of every scheduled request as one `[N, D_model]` matrix with per-token positions, so prefill
chunks and decode tokens of different requests share each weight read; only attention looks at which
request a token belongs to (`paged_attention`). The architectures differ in three switches:
Qwen2 adds biases to the q/k/v projections, Qwen3 RMS-normalises each query and key head before RoPE
(`q_norm`/`k_norm`) and sets `head_dim` explicitly; Mistral's tensors are Llama's. Left out: tensor
parallelism, quantisation, sliding-window attention, and RoPE scalings other than "llama3".

Weights keep the Hugging Face layout `[out, in]` and a linear layer is `layers.linear(x, W)` = x W^T:
row-wise dot products for a few rows (a decode step of up to MATVEC_MAX_ROWS sequences, one pass over
W), GEMM above. Tied embeddings stay one array. A pre-transposed `[in, out]` copy measured no faster
(OpenBLAS, one thread, the `small` preset's 400 MB of matmul weights: 25.4 vs 27.1 ms for x @ W.T at
N=1, where row-wise took 22.5 ms; 184 vs 193 ms at N=32), so there is one weight layout. A step whose
requests all decode uses the compiled `kernels.paged_decode_attention` (one call per layer: online
softmax over each request's blocks read in place through its block table, no gather); the NumPy
`engine.paged_attention.paged_decode_attention` with the same signature is its oracle in the tests.

Shape legend: N scheduled tokens, R scheduled requests, D_model hidden size, H query heads, H_kv KV
heads, D head dim, I MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.engine.checkpoint import CheckpointError, SafetensorsCheckpoint, read_config_json
from attention_kv_caceh.engine.layers import (
    apply_rotary,
    linear,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    silu_and_mul,
)
from attention_kv_caceh.engine.model_config import ModelConfig
from attention_kv_caceh.engine.paged_attention import AttentionMetadata, paged_attention, write_kv
from attention_kv_caceh.kernels import paged_decode_attention

__all__ = ["ENGINE_DTYPES", "Model", "ModelConfig"]

FloatArray = npt.NDArray[np.floating[Any]]
ENGINE_DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights; q/k/v and gate/up are fused row-wise (one matmul each)."""

    input_layernorm: FloatArray  # [D_model]
    qkv_proj: FloatArray  # [(H + 2 H_kv) D, D_model] = q_proj; k_proj; v_proj
    qkv_bias: FloatArray | None  # [(H + 2 H_kv) D]   (Qwen2)
    q_norm: FloatArray | None  # [D]   (Qwen3)
    k_norm: FloatArray | None  # [D]   (Qwen3)
    o_proj: FloatArray  # [D_model, H D]
    o_bias: FloatArray | None  # [D_model]
    post_attention_layernorm: FloatArray  # [D_model]
    gate_up_proj: FloatArray  # [2 I, D_model] = gate_proj; up_proj
    down_proj: FloatArray  # [D_model, I]


class Model:
    """A decoder-only transformer with weights as NumPy arrays of one engine dtype (float32 or float64).

    Build with `Model.load(folder, dtype)`. `forward` runs the decoder stack over a flattened batch and
    writes the new K/V into the paged caches; `compute_logits` applies the LM head to chosen rows.
    """

    def __init__(
        self, config: ModelConfig, checkpoint: SafetensorsCheckpoint, dtype: str = "float32"
    ) -> None:
        """Read every tensor `config` needs from `checkpoint`, converted to `dtype`.

        Raises ValueError for a dtype other than "float32"/"float64", CheckpointError (naming the
        file and key) for a missing tensor or one of the wrong shape.
        """
        if dtype not in ENGINE_DTYPES:
            raise ValueError(f"dtype must be one of {ENGINE_DTYPES}, got {dtype!r}")
        self.config = config
        self.dtype = np.dtype(dtype)
        c = config

        def get(name: str, shape: tuple[int, ...]) -> FloatArray:
            found = checkpoint.shape(name)
            if found != shape:
                raise CheckpointError(
                    f"{checkpoint.source}: tensor {name!r} has shape {found}, expected {shape}"
                )
            return checkpoint.get(name, self.dtype)

        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        hidden, inter = c.hidden_size, c.intermediate_size
        self.embed_tokens = get("model.embed_tokens.weight", (c.vocab_size, hidden))  # [V, D_model]
        self.layers: list[_Layer] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            proj = ("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)
            qkv = np.concatenate([get(f"{a}{n}.weight", (rows, hidden)) for n, rows in proj])
            qkv_bias = (
                np.concatenate([get(f"{a}{n}.bias", (rows,)) for n, rows in proj]) if c.qkv_bias else None
            )
            gate_up = np.concatenate(
                [
                    get(f"{p}mlp.gate_proj.weight", (inter, hidden)),
                    get(f"{p}mlp.up_proj.weight", (inter, hidden)),
                ]
            )
            self.layers.append(
                _Layer(
                    input_layernorm=get(p + "input_layernorm.weight", (hidden,)),
                    qkv_proj=qkv,
                    qkv_bias=qkv_bias,
                    q_norm=get(a + "q_norm.weight", (c.head_dim,)) if c.qk_norm else None,
                    k_norm=get(a + "k_norm.weight", (c.head_dim,)) if c.qk_norm else None,
                    o_proj=get(a + "o_proj.weight", (hidden, q_dim)),
                    o_bias=get(a + "o_proj.bias", (hidden,)) if c.o_proj_bias else None,
                    post_attention_layernorm=get(p + "post_attention_layernorm.weight", (hidden,)),
                    gate_up_proj=gate_up,
                    down_proj=get(p + "mlp.down_proj.weight", (hidden, inter)),
                )
            )
        self.norm = get("model.norm.weight", (hidden,))  # [D_model]
        # Tied embeddings: the LM head is the embedding matrix itself, as in transformers, which ties
        # them even when a file also stores lm_head.weight (usually it is omitted).
        if c.tie_word_embeddings:
            self.lm_head = self.embed_tokens  # [V, D_model]
        else:
            self.lm_head = get("lm_head.weight", (c.vocab_size, hidden))  # [V, D_model]
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)  # [D/2], float64

    @classmethod
    def load(cls, path: str | Path, dtype: str = "float32") -> Model:
        """Load a Hugging Face model folder (config.json + safetensors) in engine `dtype`.

        Raises CheckpointError for anything the folder lacks or the model does not implement.
        """
        config = ModelConfig.from_hf_config(read_config_json(path), source=Path(path) / "config.json")
        return cls(config, SafetensorsCheckpoint(path), dtype)

    @property
    def num_parameters(self) -> int:
        """Parameters held, counting a tied LM head once."""
        arrays = [self.embed_tokens, self.norm] + (
            [] if self.lm_head is self.embed_tokens else [self.lm_head]
        )
        for layer in self.layers:
            arrays += [a for a in vars(layer).values() if a is not None]
        return sum(int(a.size) for a in arrays)

    def forward(
        self,
        input_ids: npt.NDArray[np.integer[Any]],
        positions: npt.NDArray[np.integer[Any]],
        kv_caches: list[tuple[FloatArray, FloatArray]],
        metadata: AttentionMetadata,
    ) -> FloatArray:
        """Hidden states after the final norm, `[N, D_model]`, for the step's N flattened tokens.

        input_ids, positions `[N]`; kv_caches one (K, V) pair per layer, each
        `[num_blocks, block_size, H_kv, D]` in the engine dtype: this step's K/V are written into them
        at metadata.slot_mapping. Each layer (Touvron et al., 2023, Llama):
            h = x + o_proj(attention(rope(q), rope(k), v)),  q, k, v = qkv_proj(rms_norm(x))
            x' = h + down_proj(silu(gate_proj(rms_norm(h))) * up_proj(rms_norm(h)))
        Raises ValueError for mismatched lengths, token ids outside the vocabulary, or caches of the
        wrong shape or dtype.
        """
        c = self.config
        n = input_ids.shape[0]
        if input_ids.shape != (n,) or positions.shape != (n,):
            raise ValueError(f"input_ids {input_ids.shape} and positions {positions.shape} must both be [N]")
        if n and (input_ids.min() < 0 or input_ids.max() >= c.vocab_size):
            raise ValueError(f"token ids must be in 0 .. {c.vocab_size - 1}, got {input_ids}")
        if len(kv_caches) != c.num_hidden_layers:
            raise ValueError(f"expected {c.num_hidden_layers} (K, V) cache pairs, got {len(kv_caches)}")
        for k_cache, _ in kv_caches[:1]:
            if k_cache.shape[2:] != (c.num_key_value_heads, c.head_dim) or k_cache.dtype != self.dtype:
                raise ValueError(
                    f"KV cache {k_cache.shape} {k_cache.dtype} does not fit [num_blocks, block_size, "
                    f"{c.num_key_value_heads}, {c.head_dim}] {self.dtype}"
                )
        h, h_kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        eps = c.rms_norm_eps
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.dtype)  # [N, D] each
        x = self.embed_tokens[input_ids]  # [N, D_model]
        decode = metadata.is_pure_decode
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            qkv = linear(rms_norm(x, layer.input_layernorm, eps), layer.qkv_proj)  # [N, (H + 2 H_kv) D]
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            q = qkv[:, : h * d].reshape(n, h, d)  # [N, H, D]
            k = qkv[:, h * d : (h + h_kv) * d].reshape(n, h_kv, d)  # [N, H_kv, D]
            v = qkv[:, (h + h_kv) * d :].reshape(n, h_kv, d)  # [N, H_kv, D]
            if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3: RMSNorm over each head
                q, k = rms_norm(q, layer.q_norm, eps), rms_norm(k, layer.k_norm, eps)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # [N, H, D], [N, H_kv, D]
            write_kv(k_cache, v_cache, k, v, metadata.slot_mapping)
            if decode:  # one query per request: [R, H, D] with R == N
                attn = paged_decode_attention(  # [R, H, D]
                    q, k_cache, v_cache, metadata.block_tables, metadata.context_lens.astype(np.int32)
                )
            else:
                attn = paged_attention(q, k_cache, v_cache, metadata)  # [N, H, D]
            out = linear(attn.reshape(n, h * d), layer.o_proj)  # [N, D_model]
            x = x + (out if layer.o_bias is None else out + layer.o_bias)
            gate_up = linear(rms_norm(x, layer.post_attention_layernorm, eps), layer.gate_up_proj)  # [N, 2 I]
            x = x + linear(silu_and_mul(gate_up), layer.down_proj)  # [N, I] -> [N, D_model]
        return rms_norm(x, self.norm, eps)  # [N, D_model]

    def compute_logits(self, hidden: FloatArray) -> FloatArray:
        """LM head: hidden `[R, D_model]` -> logits `[R, V]` = hidden @ lm_head^T, in the engine dtype."""
        return linear(hidden, self.lm_head)  # [R, V]
