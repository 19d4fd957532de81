"""LLMEngine: add requests, call step() until done; offline use (`generate`, `bench-engine`, the tests).

Corresponds to vLLM v1's `vllm/v1/engine/llm_engine.py`: an EngineCore reached through an InprocClient
(core_client.py; the core runs in the caller's thread, one `step()` per call) and the front end's
OutputProcessor (output_processor.py), the same one AsyncLLM uses, which turns each step's token ids into
text deltas with one incremental detokenizer per request. Every step records a StepStats (core.py), the
per-step numbers vLLM's Prometheus metrics and its scheduler stats are made of.

The model side is reached through two small protocols so tests can inject a fake: a `ModelRunnerLike` with
`execute_model(SchedulerOutput) -> logits [R, V]` (row i = logits after the last scheduled token of
scheduled_requests[i]) and, optionally, a `TokenizerLike` with `decode(ids) -> str` and `eos_token_id`.

Left out: vLLM's input processor (add_request takes token ids), parallel sampling (`n` > 1), LoRA, multimodal
inputs, pooling, a multiprocess core (vLLM's LLMEngine can use an MPClient; this one is always in-process),
and the stat loggers.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from .config import EngineConfig
from .core import STEP_STATS_MAXLEN, EngineCore, EngineCoreRequest, ModelRunnerLike, StepStats
from .core_client import InprocClient
from .output_processor import OutputProcessor, RequestDelta
from .request import Request, SamplingParams, TokenLogprobs, decode_logprobs_payloads
from .scheduler import Scheduler
from .structured_output import StructuredOutputManager
from .tokenizer import Tokenizer

__all__ = ["STEP_STATS_MAXLEN", "LLMEngine", "ModelRunnerLike", "RequestOutput", "StepStats", "TokenizerLike"]


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
        new_token_ids: tokens produced this step (one; up to 1 + K with speculative decoding).
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


class LLMEngine:
    """A synchronous engine: an EngineCore in this thread and an OutputProcessor.

    Args:
        config: EngineConfig.
        model_runner: anything with execute_model(SchedulerOutput) -> logits [R, V].
        tokenizer: anything with decode(ids) and eos_token_id, or None (no text, eos from `eos_token_id`).
        num_blocks, max_model_len, extra_eos_token_ids, max_step_stats: as EngineCore.
        eos_token_id: overrides the tokenizer's eos id.

    Raises:
        ValueError: num_blocks or max_model_len is neither given nor in the config, or max_step_stats < 1.

    Attributes:
        engine_core: the EngineCore (its scheduler, model runner and StepStats are also reachable here).
        step_stats: one StepStats per step that computed something, the newest STEP_STATS_MAXLEN.
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
        eos = eos_token_id if eos_token_id is not None else (tokenizer.eos_token_id if tokenizer else None)
        manager = None
        if isinstance(tokenizer, Tokenizer):  # a `tokenizers` tokenizer: llguidance can read it
            stop_ids = tuple(
                dict.fromkeys([int(t) for t in ([] if eos is None else [eos]) + list(extra_eos_token_ids)])
            )
            manager = StructuredOutputManager(tokenizer.backend_json(), stop_ids)
        core = EngineCore(
            config,
            model_runner,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            eos_token_id=eos,
            extra_eos_token_ids=extra_eos_token_ids,
            max_step_stats=max_step_stats,
            structured_output_manager=manager,
        )
        self._init(core, tokenizer)

    def _init(self, core: EngineCore, tokenizer: TokenizerLike | None) -> None:
        self.engine_core = core
        self.engine_core_client = InprocClient(core)
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor(tokenizer)
        self._num_generate_calls = 0

    @classmethod
    def from_pretrained(cls, model_path: str, config: EngineConfig | None = None) -> LLMEngine:
        """Load a Hugging Face checkpoint folder (config.json, safetensors, tokenizer.json) into an engine.

        Raises:
            ValueError / OSError: from loading, or a max_model_len above the checkpoint's.
        """
        core = EngineCore.from_pretrained(model_path, config)
        engine = cls.__new__(cls)
        engine._init(core, Tokenizer.load(model_path))
        return engine

    # -- the core's parts, for callers that inspect them -------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The EngineConfig."""
        return self.engine_core.config

    @property
    def scheduler(self) -> Scheduler:
        """The core's scheduler (its queues and KV cache manager)."""
        return self.engine_core.scheduler

    @property
    def model_runner(self) -> ModelRunnerLike:
        """The core's model runner."""
        return self.engine_core.model_runner

    @property
    def step_stats(self) -> deque[StepStats]:
        """The core's newest StepStats."""
        return self.engine_core.step_stats

    @property
    def num_steps(self) -> int:
        """Steps that computed something."""
        return self.engine_core.num_steps

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence id."""
        return self.engine_core.eos_token_id

    # -- requests ----------------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None
    ) -> Request:
        """Queue a request; it runs from the next step. Returns the core's Request (its block table,
        its tokens), for callers that inspect the scheduler.

        Raises:
            ValueError: empty prompt, negative ids, an id in use, a prompt over max_model_len, or a request
                that cannot fit in the whole KV pool (see Scheduler.add_request).
        """
        params = sampling_params or SamplingParams()
        now = time.monotonic()
        self.output_processor.add_request(request_id, len(prompt_token_ids), params, now)
        try:
            return self.engine_core_client.add_request(
                EngineCoreRequest(request_id, list(prompt_token_ids), params, now)
            )
        except BaseException:  # refused or failed on its way: never left tracked
            self.output_processor.pop(request_id)
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now and free their blocks (unknown or finished ids are ignored)."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        self.engine_core_client.abort_requests(ids)
        for rid in ids:
            self.output_processor.pop(rid)

    def has_unfinished_requests(self) -> bool:
        """Any request waiting or running."""
        return self.engine_core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step and return what it produced.

        Raises:
            ValueError: the runner's logits are not [R, V]; anything the runner raises.
        """
        outputs = self.engine_core_client.get_output()
        if not outputs.outputs:
            return []
        processed = self.output_processor.process_outputs(outputs, time.monotonic())
        if processed.reqs_to_abort:
            self.engine_core_client.abort_requests(processed.reqs_to_abort)
        results: list[RequestOutput] = []
        for _state, item in processed.deliveries:
            if isinstance(item, RequestDelta):
                logprobs, prompt_logprobs = decode_logprobs_payloads(item.new_logprobs)
                results.append(
                    RequestOutput(
                        request_id=item.request_id,
                        new_token_ids=list(item.new_token_ids),
                        text_delta=item.text,
                        finished=item.finished,
                        finish_reason=item.finish_reason,
                        num_output_tokens=item.num_output_tokens,
                        logprobs=tuple(logprobs),
                        prompt_logprobs=prompt_logprobs,
                    )
                )
        return results

    def reset_prefix_cache(self) -> bool:
        """See EngineCore.reset_prefix_cache."""
        return self.engine_core_client.reset_prefix_cache()

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
