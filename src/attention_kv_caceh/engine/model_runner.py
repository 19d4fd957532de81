"""ModelRunner: owns the paged KV buffers and turns a SchedulerOutput into one model forward.

What vLLM v1's `v1/worker/gpu_model_runner.py` does (`_prepare_inputs`, `execute_model`) at nano-vllm's
size: lay the scheduled requests' new tokens out as one flattened batch, compute each token's position
and KV slot from its request's block table, run the model once, and return the logits of each request's
last scheduled token; a request that asks for prompt logprobs also gets those of its prompt positions
(vLLM's `_get_prompt_logprobs_dict`), appended to `request.prompt_logprobs`. Left out: persistent input buffers, CUDA graphs, speculative decoding, sampling
(the engine's sampler does that), pipeline/tensor parallelism.

Shape legend: N scheduled tokens, R scheduled requests, L layers, H_kv KV heads, D head dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.model import ENGINE_DTYPES, Model, ModelConfig, compute_dtype
from attention_kv_caceh.engine.paged_attention import AttentionMetadata, allocate_kv_cache
from attention_kv_caceh.engine.sampler import token_logprobs
from attention_kv_caceh.engine.scheduler import SchedulerOutput
from attention_kv_caceh.kernels import prepare_paged_decode_attention

__all__ = ["ModelInputs", "ModelRunner"]

FloatArray = npt.NDArray[np.floating[Any]]


@dataclass(frozen=True)
class ModelInputs:
    """The flattened batch of one step: input_ids and positions `[N]` plus the attention metadata."""

    input_ids: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    metadata: AttentionMetadata


class ModelRunner:
    """Runs `model` on scheduler outputs against per-layer paged K/V buffers.

    kv_caches: one (K, V) pair per layer in the model's dtype, zero-filled, K `[num_blocks, H_kv, D,
    block_size]` and V `[num_blocks, H_kv, block_size, D]` (`paged_attention.allocate_kv_cache`); block b
    holds positions [i * block_size, (i + 1) * block_size) of whichever request lists b as its i-th block. warmup_s: seconds the paged decode kernel's compile (or Numba disk-cache
    load) took at construction (0-ish when this process had it already), so no step time includes it.
    last_inputs: the ModelInputs of the latest `execute_model` (None before the first), which
    `bench-engine` reads to replay a decode step's attention alone.
    """

    def __init__(self, model: Model, config: EngineConfig, num_blocks: int) -> None:
        """Allocate the KV buffers. Raises ValueError for num_blocks < 1, block_size < 1, or a
        config.dtype that is not the model's dtype."""
        if num_blocks < 1 or config.block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {config.block_size}")
        if config.dtype not in ENGINE_DTYPES or compute_dtype(config.dtype) != model.dtype:
            raise ValueError(
                f"config.dtype {config.dtype!r} must be the model's dtype {model.dtype.name!r} (bfloat16 computes in float32)"
            )
        self.model = model
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = config.block_size
        c = model.config
        self.kv_caches: list[tuple[FloatArray, FloatArray]] = [
            allocate_kv_cache(num_blocks, config.block_size, c.num_key_value_heads, c.head_dim, model.dtype)
            for _ in range(c.num_hidden_layers)
        ]
        self.last_inputs: ModelInputs | None = None
        self.warmup_s = self._warm_up()

    def _warm_up(self) -> float:
        """Compile (or load from Numba's disk cache) the paged decode kernel for this dtype now, so that
        the first decode step does not pay for it (seconds on a fresh clone). One call on a one-row query
        over block 0 with context length 1, with the argument types the model passes (C-contiguous q and
        out `[1, H, D]`, int32 block table and lengths); it reads the cache and writes nothing in it.
        Returns the seconds the first such call in this process took (`kernels.compile_seconds`)."""
        c = self.model.config
        k_cache, v_cache = self.kv_caches[0]
        q = np.zeros((1, c.num_attention_heads, c.head_dim), dtype=self.model.dtype)  # [1, H, D]
        out = np.empty_like(q)
        block_tables = np.zeros((1, 1), dtype=np.int32)  # [1, 1]
        context_lens = np.ones(1, dtype=np.int32)  # [1]
        return prepare_paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, out)

    @staticmethod
    def bytes_per_block(model_config: ModelConfig, block_size: int, dtype: str) -> int:
        """Bytes of one KV block over all layers, K and V: 2 * L * block_size * H_kv * D * itemsize, the
        itemsize of engine `dtype`'s compute dtype (bfloat16 keeps a float32 KV cache)."""
        c = model_config
        itemsize = compute_dtype(dtype).itemsize
        return 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim * itemsize

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        """Flatten the step: request r's tokens all_token_ids[c : c + n] at positions c .. c + n - 1.

        c = num_computed_tokens, n = num_scheduled_tokens[request_id]; position p goes to slot
        block_ids[p // block_size] * block_size + p % block_size. This is the step's one validation:
        the model and its kernels trust what it returns. Raises ValueError for an empty step, n < 1,
        c + n beyond the request's tokens, a token id outside the vocabulary, too few blocks, or a block
        id outside the pool.
        """
        requests = scheduler_output.scheduled_requests
        if not requests:
            raise ValueError("the scheduler output schedules no request")
        bs = self.block_size
        ids: list[npt.NDArray[np.int64]] = []
        positions: list[npt.NDArray[np.int64]] = []
        context_lens = np.empty(len(requests), dtype=np.int64)  # [R]
        max_blocks = max(len(r.block_ids) for r in requests)
        block_tables = np.full((len(requests), max_blocks), -1, dtype=np.int32)  # [R, max_blocks]
        for i, r in enumerate(requests):
            n = scheduler_output.num_scheduled_tokens.get(r.request_id, 0)
            c = r.num_computed_tokens
            tokens = r.all_token_ids
            if n < 1 or c < 0 or c + n > len(tokens):
                raise ValueError(
                    f"request {r.request_id!r}: {n} scheduled tokens after {c} computed, of {len(tokens)} tokens"
                )
            if len(r.block_ids) * bs < c + n or any(not 0 <= b < self.num_blocks for b in r.block_ids):
                raise ValueError(
                    f"request {r.request_id!r}: block_ids {r.block_ids} must cover {c + n} positions "
                    f"with blocks in 0 .. {self.num_blocks - 1} (block_size {bs})"
                )
            ids.append(np.asarray(tokens[c : c + n], dtype=np.int64))
            positions.append(np.arange(c, c + n, dtype=np.int64))
            context_lens[i] = c + n
            block_tables[i, : len(r.block_ids)] = r.block_ids
        input_ids = np.concatenate(ids)  # [N]
        vocab = self.model.config.vocab_size
        if input_ids.min() < 0 or input_ids.max() >= vocab:
            bad = int(input_ids[(input_ids < 0) | (input_ids >= vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary 0 .. {vocab - 1}")
        pos = np.concatenate(positions)  # [N]
        counts = np.array([p.shape[0] for p in positions], dtype=np.int64)  # [R]
        query_start_loc = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # [R+1]
        request_of_token = np.repeat(np.arange(len(requests)), counts)  # [N]
        slot_mapping = block_tables[request_of_token, pos // bs].astype(np.int64) * bs + pos % bs  # [N]
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            block_tables=block_tables,
            context_lens=context_lens,
            block_size=bs,
        )
        return ModelInputs(input_ids, pos, metadata)

    def execute_model(self, scheduler_output: SchedulerOutput) -> FloatArray:
        """Run one step; logits `[R, V]` in the engine dtype, row i for the last scheduled token of
        scheduled_requests[i] (whether or not the scheduler samples from it). Writes the step's K/V
        into `kv_caches`. Raises ValueError as `prepare_inputs` does, before touching the caches.
        """
        inputs = self.prepare_inputs(scheduler_output)
        self.last_inputs = inputs
        hidden = self.model.forward(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata
        )  # [N, D_model]
        last = inputs.metadata.query_start_loc[1:] - 1  # [R], row of each request's last token
        self._record_prompt_logprobs(scheduler_output, hidden, inputs.metadata.query_start_loc)
        return self.model.compute_logits(hidden[last])  # [R, V]

    def _record_prompt_logprobs(
        self, scheduler_output: SchedulerOutput, hidden: FloatArray, query_start_loc: npt.NDArray[np.int64]
    ) -> None:
        """Append to `request.prompt_logprobs` the entries this step's prompt positions give (vLLM's
        prompt logprobs, computed in prefill): the logits at position p score prompt token p + 1. A
        position already recorded (recomputed after a preemption) is skipped."""
        for i, r in enumerate(scheduler_output.scheduled_requests):
            k = r.sampling_params.prompt_logprobs
            if k is None:
                continue
            c = r.num_computed_tokens
            end = min(c + scheduler_output.num_scheduled_tokens[r.request_id], r.num_prompt_tokens - 1)
            start = max(c, len(r.prompt_logprobs))
            if start >= end:
                continue
            rows = np.arange(start - c, end - c) + query_start_loc[i]  # [n_p]
            logits = self.model.compute_logits(hidden[rows])  # [n_p, V]
            for j, p in enumerate(range(start, end)):
                r.prompt_logprobs.append(token_logprobs(logits[j], r.prompt_token_ids[p + 1], k))
