"""A fake model runner that reads each request's context back through the paged cache, and its oracle.

FakeModelRunner keeps a token-id "KV cache" `[num_blocks, block_size]`. Each step it first writes every
scheduled token id to its slot (slot = block_ids[p // block_size] * block_size + p % block_size, the
contract's slot mapping), then, for each request, reads positions 0 .. c+n-1 back THROUGH THE REQUEST'S
BLOCK TABLE and returns logits whose argmax is `next_token(context)`, a hash of the context read. A bug in
block allocation, prefix caching, slot mapping, chunking or preemption changes what is read, hence the
tokens; `reference_generate` applies the same hash to each growing sequence directly (full recompute,
one prompt at a time), so engine tokens == reference tokens is the end-to-end oracle.

The text fakes at the end (CharTokenizer, GatedRunner, make_text_core, expected_text) put the same runner
behind the server, AsyncLLM and CLI tests: a real EngineCore whose tokens are letters with a known oracle.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from attention_kv_caceh.engine.core import EngineCore, EngineCoreRequest
from attention_kv_caceh.engine.kv_cache_manager import cdiv
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.request import Request, SamplingParams
from attention_kv_caceh.engine.scheduler import SchedulerOutput
from attention_kv_caceh.engine.spec_decode.config import SpeculativeConfig

VOCAB = 40
EOS = 0


def context_seed(context: Sequence[int]) -> int:
    """A deterministic 64-bit hash of a token sequence."""
    digest = hashlib.blake2b(np.asarray(context, dtype=np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def next_token(context: Sequence[int], vocab: int = VOCAB) -> int:
    """The fake model's greedy next token after `context`."""
    return context_seed(context) % vocab


def one_hot_logits(context: Sequence[int], vocab: int) -> np.ndarray:
    logits = np.zeros(vocab)
    logits[next_token(context, vocab)] = 1.0
    return logits


def copy_token(context: Sequence[int], vocab: int = VOCAB) -> int:
    """A model that mostly copies (so n-gram drafts are often, not always, right): after the last token's
    most recent earlier occurrence came token x; the next token is x, except when the context's hash
    is 0 mod 4 (or the last token never occurred before), where it is the hash's token."""
    seed = context_seed(context)
    last = context[-1]
    for i in range(len(context) - 2, -1, -1):
        if context[i] == last and seed % 4:
            return int(context[i + 1])
    return seed % vocab


def copy_logits(context: Sequence[int], vocab: int) -> np.ndarray:
    """One-hot logits of copy_token (greedy tests)."""
    logits = np.zeros(vocab)
    logits[copy_token(context, vocab)] = 1.0
    return logits


def random_logits(context: Sequence[int], vocab: int) -> np.ndarray:
    """Dense logits seeded by the context: for sampling tests."""
    return np.random.default_rng(context_seed(context)).normal(scale=2.0, size=vocab)


