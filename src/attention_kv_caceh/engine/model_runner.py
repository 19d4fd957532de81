"""ModelRunner: owns the paged KV buffers and turns a SchedulerOutput into one model forward; sample_tokens.

What vLLM v1's `v1/worker/gpu_model_runner.py` does (`_prepare_inputs`, `execute_model`, `sample_tokens`),
for one CPU process: lay the scheduled requests' new tokens out as one flattened batch, compute each
token's position and KV slot from its request's block table, run the model once, and return the logits of
each request's last scheduled token; a request that asks for prompt logprobs also gets those of its prompt
positions (vLLM's `_get_prompt_logprobs_dict`), appended to `request.prompt_logprobs`. Then
`sample_tokens` turns those logits into a ModelRunnerOutput (outputs.py): a token per request whose last
token the step computed (engine/sampler.py), the verified drafts of a request that had draft tokens
(spec_decode/rejection_sampler.py), and the logprobs of each sampled token from its raw row. As in vLLM,
the step is two calls, `execute_model` then `sample_tokens`; here `sample_tokens` is a function of the
logits rather than a method reading state the forward left behind, so any runner that produces logits
(the tests' fake runners, bench-engine's recording runner) is sampled the same way.

Speculative decoding: a request's scheduled draft tokens (`scheduled_spec_decode_tokens`) follow its
last token in the flattened batch, and the logits of all its last 1 + d positions are returned (vLLM's
`logits_indices` with `SpecDecodeMetadata`). A step in which every request computes one token plus its
drafts is laid out for the compiled decode kernel with one row per token: row i attends its request's
blocks up to its own position (context length position + 1), which is the causal mask of the
request's queries, so verification never takes the gather-and-matmul prefill path.

A step with structured outputs passes `sample_tokens` the core's GrammarOutput (vLLM's `grammar_output`
argument): the sampler and the rejection sampler apply each masked row before choosing a token.

KV cache groups (a model with sliding-window layers, `kv_cache_coordinator.py`): the runner keeps a
block table per group (`block_table.MultiGroupBlockTable`, as vLLM's), which checks each group's table
and builds its slot mapping and attention metadata, and gives each layer its group's; the j-th layer of
every group shares K/V buffer j.

Threads: each step computes on `threads` of Numba's pool, or, at the default count, on as many of them
as other processes leave free (`cpu_load.LoadGovernor`, asked before each step; docs/kernels.md).

Left out: persistent input buffers, CUDA graphs, pipeline/tensor parallelism, and batched sampling kernels (one request's row at a time).

Shape legend: N scheduled tokens, R scheduled requests, L layers, H_kv KV heads, D head dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.cpu_load import LoadGovernor
from attention_kv_caceh.cpus import usable_cpus
from attention_kv_caceh.engine.block_table import MultiGroupBlockTable
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.kv_cache_coordinator import (
    KVCacheGroups,
    layer_buffer_index,
    model_kv_cache_groups,
    num_kv_buffers,
)
from attention_kv_caceh.engine.outputs import ModelRunnerOutput
from attention_kv_caceh.engine.request import TokenLogprobs
from attention_kv_caceh.engine.sampler import _MAX_LOGIT, sample, token_logprobs  # pyright: ignore[reportPrivateUsage]
from attention_kv_caceh.engine.scheduler import SchedulerOutput
from attention_kv_caceh.engine.spec_decode.rejection_sampler import verify_draft
from attention_kv_caceh.engine.structured_output import GrammarOutput
from attention_kv_caceh.kernels.dispatch import ENGINE_DTYPES, compute_dtype
from attention_kv_caceh.kernels.threads import set_threads
from attention_kv_caceh.model_executor.model import Model, ModelConfig
from attention_kv_caceh.model_executor.paged_attention import AttentionMetadata, allocate_kv_cache
from attention_kv_caceh.model_executor.warmup import warm_up

__all__ = [
    "NON_FINITE_LOGITS",
    "ModelInputs",
    "ModelRunner",
    "ModelRunnerLike",
    "sample_tokens",
    "set_aside_non_finite",
]

FloatArray = npt.NDArray[np.floating[Any]]
NON_FINITE_LOGITS = (
    f"the model's logits for this request contain NaN, an infinity or a value past +-{_MAX_LOGIT:.4g} "
    "(its weights or activations are not finite)"
)


@dataclass(frozen=True)
class ModelInputs:
    """The flattened batch of one step: input_ids and positions `[N]`, the attention metadata of
    KV cache group 0 (`metadata`) and of each layer's group (`layer_metadata` `[L]`; they differ only in
    block tables and slots),
    `logits_indices` `[R + D]` (the rows whose logits are returned: each request's last 1 + d_r
    tokens, d_r its scheduled drafts) and `query_start_loc` `[R + 1]` (request r's tokens are rows
    query_start_loc[r] : query_start_loc[r + 1], whatever the metadata's layout)."""

    input_ids: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    metadata: AttentionMetadata
    logits_indices: npt.NDArray[np.int64]
    query_start_loc: npt.NDArray[np.int64]
    layer_metadata: tuple[AttentionMetadata, ...] = ()


class ModelRunnerLike(Protocol):
    """What the core needs from a model runner."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> FloatArray:
        """Compute the scheduled tokens; return logits [R + D, V]: per scheduled request in order, the
        row of its last scheduled token, or with d scheduled drafts the 1 + d rows of its last token
        and each draft (`ModelRunner.execute_model`)."""
        ...


class ModelRunner:
    """Runs `model` on scheduler outputs against paged K/V buffers.

    kv_cache_groups: the model's KV cache groups (`kv_cache_coordinator.model_kv_cache_groups`; () for a
    model without sliding-window layers: one group of every layer). kv_caches: one (K, V) pair per
    layer in the model's dtype, zero-filled, K `[num_blocks, H_kv, D, block_size]` and V `[num_blocks,
    H_kv, block_size, D]` (`paged_attention.allocate_kv_cache`); block b holds positions [i *
    block_size, (i + 1) * block_size) of whichever request lists b as its i-th block in the layer's
    group. With groups, the j-th layer of every group shares buffer j (vLLM's hybrid allocator: a
    block id belongs to one group at a time), so there are only group_size buffers
    (`kv_cache_coordinator.num_kv_buffers`) and `kv_caches` lists some of them more than once.
    warmup_s: seconds the warm-up run at construction took (a dummy forward pass that compiles,
    or loads from Numba's disk cache, every kernel a step calls), so no step time includes a compile.
    last_inputs: the ModelInputs of the latest `execute_model` (None before the first), which
    `bench-engine` reads to replay a decode step's attention alone. threads: the most Numba threads a
    step computes on (`config.resolved_threads()`), set in the thread that runs each step.
    governor: with `config.threads` None (the default) or `config.follow_load` (a default filled in by
    the caller), the `cpu_load.LoadGovernor` asked before each
    step for how many of them to use (the usable CPUs less those other processes keep busy, re-read
    at most every 0.5 s); None for an explicit count, which every step uses as given.
    active_threads: the count the latest step used (`threads` before the first).
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
        self.kv_cache_groups = self.model_kv_cache_groups(c)
        groups = self.kv_cache_groups
        buffers = [
            allocate_kv_cache(num_blocks, config.block_size, c.num_key_value_heads, c.head_dim, model.dtype)
            for _ in range(num_kv_buffers(groups, c.num_hidden_layers))
        ]
        where = layer_buffer_index(groups, c.num_hidden_layers)  # (group, buffer) per layer
        self.kv_caches: list[tuple[FloatArray, FloatArray]] = [buffers[j] for _, j in where]
        self.layer_group = tuple(g for g, _ in where)  # [L]
        self.group_windows = tuple(g.sliding_window for g in groups) or (None,)  # per group
        self.block_table = MultiGroupBlockTable(self.group_windows, config.block_size, num_blocks)
        self.last_inputs: ModelInputs | None = None
        self.threads = config.resolved_threads()
        self.active_threads = self.threads
        self.governor = None
        if config.threads is None or config.follow_load:
            self.governor = LoadGovernor(self.threads, usable_cpus().ids)
            self.governor.threads()  # the baseline reading, so the first step after warm-up has a delta
        self._use_threads()
        self.warmup_s = self._warm_up()

    @staticmethod
    def model_kv_cache_groups(model_config: ModelConfig) -> KVCacheGroups:
        """The KV cache groups the runner lays a model out in (`kv_cache_coordinator.model_kv_cache_groups`)."""
        c = model_config
        return model_kv_cache_groups(c.num_hidden_layers, c.layer_types, c.sliding_window)

    def _use_threads(self) -> None:
        """This step's thread count (`threads`, or the governor's count of it) for the calling thread
        (Numba's count is per thread) and the model; kept in `active_threads`."""
        self.active_threads = self.threads if self.governor is None else self.governor.threads()
        set_threads(self.active_threads)
        self.model.threads = self.active_threads

    def _warm_up(self) -> float:
        """Run the model once on dummy tokens (`model_executor/warmup.py:warm_up`), so that its first real step
        compiles nothing: every Numba kernel a step calls is compiled (or loaded from Numba's disk cache)
        here for the argument types the model passes, its own weights and KV buffers included. The KV
        buffers are left zero-filled. Returns the seconds it took.

        With a governor the count can change between steps, and one thread takes the kernels' serial
        variants while more take the parallel ones, so the warm-up runs at one thread and at `threads`.
        """
        counts = {self.active_threads} if self.governor is None else {1, self.threads}
        seconds = 0.0
        for count in sorted(counts):
            set_threads(count)
            self.model.threads = count
            seconds += warm_up(self.model, self.kv_caches)
        set_threads(self.active_threads)
        self.model.threads = self.active_threads
        return seconds

    @staticmethod
    def bytes_per_block(model_config: ModelConfig, block_size: int, dtype: str) -> int:
        """Bytes of one pool block, K and V over the layers it spans: 2 * L_b * block_size * H_kv * D *
        itemsize, L_b the number of K/V buffers (every layer, or group_size with KV cache groups), the
        itemsize of engine `dtype`'s compute dtype (bfloat16 keeps a float32 KV cache)."""
        c = model_config
        layers = num_kv_buffers(ModelRunner.model_kv_cache_groups(c), c.num_hidden_layers)
        itemsize = compute_dtype(dtype).itemsize
        return 2 * layers * block_size * c.num_key_value_heads * c.head_dim * itemsize

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        """Flatten the step: request r's tokens (all_token_ids + its scheduled drafts)[c : c + n] at
        positions c .. c + n - 1.

        c = num_computed_tokens, n = num_scheduled_tokens[request_id]; in each KV cache group, position
        p goes to slot table[p // block_size] * block_size + p % block_size of the request's table in
        that group (`SchedulerOutput.block_ids`, or r.block_ids for a model of one group;
        `block_table.MultiGroupBlockTable` checks the tables and builds each group's metadata). This is the
        step's one validation: the model and its kernels trust what it returns. Raises ValueError for
        an empty step, n < 1, c + n beyond the request's tokens, drafts that are not the step's last
        tokens of their request, a token id outside the vocabulary, block tables for another number of
        groups, too few blocks, or a block the step reads (a sliding group's: from the block of
        position c - W + 1 on) that is outside the pool.
        """
        requests = scheduler_output.scheduled_requests
        if not requests:
            raise ValueError("the scheduler output schedules no request")
        ids: list[npt.NDArray[np.int64]] = []
        positions: list[npt.NDArray[np.int64]] = []
        context_lens = np.empty(len(requests), dtype=np.int64)  # [R]
        tables_of: list[tuple[list[int], ...]] = []  # [R][groups]
        spec = scheduler_output.scheduled_spec_decode_tokens
        num_logits = np.ones(len(requests), dtype=np.int64)  # [R], 1 + d_r
        for i, r in enumerate(requests):
            n = scheduler_output.num_scheduled_tokens.get(r.request_id, 0)
            c = r.num_computed_tokens
            drafts = spec.get(r.request_id, [])
            tokens = r.all_token_ids + drafts
            if n < 1 or c < 0 or c + n > len(tokens):
                raise ValueError(
                    f"request {r.request_id!r}: {n} scheduled tokens after {c} computed, of {len(tokens)} tokens"
                )
            if drafts and (c + n != len(tokens) or n < 1 + len(drafts)):
                raise ValueError(
                    f"request {r.request_id!r}: its {len(drafts)} draft tokens must end the step"
                )
            num_logits[i] = 1 + len(drafts)
            tables_of.append(self.block_table.check_request(scheduler_output, r, c + n))
            ids.append(np.asarray(tokens[c : c + n], dtype=np.int64))
            positions.append(np.arange(c, c + n, dtype=np.int64))
            context_lens[i] = c + n
        input_ids = np.concatenate(ids)  # [N]
        vocab = self.model.config.vocab_size
        if input_ids.min() < 0 or input_ids.max() >= vocab:
            bad = int(input_ids[(input_ids < 0) | (input_ids >= vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary 0 .. {vocab - 1}")
        pos = np.concatenate(positions)  # [N]
        counts = np.array([p.shape[0] for p in positions], dtype=np.int64)  # [R]
        query_start_loc = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # [R+1]
        request_of_token = np.repeat(np.arange(len(requests)), counts)  # [N]
        # each request's last 1 + d_r rows: [R + D]
        last_rows: list[npt.NDArray[np.int64]] = [
            np.arange(int(end) - int(k), int(end), dtype=np.int64)
            for end, k in zip(query_start_loc[1:], num_logits, strict=True)
        ]
        logits_indices = np.concatenate(last_rows)
        row_per_token = bool(spec) and np.array_equal(counts, num_logits)  # one token + drafts each
        group_metadata = self.block_table.attention_metadata(
            tables_of, pos, request_of_token, query_start_loc, context_lens, row_per_token
        )
        layer_metadata = tuple(group_metadata[g] for g in self.layer_group)
        return ModelInputs(input_ids, pos, group_metadata[0], logits_indices, query_start_loc, layer_metadata)

    def execute_model(self, scheduler_output: SchedulerOutput) -> FloatArray:
        """Run one step; logits `[R + D, V]` in the engine dtype: for each of scheduled_requests in
        order, one row for its last scheduled token (whether or not the scheduler samples from it), or
        with d scheduled drafts 1 + d rows, for its last token and each draft token. Writes the step's
        K/V into `kv_caches`. Raises ValueError as `prepare_inputs` does, before touching the caches.
        """
        inputs = self.prepare_inputs(scheduler_output)
        self.last_inputs = inputs
        self._use_threads()
        hidden = self.model.forward(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata, inputs.layer_metadata
        )  # [N, D_model]
        self._record_prompt_logprobs(scheduler_output, hidden, inputs.query_start_loc)
        return self.model.compute_logits(hidden[inputs.logits_indices])  # [R + D, V]

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


def set_aside_non_finite(
    scheduler_output: SchedulerOutput, logits: FloatArray
) -> tuple[list[str], FloatArray]:
    """The requests of the step whose rows to sample (`sample_tokens`'s) hold a NaN, an infinity or a
    value past float32's range, and the logits with those rows set to zero (a copy; `logits` itself
    when there is none), so that the others sample as they would have. The caller fails those requests.
    Rows of a partial prefill chunk are not sampled and not looked at. logits: `[R + D, V]`."""
    reqs = scheduler_output.scheduled_requests
    spec = scheduler_output.scheduled_spec_decode_tokens
    if logits.ndim != 2:
        return [], logits  # sample_tokens refuses the shape
    finite_rows = np.asarray((np.abs(logits) <= _MAX_LOGIT).all(axis=1), dtype=bool)  # [R + D]; NaN fails
    bad_rows = ~finite_rows
    if not bad_rows.any():
        return [], logits
    failed: list[str] = []
    cleaned = logits.copy()
    start = 0
    for r in reqs:
        rows = slice(start, start + 1 + len(spec.get(r.request_id, ())))
        start = rows.stop
        if (scheduler_output.samples_token(r) or spec.get(r.request_id)) and bad_rows[rows].any():
            failed.append(r.request_id)
            cleaned[rows] = 0.0
    return failed, cleaned


def sample_tokens(
    scheduler_output: SchedulerOutput, logits: FloatArray, grammar_output: GrammarOutput | None = None
) -> ModelRunnerOutput:
    """The tokens one step yields, from the logits `[R + D, V]` `execute_model` returned.

    `grammar_output`: the step's grammar bitmask `[R + D, W]` (rows laid out as the logits); the rows
    of its structured requests are masked before sampling (the logprobs stay those of the raw rows).

    A request whose last token the step computed, without drafts, gets one token from its row
    (`sampler.sample`); one with d scheduled drafts gets its 1 + d rows verified
    (`rejection_sampler.verify_draft`, 1 .. d + 1 tokens); a partial prefill chunk gets none. A request
    that asks for logprobs gets each sampled token's TokenLogprobs from that token's raw row.

    Raises:
        ValueError: logits is not `[R + D, V]`, or what `sample` / `verify_draft` raise (NaN, infinite
            or out-of-range logits).
    """
    reqs = scheduler_output.scheduled_requests
    spec = scheduler_output.scheduled_spec_decode_tokens
    num_rows = [1 + len(spec.get(r.request_id, ())) for r in reqs]  # [R]
    if logits.ndim != 2 or logits.shape[0] != sum(num_rows):
        raise ValueError(
            f"execute_model returned logits of shape {logits.shape}, expected [{sum(num_rows)}, V]"
        )
    starts = np.cumsum([0, *num_rows])  # request i's rows: starts[i] : starts[i + 1]
    sampled: list[list[int]] = [[] for _ in reqs]
    bitmask = None if grammar_output is None else grammar_output.grammar_bitmask  # [R + D, W]
    masked = frozenset[str]() if grammar_output is None else grammar_output.structured_output_request_ids

    def rows_mask(i: int) -> npt.NDArray[np.int32] | None:
        return (
            bitmask[starts[i] : starts[i + 1]]
            if bitmask is not None and reqs[i].request_id in masked
            else None
        )

    plain = [i for i, r in enumerate(reqs) if scheduler_output.samples_token(r) and num_rows[i] == 1]
    masks = [m[0] if (m := rows_mask(i)) is not None else None for i in plain]
    tokens = sample(logits[starts[plain]], [reqs[i] for i in plain], masks if bitmask is not None else None)
    for i, token in zip(plain, tokens, strict=True):
        sampled[i] = [token]
    for i, r in enumerate(reqs):
        drafts = spec.get(r.request_id)
        if drafts:
            rows, mask = logits[starts[i] : starts[i + 1]], rows_mask(i)
            sampled[i] = (
                verify_draft(rows, r, drafts) if mask is None else verify_draft(rows, r, drafts, mask)
            )
    logprobs: list[list[TokenLogprobs]] | None = None
    if any(r.sampling_params.logprobs is not None for r in reqs):
        logprobs = []
        for i, r in enumerate(reqs):
            k = r.sampling_params.logprobs
            row = int(starts[i])  # token j of the request was sampled from row + j
            logprobs.append(
                [] if k is None else [token_logprobs(logits[row + j], t, k) for j, t in enumerate(sampled[i])]
            )
    req_ids = [r.request_id for r in reqs]
    return ModelRunnerOutput(req_ids, {rid: i for i, rid in enumerate(req_ids)}, sampled, logprobs)
