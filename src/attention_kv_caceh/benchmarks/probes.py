"""What `bench-engine` times between decode steps, and the bytes and flops of one decode step.

A decode step reads every weight once and each request's KV cache (`decode_weight_bytes`,
`decode_kv_bytes`), and its linear layers do 2 flops per weight per request (`linear_parameters`). The
probes (`Probes`) time, between the steps of the same run so that they see the same load: np.dot (or,
at a given thread count, `read_probe` on as many threads) over a buffer of a step's bytes (the lab's read probe, as `experiments.calibration.read_probe` times it), the
step's linear layers replayed alone (`linear_replay`), `gemm.fma_probe` for as long, and the latest
step's paged decode attention replayed alone (`attention_replay`).

Shape legend: R requests in a decode step, H query heads, D head dim.

Left out: vLLM's benchmarks have no probes; these are this project's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.kernels.decode_attention import paged_decode_attention_into
from attention_kv_caceh.kernels.gemm import fma_probe
from attention_kv_caceh.model_executor.layers import linear
from attention_kv_caceh.model_executor.model import Model

__all__ = [
    "Probes",
    "attention_replay",
    "decode_kv_bytes",
    "decode_weight_bytes",
    "linear_parameters",
    "linear_replay",
    "resident_bytes",
]


def decode_weight_bytes(model: Model, num_seqs: float) -> float:
    """Weight bytes one decode step reads: every layer's tensors as stored (linear layers in their
    weight format, packed padding included: `LinearWeight.nbytes`), the final norm, the LM head, and
    num_seqs rows of the embedding table (the rest of the table is not read unless it is the tied LM
    head, which is counted once as the LM head)."""
    layer_bytes = sum(int(a.nbytes) for layer in model.layers for a in layer.tensors())
    return layer_bytes + model.norm.nbytes + model.lm_head.nbytes + num_seqs * model.embedding.row_bytes


def linear_parameters(model: Model) -> int:
    """Weights of every linear layer a decode step multiplies by: each layer's qkv, o, gate_up and
    down projections and the LM head (2 flops per weight per request)."""
    layers = sum(
        w.size for lay in model.layers for w in (lay.qkv_proj, lay.o_proj, lay.gate_up_proj, lay.down_proj)
    )
    return layers + model.lm_head.size


def linear_replay(model: Model, num_rows: int, rng: np.random.Generator) -> Callable[[], None]:
    """A call that runs a decode step's linear layers alone on `num_rows` random rows (inputs made once)."""
    c = model.config

    def rows(width: int) -> npt.NDArray[np.floating[Any]]:
        return rng.standard_normal((num_rows, width)).astype(model.dtype)

    x, attn, inter = rows(c.hidden_size), rows(c.num_attention_heads * c.head_dim), rows(c.intermediate_size)

    def replay() -> None:
        for layer in model.layers:
            linear(x, layer.qkv_proj, model.threads, model.activations)
            linear(attn, layer.o_proj, model.threads, model.activations)
            linear(x, layer.gate_up_proj, model.threads, model.activations)
            linear(inter, layer.down_proj, model.threads, model.activations)
        linear(x, model.lm_head, model.threads, model.activations)

    return replay


