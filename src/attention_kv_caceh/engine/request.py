"""Request, SamplingParams, RequestStatus: one generation request and its life cycle.

Corresponds to vLLM v1's `vllm/v1/request.py` (Request, RequestStatus), `vllm/sampling_params.py` (the
fields used here) and `check_stop` in `vllm/v1/core/sched/utils.py`. Left out: multimodal inputs, LoRA,
stop strings (the API process applies them), min_p, bad words. A request with `structured_outputs`
carries its StructuredOutputRequest (engine/structured_output/) and waits in WAITING_FOR_FSM until its
grammar is compiled.

Life cycle: (WAITING_FOR_FSM ->) WAITING -> RUNNING -> (PREEMPTED, back at the front of the waiting queue -> RUNNING)* ->
FINISHED_STOPPED | FINISHED_LENGTH_CAPPED | FINISHED_ABORTED. A preempted request keeps its output tokens;
they are recomputed with the prompt when it runs again (preemption by recompute).

Like vLLM's Request, it is given a block hasher when prefix caching is on and keeps its own
`block_hashes`: the prompt's full blocks are hashed when it is built, each later block when the output
token that fills it is appended (a preempted request keeps them: its tokens are the same).

The core's Request has no timestamps: the front end's OutputProcessor keeps them (output_processor.py),
where the metrics read them, as vLLM v1 does.
"""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .structured_output.params import StructuredOutputsParams
from .structured_output.request import StructuredOutputRequest

# A request's block hasher (see block_pool.get_request_block_hasher): the hashes of the full blocks of
# request.all_token_ids that request.block_hashes does not cover yet.
BlockHasher = Callable[["Request"], list[bytes]]

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_REPETITION_PENALTY",
    "SAMPLING_EPS",
    "BlockHasher",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "TokenLogprobs",
    "check_stop",
    "decode_logprobs_payloads",
    "max_final_num_tokens",
]


class RequestStatus(enum.Enum):
    """Where a request is in its life cycle (vLLM v1's RequestStatus; WAITING_FOR_FSM: its grammar is
    being compiled)."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        """True for the three FINISHED_* states."""
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: "stop" (eos or a stop token), "length" (max_tokens or max_model_len),
        "abort"; None while the request is not finished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}

# Temperatures below this are greedy, as in vLLM (vllm/sampling_params.py, `_SAMPLING_EPS = 1e-5`).
SAMPLING_EPS = 1e-5

# repetition_penalty is accepted in [1 / MAX_REPETITION_PENALTY, MAX_REPETITION_PENALTY] (vLLM takes any
# value > 0). The bound keeps every value the sampler computes finite: a logit (at most float32's 3.4e38,
# which the sampler checks) times 1e100, divided by a temperature of at least SAMPLING_EPS, is at most
# about 3.4e143, far inside float64 (1.8e308); past it, 1e-300 or 1e300 overflowed to +-inf and the
# choice among infinite logits was arbitrary.
MAX_REPETITION_PENALTY = 1e100

# OpenAI's range for a logit_bias value: [-100, 100].
MAX_LOGIT_BIAS = 100.0


def _is_int(value: object) -> bool:
    """An int that is not a bool (the fields are typed int, but callers may pass anything)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_nonempty_str(value: object) -> bool:
    return isinstance(value, str) and bool(value)


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probability of one token and the most probable alternatives at its position.

    Attributes:
        token_id: the token (sampled, or the prompt's token at this position).
        logprob: natural-log probability of `token_id` under the model's raw logits (log-softmax in
            float64 of the logits row in the engine dtype, before penalties and temperature, as vLLM's
            default `raw_logprobs` mode).
        rank: 1 + the number of tokens with a strictly larger logit (1 for the greedy token).
        top: (token id, logprob) of the k most probable tokens, most probable first, ties by token id.
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()

    def to_wire(self) -> list[object]:
        """A msgpack-able list `[token_id, logprob, rank, [[id, logprob], ...]]` (what the core sends)."""
        return [self.token_id, self.logprob, self.rank, [list(pair) for pair in self.top]]

    @classmethod
    def from_wire(cls, obj: Sequence[Any]) -> TokenLogprobs:
        """The inverse of `to_wire` (after a msgpack round trip)."""
        token_id, logprob, rank, top = obj
        return cls(int(token_id), float(logprob), int(rank), tuple((int(t), float(lp)) for t, lp in top))