class FakeModelRunner:
    """execute_model(SchedulerOutput) -> logits [R, V] computed from the context read through the paged cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab: int = VOCAB,
        logits_fn: Callable[[Sequence[int], int], np.ndarray] = one_hot_logits,
    ) -> None:
        self.block_size = block_size
        self.vocab = vocab
        self.logits_fn = logits_fn
        self.cache = np.full((num_blocks, block_size), -1, dtype=np.int64)  # [num_blocks, block_size]
        self.outputs: list[SchedulerOutput] = []
        self.snapshots: list[dict[str, tuple[int, int]]] = []  # per step: request_id -> (c, n)

    def _slot(self, block_ids: list[int], p: int) -> int:
        return block_ids[p // self.block_size] * self.block_size + p % self.block_size

    def execute_model(self, so: SchedulerOutput) -> np.ndarray:
        """Logits `[R + D, V]`: per request the row after its last scheduled token, or with d scheduled
        drafts the 1 + d rows after its last token and after each draft (the ModelRunner's contract),
        each from the context read back through the block table up to that position."""
        self.outputs.append(so)
        flat = self.cache.reshape(-1)  # [num_blocks * block_size], a view
        snap: dict[str, tuple[int, int]] = {}
        spec = so.scheduled_spec_decode_tokens
        for r in so.scheduled_requests:  # write every new token first, as the attention layers do
            c, n = r.num_computed_tokens, so.num_scheduled_tokens[r.request_id]
            snap[r.request_id] = (c, n)
            if c != so.num_computed_tokens[r.request_id]:
                raise AssertionError(f"{r.request_id}: num_computed_tokens changed after schedule()")
            if len(r.block_ids) < cdiv(c + n, self.block_size):
                raise AssertionError(f"{r.request_id}: {len(r.block_ids)} blocks for {c + n} positions")
            tokens = r.all_token_ids + spec.get(r.request_id, [])
            if spec.get(r.request_id) and c + n != len(tokens):
                raise AssertionError(f"{r.request_id}: drafts scheduled but not at the end of the step")
            for p in range(c, c + n):
                flat[self._slot(r.block_ids, p)] = tokens[p]
        self.snapshots.append(snap)
        rows: list[np.ndarray] = []
        for r in so.scheduled_requests:
            c, n = snap[r.request_id]
            num_rows = 1 + len(spec.get(r.request_id, []))
            for end in range(c + n - num_rows + 1, c + n + 1):  # the context of each returned row
                context = [int(flat[self._slot(r.block_ids, p)]) for p in range(end)]
                if -1 in context:
                    raise AssertionError(f"{r.request_id}: read a slot never written")
                rows.append(self.logits_fn(context, self.vocab))
        return np.array(rows).reshape(len(rows), self.vocab)  # [R + D, V]


def reference_generate(
    prompt: Sequence[int],
    params: SamplingParams,
    max_model_len: int,
    eos: int | None = EOS,
    vocab: int = VOCAB,
) -> tuple[list[int], str]:
    """Greedy tokens and finish reason by full recompute of one prompt (the oracle)."""
    seq = list(prompt)
    out: list[int] = []
    while True:
        t = next_token(seq, vocab)
        out.append(t)
        seq.append(t)
        if (not params.ignore_eos and t == eos) or t in params.stop_token_ids:
            return out, "stop"
        if len(out) >= params.max_tokens or len(seq) >= max_model_len:
            return out, "length"


def check_pool_consistent(engine: LLMEngine) -> None:
    """Ref counts equal the running requests' block-table entries; free queue == blocks with ref 0;
    every hash-map entry points to a block carrying that hash. Raises AssertionError otherwise."""
    sched = engine.scheduler
    pool = sched.kv_cache_manager.block_pool
    expected = [0] * pool.num_blocks
    for r in sched.running:
        if len(set(r.block_ids)) != len(r.block_ids):
            raise AssertionError(f"{r.request_id} holds a block twice: {r.block_ids}")
        for b in r.block_ids:
            expected[b] += 1
    for r in sched.waiting:
        if r.block_ids:
            raise AssertionError(f"waiting request {r.request_id} holds blocks {r.block_ids}")
    actual = [b.ref_cnt for b in pool.blocks]
    if actual != expected:
        raise AssertionError(f"ref counts {actual} != block-table counts {expected}")
    if sorted(pool.free_block_ids()) != [i for i, c in enumerate(expected) if c == 0]:
        raise AssertionError("free queue != blocks with ref_cnt 0")
    for h, block in pool.cached_block_hash_to_block.items():
        if block.block_hash != h:
            raise AssertionError(f"hash map entry points to block {block.block_id} with another hash")


Arrival = tuple[str, list[int], SamplingParams]


def run_workload(
    engine: LLMEngine, arrivals: dict[int, list[Arrival]], max_steps: int = 100_000
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Add arrivals[k] before step k, step until done, checking the budgets and the pool after every step.

    Returns the output tokens and finish reason of every finished request.
    """
    cfg = engine.config
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    step = 0
    last = max(arrivals, default=-1)
    while step <= last or engine.has_unfinished_requests():
        if step > max_steps:
            raise AssertionError("the engine made no progress")
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
            tokens[rid] = []
        n_steps = engine.num_steps
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason is not None
                reasons[out.request_id] = out.finish_reason
        if engine.num_steps == n_steps and step > last and engine.has_unfinished_requests():
            raise AssertionError(f"step {step}: nothing was scheduled while requests are unfinished")
        if engine.num_steps > n_steps:
            stats = engine.step_stats[-1]
            if sum(stats.num_scheduled_tokens.values()) > cfg.max_num_batched_tokens:
                raise AssertionError(f"step {step}: {stats.num_scheduled_tokens} over the token budget")
            if len(stats.num_scheduled_tokens) > cfg.max_num_seqs:
                raise AssertionError(f"step {step}: more than max_num_seqs requests scheduled")
            if min(stats.num_scheduled_tokens.values()) < 1:
                raise AssertionError(f"step {step}: a request scheduled with 0 tokens")
        if engine.scheduler.num_running > cfg.max_num_seqs:
            raise AssertionError(f"step {step}: {engine.scheduler.num_running} running > max_num_seqs")
        check_pool_consistent(engine)
        step += 1
    return tokens, reasons


def assert_all_blocks_free(engine: LLMEngine) -> None:
    pool = engine.scheduler.kv_cache_manager.block_pool
    if pool.num_free_blocks != pool.num_blocks or any(b.ref_cnt for b in pool.blocks):
        raise AssertionError(f"{pool.num_blocks - pool.num_free_blocks} blocks still held")


def make_engine(
    *,
    num_blocks: int,
    block_size: int = 4,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 16,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    vocab: int = VOCAB,
    logits_fn: Callable[[Sequence[int], int], np.ndarray] = one_hot_logits,
    speculative_config: SpeculativeConfig | None = None,
) -> tuple[LLMEngine, FakeModelRunner]:
    from attention_kv_caceh.engine.config import EngineConfig

    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        speculative_config=speculative_config,
    )
    runner = FakeModelRunner(num_blocks, block_size, vocab, logits_fn)
    return LLMEngine(config, runner, None, eos_token_id=EOS), runner


