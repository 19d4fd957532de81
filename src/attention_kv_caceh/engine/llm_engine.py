"""LLMEngine: add requests, call step() until done; each step is schedule -> execute -> sample -> update.

Corresponds to vLLM v1's `vllm/v1/engine/llm_engine.py` + `core.py` (EngineCore.step) +
`output_processor.py` / `detokenizer.py` (text deltas), folded into one synchronous class the way
nano-vllm's `llm_engine.py` is. Left out: the engine-core process, async output, multiple engines, stop
strings (the API process applies them). Every step records a StepStats, the per-step numbers vLLM's Prometheus metrics and
its scheduler stats are made of.

The model side is reached through two small protocols so tests can inject a fake: a `ModelRunnerLike` with
`execute_model(SchedulerOutput) -> logits [R, V]` (row i = logits after the last scheduled token of
scheduled_requests[i]) and, optionally, a `TokenizerLike` with `decode(ids) -> str` and `eos_token_id`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from .config import EngineConfig
from .model import Model
from .model_runner import ModelRunner
from .request import Request, RequestStatus, SamplingParams, TokenLogprobs
from .sampler import sample
from .scheduler import Scheduler, SchedulerOutput
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["STEP_STATS_MAXLEN", "LLMEngine", "ModelRunnerLike", "RequestOutput", "StepStats", "TokenizerLike"]

# StepStats kept by an engine: the newest this many steps (about 10 minutes of 25 ms steps), so a
# long-running server's memory stays bounded; a consumer that needs every step reads them as they come.
STEP_STATS_MAXLEN = 25_000


class ModelRunnerLike(Protocol):
    """What the engine needs from a model runner."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> npt.NDArray[np.floating[Any]]:
        """Compute the scheduled tokens; return logits [R, V], row i for scheduled_requests[i]."""
        ...


