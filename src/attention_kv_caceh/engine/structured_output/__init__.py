"""StructuredOutputManager: grammars compiled off the step loop, and each step's token bitmask.

Corresponds to vLLM v1's `vllm/v1/structured_output/__init__.py` (StructuredOutputManager: grammar_init,
grammar_bitmask, should_advance) with the scheduler's part of it (`get_grammar_bitmask`, the
WAITING_FOR_FSM state, the draft-token cut of `update_draft_token_ids`). Left out: backends other than
llguidance, the reasoning-parser hooks, the parallel bitmask fill over a thread pool (one row after
another here: about 20 to 100 microseconds a row, see docs/results.md) and the grammar cache.

One request, as vLLM runs it:

1. `grammar_init` (when the core queues the request) submits the compile to a worker thread; the request
   waits in WAITING_FOR_FSM and the scheduler passes over it (others are admitted past it) until the
   future is done. A compile error fails that request alone ("rejected" with llguidance's message).
2. Each step, after scheduling, `grammar_bitmask` fills the rows of the step's logits that belong to
   structured requests: one row per sampled position, and with draft tokens d one row per draft
   position too (row j after the grammar consumed draft[:j], then rolled back).
3. The sampler applies the rows before sampling (`utils.apply_token_bitmask`).
4. `Scheduler.update_from_output` advances the grammar over the accepted tokens; a grammar that is
   complete (allows nothing more) finishes the request with "stop".
5. With n-gram speculation the core cuts a request's new drafts at the first token its grammar rejects
   (`validate_draft_tokens`), so every scheduled draft has a mask row.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import numpy.typing as npt

from .backend_guidance import GrammarCompileError, GuidanceGrammar, build_llg_tokenizer, compile_grammar
from .params import StructuredOutputsParams
from .request import StructuredOutputRequest

if TYPE_CHECKING:
    from ..request import Request
    from ..scheduler import SchedulerOutput

__all__ = [
    "GrammarCompileError",
    "GrammarOutput",
    "StructuredOutputManager",
    "StructuredOutputRequest",
    "StructuredOutputsParams",
]


@dataclass(frozen=True)
class GrammarOutput:
    """The step's grammar masks (vLLM's GrammarOutput).

    Attributes:
        structured_output_request_ids: the scheduled requests whose rows are masked.
        grammar_bitmask: `[R + D, ceil(V_g / 32)]` int32, laid out as the step's logits rows (request by
            request in scheduled order, 1 + d rows each); the rows of other requests are all ones.
    """

    structured_output_request_ids: frozenset[str]
    grammar_bitmask: npt.NDArray[np.int32]


class StructuredOutputManager:
    """Compiles grammars in a worker thread and fills each step's bitmask (see the module docstring).

    Args:
        tokenizer_json: the `tokenizers` tokenizer as JSON (`Tokenizer.backend_json()`); llguidance's
            tokenizer view is built from it in the worker thread when the first grammar is compiled
            (about 0.4 s for a 49k vocabulary, once).
        eos_token_ids: the ids that end an output once its grammar is complete.
        max_workers: compile threads.
    """

    def __init__(self, tokenizer_json: str, eos_token_ids: Sequence[int], max_workers: int = 1) -> None:
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._tokenizer_json = tokenizer_json
        self._eos_token_ids = tuple(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use
        self._tokenizer_lock = threading.Lock()
        self._pending: set[Future[GuidanceGrammar]] = set()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self.on_grammar_ready: Callable[[], None] | None = None  # the busy loop's wake-up (EngineCoreProc)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer view (waits for it on first use). Raises GrammarCompileError."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = build_llg_tokenizer(self._tokenizer_json, self._eos_token_ids)
            return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Token ids the masks cover."""
        return self.tokenizer.vocab_size

    def grammar_init(self, request: Request) -> None:
        """Submit the compile of the request's grammar; it waits in WAITING_FOR_FSM until it is done."""
        so = request.structured_output_request
        if so is None or so.future is not None:
            return
        future = self._executor.submit(self._compile, so.params)
        so.future = future
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._compiled)

    def _compile(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        return compile_grammar(params, self.tokenizer)

    def _compiled(self, future: Future[GuidanceGrammar]) -> None:
        with self._lock:
            self._pending.discard(future)
            self._ready.notify_all()
        callback = self.on_grammar_ready
        if callback is not None:
            callback()

    def has_pending_grammars(self) -> bool:
        """Any compile still running."""
        with self._lock:
            return bool(self._pending)

    def wait_for_grammar(self, timeout: float) -> None:
        """Block until a compile finishes or `timeout` seconds pass (the in-process client, idle)."""
        with self._lock:
            if self._pending:
                self._ready.wait(timeout)

    @staticmethod
    def should_advance(request: Request) -> bool:
        """The request's grammar is compiled and must follow its tokens."""
        so = request.structured_output_request
        return so is not None and so.grammar is not None

    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The masks of this step's sampled rows (None when no such row is structured; see GrammarOutput).

        A request with drafts gets row j after its grammar consumed draft[:j] (the drafts were cut to
        what the grammar allows when proposed), then the grammar is rolled back: it advances only on the
        tokens the step accepts (Scheduler.update_from_output)."""
        spec = scheduler_output.scheduled_spec_decode_tokens
        requests = scheduler_output.scheduled_requests
        structured = [r for r in requests if self.should_advance(r) and scheduler_output.samples_token(r)]
        if not structured:
            return None
        num_rows = sum(1 + len(spec.get(r.request_id, ())) for r in requests)
        words = (self.vocab_size + 31) // 32
        bitmask = np.full((num_rows, words), -1, dtype=np.int32)  # [R + D, W]
        ids = {r.request_id for r in structured}
        row = 0
        for request in requests:
            drafts = spec.get(request.request_id, [])
            if request.request_id in ids:
                so = request.structured_output_request
                assert so is not None and so.grammar is not None
                grammar = so.grammar
                start = grammar.num_processed_tokens
                for j in range(len(drafts) + 1):
                    grammar.fill_bitmask(bitmask, row + j)
                    if j < len(drafts) and not grammar.accept_tokens([drafts[j]]):
                        raise ValueError(
                            f"request {request.request_id!r}: draft token {drafts[j]} breaks its grammar"
                        )
                grammar.rollback(grammar.num_processed_tokens - start)
            row += 1 + len(drafts)
        return GrammarOutput(frozenset(ids), bitmask)

    @staticmethod
    def validate_draft_tokens(request: Request, drafts: list[int]) -> list[int]:
        """The drafts cut at the first token the request's grammar rejects (all of them without one)."""
        so = request.structured_output_request
        if so is None or so.grammar is None or not drafts:
            return drafts
        return so.grammar.validate_tokens(drafts)

    def shutdown(self) -> None:
        """Stop the compile threads (running compiles finish)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
