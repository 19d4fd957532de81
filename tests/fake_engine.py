"""A fake LLMEngine with the engine contract's surface, for the server tests.

Deterministic tokens: output token k of a request is the letter `chr(97 + (sum(prompt) + k) % 26)` (a
character id of the character-level FakeTokenizer), so every expected text has an oracle (`expected_text`).
The scheduler behaves like the real one where the server can see it: at most `max_num_seqs` requests run,
the rest wait in FIFO order; each running request holds ceil(num_tokens / block_size) blocks of a fixed
pool, freed when it finishes or is aborted. `gate` (a threading.Event, set by default) pauses every step
after admission; `fail_steps` makes the next steps raise; `stalled` makes steps schedule nothing. `changed` is notified after every step and abort,
so tests wait on conditions instead of sleeping.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from attention_kv_caceh.engine.request import SamplingParams, TokenLogprobs

EOS = 3  # a control character: never produced by the letter rule


class FakeTokenizer:
    """One token per character (its code point); EOS decodes to nothing."""

    eos_token_id: int | None = EOS
    vocab_size: int = 0x110000  # every code point

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != EOS or not skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        return chr(token_id).encode("utf-8", "surrogatepass")


def letter(prompt: Sequence[int], k: int) -> int:
    """Output token k of a request with this prompt."""
    return 97 + (sum(prompt) + k) % 26


def expected_text(prompt: Sequence[int], n: int) -> str:
    """The first n output characters for this prompt."""
    return "".join(chr(letter(prompt, k)) for k in range(n))


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list[int])
    block_ids: list[int] = field(default_factory=list[int])
    prefilled: bool = False


@dataclass(frozen=True)
class FakeOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class FakeStepStats:
    num_scheduled_tokens: dict[str, int]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_preemptions: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_queries: int = 0


@dataclass(frozen=True)
class FakeConfig:
    max_num_seqs: int
    block_size: int = 4


class FakeKVCacheManager:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks))

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks


class FakeScheduler:
    def __init__(self, num_blocks: int, max_model_len: int) -> None:
        self.running: list[FakeRequest] = []
        self.waiting: deque[FakeRequest] = deque()
        self.kv_cache_manager = FakeKVCacheManager(num_blocks)
        self.max_model_len = max_model_len

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


class FakeEngine:
    def __init__(
        self,
        max_num_seqs: int = 4,
        num_blocks: int = 1 << 20,
        block_size: int = 4,
        eos_at: int | None = None,
    ) -> None:
        self.config = FakeConfig(max_num_seqs, block_size)
        self.scheduler = FakeScheduler(num_blocks, max_model_len=1 << 30)
        self.block_size = block_size
        self.eos_at = eos_at
        self.gate = threading.Event()
        self.gate.set()
        self.blocked = False
        self.fail_steps = 0
        self.stalled = False
        self.step_calls = 0
        self.changed = threading.Condition()
        self.step_stats: list[FakeStepStats] = []
        self.num_steps = 0

    # -- the contract's surface --------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams
    ) -> None:
        self.scheduler.waiting.append(FakeRequest(request_id, list(prompt_token_ids), sampling_params))

    def abort_request(self, request_id: str) -> None:
        s = self.scheduler
        for r in [*s.running, *s.waiting]:
            if r.request_id == request_id:
                self._free(r)
                if r in s.running:
                    s.running.remove(r)
                else:
                    s.waiting.remove(r)
        self._notify()

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def step(self) -> list[FakeOutput]:
        self.step_calls += 1
        if self.stalled:  # nothing can be scheduled (as when the KV pool is full): no output, no stats
            self._notify()
            return []
        s = self.scheduler
        while s.waiting and len(s.running) < self.config.max_num_seqs:
            s.running.append(s.waiting.popleft())
        if not self.gate.is_set():
            with self.changed:
                self.blocked = True
                self.changed.notify_all()
            self.gate.wait()
            self.blocked = False
        if self.fail_steps > 0:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        scheduled: dict[str, int] = {}
        prefill = decode = 0
        outputs: list[FakeOutput] = []
        for r in list(s.running):
            n = 1 if r.prefilled else len(r.prompt_token_ids)
            scheduled[r.request_id] = n
            if r.prefilled:
                decode += 1
            else:
                prefill += n
                r.prefilled = True
            k = len(r.output_token_ids)
            params = r.sampling_params
            token = EOS if self.eos_at == k and not params.ignore_eos else letter(r.prompt_token_ids, k)
            r.output_token_ids.append(token)
            self._grow(r)
            reason: str | None = None
            if token == EOS or token in params.stop_token_ids:
                reason = "stop"
            elif len(r.output_token_ids) >= params.max_tokens:
                reason = "length"
            if reason is not None:
                self._free(r)
                s.running.remove(r)
            outputs.append(FakeOutput(r.request_id, [token], reason is not None, reason))
        stats = FakeStepStats(scheduled, prefill, decode, len(s.running), len(s.waiting))
        self.step_stats.append(stats)
        self.num_steps += 1
        self._notify()
        return outputs

    # -- test helpers ------------------------------------------------------------------------------------

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Wait (bounded) until `predicate()` holds after some step or abort."""
        with self.changed:
            return self.changed.wait_for(predicate, timeout)

    @property
    def num_free_blocks(self) -> int:
        return len(self.scheduler.kv_cache_manager.free)

    def _grow(self, r: FakeRequest) -> None:
        tokens = len(r.prompt_token_ids) + len(r.output_token_ids)
        need = -(-tokens // self.block_size) - len(r.block_ids)
        free = self.scheduler.kv_cache_manager.free
        for _ in range(need):
            r.block_ids.append(free.pop())

    def _free(self, r: FakeRequest) -> None:
        self.scheduler.kv_cache_manager.free.extend(r.block_ids)
        r.block_ids = []

    def _notify(self) -> None:
        with self.changed:
            self.changed.notify_all()