class TokenizerLike(Protocol):
    """What the engine needs from a tokenizer: decode of id windows (for text deltas) and the eos id."""

    @property
    def eos_token_id(self) -> int | None:
        """End-of-sequence id, or None."""
        ...

    def decode(self, token_ids: list[int], /) -> str:
        """Text of the token ids."""
        ...


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (vLLM's RequestOutput in DELTA mode, one sequence).

    Attributes:
        request_id: the request.
        new_token_ids: tokens produced this step (one, in this engine).
        text_delta: text those tokens added ("" without a tokenizer, or while UTF-8 is incomplete).
        finished: the request ended this step.
        finish_reason: "stop" | "length" when finished, else None.
        num_output_tokens: output tokens so far.
        logprobs: TokenLogprobs of new_token_ids (empty unless sampling_params.logprobs is set).
        prompt_logprobs: with the request's first output only, when sampling_params.prompt_logprobs is
            set: one TokenLogprobs per prompt token after the first; else None.
    """

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_output_tokens: int
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class StepStats:
    """One step's scheduling and cache numbers (vLLM's SchedulerStats per step).

    Attributes:
        step_index: 0, 1, 2, ... over the engine's life.
        num_scheduled_tokens: request_id -> tokens computed this step.
        num_prefill_tokens, num_decode_tokens: split of the step's tokens (see SchedulerOutput).
        num_running, num_waiting: queue sizes after the step (vLLM's num_requests_running / _waiting).
        num_free_blocks: free KV blocks after the step.
        kv_cache_usage: used / total blocks after the step, in [0, 1].
        num_preemptions: requests preempted in this step.
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up / found at this step's admissions.
        step_time_ms: wall time of the step (perf_counter), milliseconds.
    """

    step_index: int
    num_scheduled_tokens: dict[str, int]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    step_time_ms: float


class LLMEngine:
    """A synchronous engine over a scheduler, a model runner and an optional tokenizer.

    Args:
        config: EngineConfig.
        model_runner: anything with execute_model(SchedulerOutput) -> logits [R, V].
        tokenizer: anything with decode(ids) and eos_token_id, or None (no text, eos from `eos_token_id`).
        num_blocks: KV blocks the runner allocated; None takes config.num_kv_blocks.
        max_model_len: most tokens per request; None takes config.max_model_len.
        eos_token_id: overrides the tokenizer's eos id.
        extra_eos_token_ids: more end-of-sequence ids (a checkpoint may list several); like vLLM, they are
            added to a request's stop_token_ids unless it sets ignore_eos.
        max_step_stats: how many of the newest StepStats `step_stats` keeps.

    Raises:
        ValueError: num_blocks or max_model_len is neither given nor in the config, or max_step_stats < 1.

    Attributes:
        step_stats: one StepStats per step that computed something, the newest STEP_STATS_MAXLEN
            (older ones are dropped; StepStats.step_index keeps counting).
        num_steps: steps that computed something over the engine's life.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_runner: ModelRunnerLike,
        tokenizer: TokenizerLike | None = None,
        *,
        num_blocks: int | None = None,
        max_model_len: int | None = None,
        eos_token_id: int | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
        max_step_stats: int = STEP_STATS_MAXLEN,
    ) -> None:
        blocks = num_blocks if num_blocks is not None else config.num_kv_blocks
        if blocks is None:
            raise ValueError("num_blocks is required when config.num_kv_blocks is None")
        model_len = max_model_len if max_model_len is not None else config.max_model_len
        if model_len is None:
            raise ValueError("max_model_len is required when config.max_model_len is None")
        if max_step_stats < 1:
            raise ValueError(f"max_step_stats must be >= 1, got {max_step_stats}")
        self.config = config
        self.model_runner = model_runner
        self.tokenizer = tokenizer
        self.eos_token_id = (
            eos_token_id
            if eos_token_id is not None
            else (tokenizer.eos_token_id if tokenizer is not None else None)
        )
        self.extra_eos_token_ids = tuple(t for t in extra_eos_token_ids if t != self.eos_token_id)
        self.scheduler = Scheduler(config, blocks, model_len)
        self.step_stats: deque[StepStats] = deque(maxlen=max_step_stats)
        self.num_steps = 0
        self._num_generate_calls = 0
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}  # request_id -> its text deltas

    @classmethod
    def from_pretrained(cls, model_path: str, config: EngineConfig | None = None) -> LLMEngine:
        """Load a Hugging Face checkpoint folder (config.json, safetensors, tokenizer.json) into an engine.

        Builds Model, Tokenizer and ModelRunner, sizing the KV cache with config.num_blocks_for.

        Raises:
            ValueError / OSError: from loading, or a max_model_len above the checkpoint's.
        """
        cfg = config or EngineConfig()
        model = Model.load(model_path, cfg.dtype)
        tokenizer = Tokenizer.load(model_path)
        max_model_len = cfg.resolve_max_model_len(model.config.max_position_embeddings)
        bytes_per_block = ModelRunner.bytes_per_block(model.config, cfg.block_size, cfg.dtype)
        num_blocks = cfg.num_blocks_for(bytes_per_block)
        runner = ModelRunner(model, cfg, num_blocks)
        eos_ids = tuple(int(t) for t in model.config.eos_token_ids)
        eos = tokenizer.eos_token_id
        if eos is None and eos_ids:
            eos = eos_ids[0]
        return cls(
            cfg,
            runner,
            tokenizer,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            eos_token_id=eos,
            extra_eos_token_ids=eos_ids,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Queue a request; it runs from the next step.

        Raises:
            ValueError: empty prompt, negative ids, an id in use, a prompt over max_model_len, or a request
                that cannot fit in the whole KV pool (see Scheduler.add_request).
        """
        params = sampling_params or SamplingParams()
        extra = tuple(t for t in self.extra_eos_token_ids if t not in params.stop_token_ids)
        if extra and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
        request = Request(request_id, prompt_token_ids, params, self.eos_token_id, arrival_time)
        self.scheduler.add_request(request)
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer)
        return request

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now and free their blocks (unknown or finished ids are ignored)."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            self._detokenizers.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        """Any request waiting or running."""
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step and return what it produced.

        Raises:
            ValueError: the runner's logits are not [R, V].
        """
        t0 = time.perf_counter()
        kv = self.scheduler.kv_cache_manager
        queries0, hits0 = kv.prefix_cache_queries, kv.prefix_cache_hits
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            return []
        logits = self.model_runner.execute_model(scheduler_output)  # [R, V]
        reqs = scheduler_output.scheduled_requests
        if logits.ndim != 2 or logits.shape[0] != len(reqs):
            raise ValueError(
                f"execute_model returned logits of shape {logits.shape}, expected [{len(reqs)}, V]"
            )
        rows = [i for i, r in enumerate(reqs) if scheduler_output.samples_token(r)]
        sampled = sample(logits[rows], [reqs[i] for i in rows])
        updates = self.scheduler.update_from_output(
            scheduler_output, {reqs[i].request_id: t for i, t in zip(rows, sampled, strict=True)}
        )
        outputs = [self._make_output(request, token) for request, token in updates]
        self.step_stats.append(
            StepStats(
                step_index=self.num_steps,
                num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
                num_prefill_tokens=scheduler_output.num_prefill_tokens,
                num_decode_tokens=scheduler_output.num_decode_tokens,
                num_running=self.scheduler.num_running,
                num_waiting=self.scheduler.num_waiting,
                num_free_blocks=kv.num_free_blocks,
                kv_cache_usage=kv.usage,
                num_preemptions=len(scheduler_output.preempted_request_ids),
                prefix_cache_queries=kv.prefix_cache_queries - queries0,
                prefix_cache_hits=kv.prefix_cache_hits - hits0,
                step_time_ms=(time.perf_counter() - t0) * 1e3,
            )
        )
        self.num_steps += 1
        return outputs

    def _make_output(self, request: Request, token: int) -> RequestOutput:
        rid = request.request_id
        delta = ""
        detokenizer = self._detokenizers.get(rid)
        if detokenizer is not None:  # feeds the window of new ids; holds back an incomplete UTF-8 character
            delta = detokenizer.add(request.output_token_ids[len(detokenizer.token_ids) :])
            if request.is_finished:
                delta += detokenizer.flush()
        if request.is_finished:
            self._detokenizers.pop(rid, None)
        params = request.sampling_params
        logprobs: tuple[TokenLogprobs, ...] = ()
        if params.logprobs is not None and len(request.output_logprobs) >= request.num_output_tokens:
            logprobs = (request.output_logprobs[request.num_output_tokens - 1],)
        prompt_logprobs = None
        if params.prompt_logprobs is not None and request.num_output_tokens == 1:
            prompt_logprobs = tuple(request.prompt_logprobs)
        return RequestOutput(
            request_id=rid,
            new_token_ids=[token],
            text_delta=delta,
            finished=request.is_finished,
            finish_reason=request.status.finish_reason,
            num_output_tokens=request.num_output_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def generate(
        self, prompts: list[list[int]], sampling_params: SamplingParams | None = None
    ) -> list[list[int]]:
        """Run prompts to completion; return each prompt's output token ids, in the prompts' order.

        Raises:
            ValueError: as add_request.
        """
        base = self._num_generate_calls
        self._num_generate_calls += 1
        ids = [f"gen-{base}-{i}" for i in range(len(prompts))]
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        for rid, prompt in zip(ids, prompts, strict=True):
            self.add_request(rid, prompt, sampling_params)
        while self.has_unfinished_requests():
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[rid] for rid in ids]