def attention_replay(model: Model, runner: ModelRunner, seed: int) -> Callable[[], Callable[[], None] | None]:
    """A call that prepares the latest step's paged decode attention alone and returns it, to be timed
    with nothing else inside: one `paged_decode_attention_into` per layer, as `Model.forward` calls it,
    over the runner's KV caches with that step's block tables and context lengths, on random queries
    `[R, H, D]`. Returns None when the latest step was not a pure decode step."""
    c = model.config
    scale = c.attention_scale
    rng = np.random.default_rng(seed)
    queries: dict[int, npt.NDArray[np.floating[Any]]] = {}  # R -> q [R, H, D], made once per R

    def prepare() -> Callable[[], None] | None:
        inputs = runner.last_inputs
        if inputs is None or not inputs.metadata.is_pure_decode:
            return None
        meta = inputs.metadata
        r = meta.context_lens.shape[0]
        if r not in queries:
            queries[r] = rng.standard_normal((r, c.num_attention_heads, c.head_dim)).astype(model.dtype)
        q = queries[r]
        out = np.empty_like(q)  # [R, H, D]
        context_lens = meta.context_lens.astype(np.int32)  # [R]

        metas = inputs.layer_metadata or (meta,) * len(runner.kv_caches)

        def replay() -> None:
            for (k_cache, v_cache), layer, m in zip(runner.kv_caches, model.layers, metas, strict=True):
                paged_decode_attention_into(
                    q,
                    k_cache,
                    v_cache,
                    m.block_tables,
                    context_lens,
                    out,
                    scale,
                    model.threads,
                    window=layer.window,
                    softcap=c.attn_logit_softcapping,
                )

        return replay

    return prepare


@dataclass
class Probes:
    """What is timed between decode steps, one sample each per call: np.dot over `buffer` (the read
    probe, ms), the linear-layer `replay` (ms), `gemm.fma_probe` (flop/s) for as long as the replay
    took, so that on a shared machine both get the same share of the CPU, and the `attention` replay
    (ms, when it ran). threads: the read probe is `read_probe` on that many threads instead of one
    np.dot (None)."""

    buffer: npt.NDArray[np.floating[Any]]
    replay: Callable[[], None]
    attention: Callable[[], Callable[[], None] | None]
    read_ms: list[float] = field(default_factory=list[float])
    linear_ms: list[float] = field(default_factory=list[float])
    fma_flops: list[float] = field(default_factory=list[float])
    attention_ms: list[float] = field(default_factory=list[float])
    threads: int | None = None
    _executor: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="read-probe")
        return self._executor

    def close(self) -> None:
        """Stop the read probe's threads (if it started any)."""
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def __call__(self) -> None:
        start = time.perf_counter()
        if self.threads is None:
            np.dot(self.buffer, self.buffer)
        else:
            read_probe(self.buffer, self.threads, self._pool())
        self.read_ms.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        self.replay()
        self.linear_ms.append((time.perf_counter() - start) * 1e3)
        self.fma_flops.append(fma_probe(self.linear_ms[-1] / 1e3))
        attention = self.attention()
        if attention is not None:
            start = time.perf_counter()
            attention()
            self.attention_ms.append((time.perf_counter() - start) * 1e3)


READ_CHUNKS_PER_THREAD = 8


def read_probe(buffer: npt.NDArray[np.floating[Any]], threads: int, pool: ThreadPoolExecutor) -> float:
    """The read probe on `threads` threads: np.dot of each of READ_CHUNKS_PER_THREAD * threads slices
    of the 1-D `buffer` with itself, the slices taken by `pool`'s threads as they come free (np.dot
    releases the GIL); returns the sum. Time it for the read rate at that thread count."""
    if threads == 1:
        return float(np.dot(buffer, buffer))
    parts: list[npt.NDArray[np.floating[Any]]] = np.array_split(buffer, READ_CHUNKS_PER_THREAD * threads)

    def dot(part: npt.NDArray[np.floating[Any]]) -> float:
        return float(np.dot(part, part))

    return float(sum(pool.map(dot, parts)))


def decode_kv_bytes(model: Model, num_positions: float) -> float:
    """KV bytes a decode step reads for num_positions attended positions summed over its requests:
    K and V of every layer, 2 * L * H_kv * D * itemsize per position (a sliding-window layer counted as
    a full one: an upper bound for a context past its window)."""
    c = model.config
    per_position = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * model.dtype.itemsize
    return per_position * num_positions


def resident_bytes() -> int | None:
    """This process's resident memory (VmRSS of /proc/self/status) in bytes; None where there is no /proc."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except OSError:
        return None
    return None
