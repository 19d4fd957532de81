"""What passes between the pieces of one step, and the messages between the engine core and its front end.

Corresponds to vLLM v1's `vllm/v1/outputs.py` (ModelRunnerOutput: what the model runner hands the
scheduler) and the message types of `vllm/v1/engine/__init__.py` (EngineCoreRequest,
EngineCoreRequestType, EngineCoreOutput, EngineCoreOutputs, UtilityOutput). One step:

    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute_model, sample_tokens -> ModelRunnerOutput
    -> Scheduler.update_from_output -> EngineCoreOutputs (one EngineCoreOutput per request that got tokens)

The messages are msgspec Structs (msgpack on the wire, as vLLM sends them), array-like so a message
carries no field names. Left out: vLLM's pooling and KV-connector outputs, structured-output bitmasks,
the events and timestamps EngineCoreOutput carries for tracing and KV events, and prompt logprobs in
ModelRunnerOutput (the runner appends them to the Request itself, model_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from .kv_cache_manager import KVCacheConfig
from .request import Request, SamplingParams, TokenLogprobs
from .stats import StepStats

__all__ = [
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "ModelRunnerOutput",
    "RequestType",
    "UtilityOutput",
    "encode_logprobs_payloads",
]


@dataclass(frozen=True)
class ModelRunnerOutput:
    """The tokens one step yielded (vLLM's ModelRunnerOutput), per scheduled request in order.

    Attributes:
        req_ids: the scheduled requests' ids, in SchedulerOutput.scheduled_requests order.
        req_id_to_index: request id -> its index in req_ids.
        sampled_token_ids: per request, the tokens the step yielded: [] when the step did not compute
            its last token (a partial prefill chunk), one token, or with d scheduled draft tokens the a
            accepted ones and the token after them (1 .. d + 1 tokens).
        logprobs: per request, one TokenLogprobs per sampled token when it asked for logprobs (else
            []); None when no scheduled request asked for them.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs]] | None = None


class RequestType:
    """The first frame of a message to the core (vLLM's EngineCoreRequestType)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request as the core receives it: token ids and SamplingParams (every field of the dataclass is
    carried, so a new sampling field needs no change here). `arrival_time`: time.monotonic() seconds at
    the front end."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one request.

    Attributes:
        request_id: the request.
        new_token_ids: tokens produced this step (one; up to 1 + K with speculative decoding; none
            for an error).
        finish_reason: None while running; "stop" | "length" | "abort" when it ended this step;
            "error" when the step failed (its blocks are freed), "rejected" when the core refused the
            request when it was added (`error` says why).
        error: the message of "error" / "rejected".
        new_logprobs: one `[sampled, prompt]` per new token, TokenLogprobs in wire form
            (`encode_logprobs_payloads`); None when the request asked for no logprobs.
        num_cached_tokens: prompt tokens the prefix cache served at the request's latest admission.
        num_preemptions: times the request was preempted so far.
        grammar_stop: finish_reason "stop" came from a complete grammar (structured outputs), not from
            an eos or stop token: the last token is output text like any other.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    new_logprobs: Any = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    grammar_stop: bool = False

    @property
    def finished(self) -> bool:
        """The request ended with this output."""
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, array_like=True):
    """The answer to a utility call (`reset_prefix_cache`): `call_id` as sent, `result` or `error`."""

    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """One message from the core.

    Attributes:
        outputs: one EngineCoreOutput per request that got a token or ended.
        step_stats: the step's StepStats; None when no step ran (an answer to inputs alone).
        step_start, step_end: time.monotonic() seconds around the step (0 when none ran).
        num_running, num_waiting, kv_cache_usage: the scheduler after the step or the inputs, for the
            gauges.
        step_error: the exception of a step that failed ("Type: message"), else None.
        utility_output: the answer to a utility call, else None.
        engine_dead: set when the core's loop ended with an error (the last message it sends).
        ready: set once, by a core that finished loading (the startup handshake).
        kv_cache_config: with `ready`, the KV pool the core sized (num_kv_blocks, block_size, and the
            max_model_len that caps a request), as vLLM's handshake reports its num_gpu_blocks; the
            front end checks requests against it instead of sizing the pool again.
    """

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list[EngineCoreOutput])
    step_stats: StepStats | None = None
    step_start: float = 0.0
    step_end: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    step_error: str | None = None
    utility_output: UtilityOutput | None = None
    engine_dead: str | None = None
    ready: bool = False
    kv_cache_config: KVCacheConfig | None = None


def encode_logprobs_payloads(request: Request, num_new: int) -> list[Any] | None:
    """The `new_logprobs` of a request's newest `num_new` tokens (read back by
    `request.decode_logprobs_payloads`): one `[sampled, prompt]` each,
    TokenLogprobs.to_wire lists or None: `sampled` when it asked for logprobs, `prompt` (every prompt
    token after the first) with its first token when it asked for prompt logprobs. None when it asked
    for neither."""
    params = request.sampling_params
    if params.logprobs is None and params.prompt_logprobs is None:
        return None
    n = request.num_output_tokens
    payloads: list[Any] = []
    for i in range(n - num_new, n):
        sampled = None
        if params.logprobs is not None and len(request.output_logprobs) > i:
            sampled = request.output_logprobs[i].to_wire()
        prompt = None
        if params.prompt_logprobs is not None and i == 0:
            prompt = [entry.to_wire() for entry in request.prompt_logprobs]
        payloads.append([sampled, prompt])
    return payloads