# ---------------------------------------------------------------------------------------------------------
# Text fakes for the server, AsyncLLM and CLI tests: the real EngineCore over a runner whose tokens are
# letters, a character tokenizer, and a gate that holds a step.
# ---------------------------------------------------------------------------------------------------------

TEXT_VOCAB = 96  # printable ASCII: id i is chr(32 + i)
TEXT_EOS = 95  # chr(127), decodes to nothing


class CharTokenizer:
    """One token per printable ASCII character (id = code point - 32); TEXT_EOS decodes to nothing."""

    eos_token_id: int | None = TEXT_EOS
    vocab_size: int = TEXT_VOCAB

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        return [(ord(c) - 32) % TEXT_VOCAB for c in text[:max_length]]

    def encode_counted(
        self, text: str, add_special_tokens: bool = True, max_length: int | None = None
    ) -> tuple[list[int], int, bool]:
        return self.encode(text, add_special_tokens, max_length), len(text), True

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + i) for i in ids if i != TEXT_EOS)


def letter_token(context: Sequence[int]) -> int:
    """The text runner's next token after `context`: a lowercase letter's id, from the context's hash."""
    return ord("a") - 32 + context_seed(context) % 26


def letter_logits(context: Sequence[int], vocab: int) -> np.ndarray:
    """Logits that pick letter_token(context) at any temperature the server accepts (the others get
    probability exp(-1e4 / T), 0 in float64)."""
    logits = np.zeros(vocab)
    logits[letter_token(context)] = 1e4
    return logits


def copy_letter_token(context: Sequence[int]) -> int:
    """A letter model that copies: the letter that followed the last token's most recent earlier
    occurrence, else `letter_token` (so n-gram drafts on a repetitive prompt are accepted)."""
    last = context[-1]
    for i in range(len(context) - 2, -1, -1):
        if context[i] == last:
            nxt = int(context[i + 1])
            return nxt if ord("a") - 32 <= nxt <= ord("z") - 32 else letter_token(context)
    return letter_token(context)


