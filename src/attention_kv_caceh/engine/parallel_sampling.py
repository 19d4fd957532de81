"""ParentRequest: one request of `n` samples as `n` engine requests, and ChildRequest, one of them.

Corresponds to vLLM's `vllm/v1/engine/parallel_sampling.py` (ParentRequest, `get_child_info`): child `i`
has the request id `{i}_{parent id}` (the parent's own id when n is 1) and the seed `seed + i` (None
stays None), so the samples differ and each is reproducible. AsyncLLM.add_parallel_request makes the
children (async_llm.py).

One difference in when they start: vLLM adds every child at once; here the first child is added at once
and the others when it has its first token (`ChildRequest.deltas` waits for it), so that the prompt's
full blocks are in the prefix cache by then and every sample shares them instead of computing the
prompt again (children admitted in one step could not hit blocks computed in that same step).

Left out: vLLM's output aggregation in the ParentRequest (`output_kind` FINAL_ONLY gathering the
children's outputs, and the `n` it records for the metrics): each child has its own stream here, and the
caller interleaves or gathers them (entrypoints/openai/serving_response.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from attention_kv_caceh.engine.output_processor import (
    EngineDrainingError,
    EngineStepError,
    RequestDelta,
    RequestStream,
)
from attention_kv_caceh.engine.request import SamplingParams

__all__ = ["AddRequest", "ChildFactory", "ChildRequest", "ParentRequest"]

AddRequest = Callable[[str, list[int], SamplingParams], RequestStream]
"""AsyncLLM.add_request's shape: (request id, prompt token ids, SamplingParams) -> its stream."""


@dataclass
class ChildRequest:
    """One sample of a request: an engine request added by `start()`, at most once.

    Attributes:
        index: the caller's index for this sample's output (vLLM's `CompletionOutput.index`).
        request_id: its engine request id.
        prompt_token_ids: its prompt.
        params: its SamplingParams.
        add_request: what adds it to the engine (AsyncLLM.add_request, or a stand-in); may raise
            EngineDrainingError or EngineDeadError.
        leader: the sibling whose first token this one waits for before it starts, or None.
        stream: its stream once started; closed: `close()` was called (it never starts after);
        first_token: set when its first delta arrived, or it ended or was closed.
    """

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    add_request: AddRequest
    leader: ChildRequest | None = None
    stream: RequestStream | None = field(default=None, init=False)
    closed: bool = field(default=False, init=False)
    first_token: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def start(self) -> RequestStream:
        """Add the engine request (once); raises EngineDrainingError while the engine shuts down."""
        if self.stream is None:
            self.stream = self.add_request(self.request_id, self.prompt_token_ids, self.params)
        return self.stream

    def close(self, finish_reason: str = "abort") -> None:
        """Abort the engine request unless it finished; a child not started yet never starts."""
        self.closed = True
        self.first_token.set()
        if self.stream is not None:
            self.stream.close(finish_reason)

    async def deltas(self) -> AsyncIterator[RequestDelta]:
        """Its RequestDeltas: after the leader's first token (if it has a leader), unless closed by then.

        Raises EngineStepError when it cannot start because the engine is shutting down, and what its
        stream raises.
        """
        if self.leader is not None:
            await self.leader.first_token.wait()
        if self.closed:
            return
        try:
            stream = self.start()
        except EngineDrainingError as exc:
            raise EngineStepError(f"the server is shutting down: {exc}") from exc
        try:
            async for delta in stream:
                self.first_token.set()
                yield delta
        finally:
            self.first_token.set()  # also when the leader failed: the others start (and fail) on their own


C_co = TypeVar("C_co", bound=ChildRequest, covariant=True)


class ChildFactory(Protocol[C_co]):
    """What builds one child: ChildRequest itself, or a subclass carrying the caller's output state."""

    def __call__(
        self,
        index: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        add_request: AddRequest,
        leader: ChildRequest | None,
    ) -> C_co: ...


class ParentRequest:
    """A request of `n` samples (vLLM's ParentRequest). Raises ValueError for n < 1."""

    def __init__(self, request_id: str, n: int, params: SamplingParams) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.request_id = request_id
        self.n = n
        self.params = params

    def child_info(self, index: int) -> tuple[str, SamplingParams]:
        """(request id, SamplingParams) of child `index`: `{index}_{request_id}` and `seed + index`."""
        if self.n == 1:
            return self.request_id, self.params
        seed = self.params.seed
        params = self.params if seed is None else self.params.derive(seed=seed + index)
        return f"{index}_{self.request_id}", params