def decode_logprobs_payloads(
    payloads: Sequence[Any] | None,
) -> tuple[list[TokenLogprobs], tuple[TokenLogprobs, ...] | None]:
    """The sampled tokens' TokenLogprobs and the prompt's (None when absent) from the core's
    `new_logprobs` payloads, one `[sampled, prompt]` per token (core.py `_logprobs_payload`)."""
    sampled: list[TokenLogprobs] = []
    prompt: tuple[TokenLogprobs, ...] | None = None
    for payload in payloads or []:
        step_sampled, step_prompt = payload
        if step_sampled is not None:
            sampled.append(TokenLogprobs.from_wire(step_sampled))
        if step_prompt is not None and prompt is None:
            prompt = tuple(TokenLogprobs.from_wire(entry) for entry in step_prompt)
    return sampled, prompt


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token and when to stop (a subset of vLLM's SamplingParams).

    Attributes:
        max_tokens: most output tokens (>= 1).
        temperature: below SAMPLING_EPS (1e-5, vLLM's `_SAMPLING_EPS`) is greedy (argmax, no random
            draw): dividing by a tinier temperature overflows float64 (1e-320) or leaves only rounding
            noise; >= SAMPLING_EPS divides the logits before the softmax.
        top_p: keep the smallest set of most probable tokens whose probability sums to >= top_p (0 < top_p <= 1).
        top_k: keep the k most probable tokens; 0 disables.
        seed: seed (>= 0) of the request's own np.random.Generator; None draws fresh entropy.
        ignore_eos: keep generating after the eos token.
        stop_token_ids: more token ids that end the request (always honored, unlike eos).
        stop: strings that end the request; the text stops before the first one found (after it with
            include_stop_str_in_output; applied by the front end's OutputProcessor, which aborts the
            request in the core, and only in the text of the tokens after the first min_tokens).
        min_tokens: output tokens before eos or a stop token may end the request (the sampler masks
            them until then; the API process holds back stop strings the same way).
        frequency_penalty, presence_penalty: OpenAI's penalties over the generated tokens, in [-2, 2]:
            logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0).
        repetition_penalty: in [1e-100, 1e100] (MAX_REPETITION_PENALTY); 1 disables. A token in the
            prompt or the output has its logit divided by it when positive, multiplied by it otherwise
            (Keskar et al. 2019; vLLM, transformers).
        logit_bias: (token id, bias) pairs added to the logits before sampling, biases in [-100, 100].
        logprobs: None, or k >= 0: each sampled token's TokenLogprobs with its top k alternatives.
        prompt_logprobs: None, or k >= 0: a TokenLogprobs for every prompt token after the first (the
            request then skips the prefix cache, as vLLM does, so every position is computed).
        include_stop_str_in_output: keep the stop string, or the stop token's text, in the output.
        skip_special_tokens: leave special tokens out of the text (the OutputProcessor's detokenizer).
        structured_outputs: a constraint the output must satisfy (a JSON schema, a regex, a choice, a
            grammar ...; StructuredOutputsParams), or None.

    Raises:
        ValueError: a field is out of its range, or min_tokens > 0 with structured_outputs (the grammar
            may allow only eos where min_tokens forbids it).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be an int >= 0 or None, got {self.seed!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        if any(not _is_nonempty_str(s) for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not 1 / MAX_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [1e-100, 1e100], got {self.repetition_penalty!r}"
            )
        if any(
            not _is_int(t) or t < 0 or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in self.logit_bias
        ):
            raise ValueError(
                f"logit_bias must map ids >= 0 to biases in [-100, 100], got {self.logit_bias!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured_outputs")

    def derive(self, **changes: Any) -> SamplingParams:
        """A copy with `changes`, not validated again: the engine's own copies of params validated once
        where they were built (a sample's `seed + i`, the checkpoint's extra eos ids). Each change must
        keep the fields in range; a caller's new params go through the constructor."""
        derived = copy.copy(self)  # copies the fields without __init__, so __post_init__ does not run
        for name, value in changes.items():
            if name not in self.__dataclass_fields__:
                raise TypeError(f"SamplingParams has no field {name!r}")
            object.__setattr__(derived, name, value)  # frozen: the one way to set a field
        return derived

    @property
    def has_penalties(self) -> bool:
        """Any of the three penalties differs from its neutral value."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @property
    def is_greedy(self) -> bool:
        """Temperature below SAMPLING_EPS (0 included): argmax, no random draw."""
        return self.temperature < SAMPLING_EPS


class Request:
    """One request: its tokens and its place in the KV cache.

    Attributes:
        request_id: unique id.
        prompt_token_ids: the prompt's token ids.
        sampling_params: SamplingParams.
        eos_token_id: the tokenizer's end-of-sequence id, or None.
        status: RequestStatus.
        num_computed_tokens: tokens of `all_token_ids` whose K/V are in the cache.
        output_token_ids: sampled tokens so far.
        block_ids: the block table: block_ids[i] holds positions [i*block_size, (i+1)*block_size).
        block_hashes: prefix-cache hashes of the full blocks of all_token_ids. With a block_hasher they
            cover every full block of the prompt from construction on and are extended by
            append_output_token as each block fills (vLLM's Request does the same); without one they
            stay empty until the KV cache manager fills them.
        block_hasher: the BlockHasher given at construction, or None (prefix caching off).
        num_cached_tokens: prompt tokens served by a prefix-cache hit at the latest admission (sent
            to the front end with each output; FinishedRequestStats carries it).
        num_preemptions: times this request was preempted (sent likewise).
        output_logprobs: one TokenLogprobs per output token when sampling_params.logprobs is set.
        prompt_logprobs: one TokenLogprobs per prompt token after the first when
            sampling_params.prompt_logprobs is set, filled as prefill chunks are computed.
        generator: the request's own random generator (sampling with temperature > 0), seeded from
            sampling_params.seed, so its draws do not depend on the other requests in the batch.
        spec_token_ids: draft tokens proposed after the latest step (speculative decoding), to be
            verified at the next one; not part of all_token_ids (vLLM's `spec_token_ids`).
        structured_output_request: the constraint and its grammar when sampling_params has
            structured_outputs, else None (vLLM's `structured_output_request`).

    Raises:
        ValueError: an empty prompt or a negative token id.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        block_hasher: BlockHasher | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if any(t < 0 for t in prompt_token_ids):
            raise ValueError(f"request {request_id!r}: negative token id in the prompt")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.output_token_ids: list[int] = []
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.output_logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.generator = np.random.default_rng(sampling_params.seed)
        self.spec_token_ids: list[int] = []
        self.block_hasher = block_hasher
        so = sampling_params.structured_outputs
        self.structured_output_request = None if so is None else StructuredOutputRequest(so)
        if so is not None:
            self.status = RequestStatus.WAITING_FOR_FSM
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @property
    def use_structured_output(self) -> bool:
        """The request has a structured-output constraint."""
        return self.structured_output_request is not None

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the output tokens."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """len(all_token_ids)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """len(prompt_token_ids)."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """len(output_token_ids)."""
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """The status is one of the FINISHED_* states."""
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        """Record a sampled token; with a block_hasher, hash the block it completes."""
        self.output_token_ids.append(token_id)
        if self.block_hasher is not None:
            self.block_hashes.extend(self.block_hasher(self))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )


def max_final_num_tokens(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """The most tokens (prompt + output) a request can reach before `check_stop` ends it: max_tokens
    after its prompt, capped by max_model_len, and never fewer than one output token. The one place
    max_tokens is resolved against the context (the KV admission rule, kv_cache_manager.py, reads it)."""
    return min(num_prompt_tokens + max_tokens, max(max_model_len, num_prompt_tokens + 1))


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set a FINISHED_* status if the request must stop after its latest token; return whether it did.

    Order (vLLM v1's `check_stop` checks length first; here a natural stop wins over a simultaneous length
    cap so an eos on the last allowed token reports "stop", as OpenAI's API does):
    1. the last token is eos (unless ignore_eos) or in stop_token_ids, and at least min_tokens tokens
       exist -> FINISHED_STOPPED;
    2. num_output_tokens >= max_tokens or num_tokens >= max_model_len -> FINISHED_LENGTH_CAPPED.
    """
    if not request.output_token_ids:
        return False
    params = request.sampling_params
    last = request.output_token_ids[-1]
    is_stop = (not params.ignore_eos and last == request.eos_token_id) or last in params.stop_token_ids
    if is_stop and request.num_output_tokens >= params.min_tokens:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