def copy_letter_logits(context: Sequence[int], vocab: int) -> np.ndarray:
    """letter_logits of copy_letter_token."""
    logits = np.zeros(vocab)
    logits[copy_letter_token(context)] = 1e4
    return logits


def expected_ids(prompt: Sequence[int], n: int) -> list[int]:
    """The text runner's first n tokens after `prompt` (full recompute: the oracle)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(letter_token(seq))
    return seq[len(prompt) :]


def expected_text(prompt: Sequence[int], n: int) -> str:
    """The text of the first n tokens after `prompt`."""
    return CharTokenizer().decode(expected_ids(prompt, n))


class GatedRunner(FakeModelRunner):
    """The letter runner with test controls: `gate` (set by default) holds every step while cleared
    (`blocked` is True meanwhile), `fail_steps` makes the next steps raise, `eos_after` k makes the k-th
    output token (counted from 0) EOS. `wait_for` waits, bounded, for a condition about it."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        eos_after: int | None = None,
        logits_fn: Callable[[Sequence[int], int], np.ndarray] = letter_logits,
    ) -> None:
        super().__init__(num_blocks, block_size, TEXT_VOCAB, logits_fn)
        self.gate = threading.Event()
        self.gate.set()
        self.blocked = False
        self.fail_steps = 0
        self.eos_after = eos_after
        self.steps = 0

    def execute_model(self, so: SchedulerOutput) -> np.ndarray:
        self.steps += 1
        if not self.gate.is_set():
            self.blocked = True
            self.gate.wait()
            self.blocked = False
        if self.fail_steps > 0:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        logits = super().execute_model(so)
        if self.eos_after is not None:
            row = 0  # request i's first row (one row per request, 1 + d with d drafts)
            for r in so.scheduled_requests:
                ignore = r.sampling_params.ignore_eos
                if so.samples_token(r) and r.num_output_tokens == self.eos_after and not ignore:
                    logits[row] = 0.0
                    logits[row, TEXT_EOS] = 1e4
                row += 1 + len(so.scheduled_spec_decode_tokens.get(r.request_id, []))
        return logits


def hold_input(core: EngineCore) -> threading.Event:
    """Make the core's input thread stop reading its socket while the returned event is cleared (it is
    cleared here): `preprocess_add_request`, which that thread runs for every request it receives, waits
    for the event. Frames the front end sends meanwhile pile up in ZMQ's queues, as they do behind a slow
    core."""
    reading = threading.Event()
    preprocess = core.preprocess_add_request

    def held(request: EngineCoreRequest) -> Request:
        reading.wait()
        return preprocess(request)

    core.preprocess_add_request = held  # type: ignore[method-assign]
    return reading


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0) -> bool:
    """Poll `predicate` every 5 ms until it holds (True) or `timeout` seconds pass (False): a bound on a
    wait for another thread's state, not a synchronisation by sleeping."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def make_text_core(
    *,
    max_num_seqs: int = 4,
    num_blocks: int = 4096,
    block_size: int = 16,
    max_model_len: int = 256,
    max_num_batched_tokens: int = 512,
    eos_after: int | None = None,
    enable_prefix_caching: bool = True,
    speculative_config: SpeculativeConfig | None = None,
    logits_fn: Callable[[Sequence[int], int], np.ndarray] = letter_logits,
) -> tuple[EngineCore, GatedRunner]:
    """A real EngineCore over the GatedRunner (no eos unless `eos_after`)."""
    from attention_kv_caceh.engine.config import EngineConfig

    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs),
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        speculative_config=speculative_config,
    )
    runner = GatedRunner(num_blocks, block_size, eos_after=eos_after, logits_fn=logits_fn)
    return EngineCore(config, runner, eos_token_id=TEXT_EOS), runner
