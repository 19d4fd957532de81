"""Scheduler: vLLM v1's token-budget loop with chunked prefill, prefix caching and preemption by recompute.

Corresponds to vLLM v1's `vllm/v1/core/sched/scheduler.py` (schedule, update_from_output, finish_requests)
and `output.py` (SchedulerOutput), with its structured-output part (WAITING_FOR_FSM requests passed
over until their grammar is compiled, the grammar advanced over accepted tokens, a complete grammar
finishing the request). Left out: priorities, encoder inputs, KV transfer,
async scheduling, the partial-prefill limits (long_prefill_token_threshold), vLLM's per-client output
lists (one front end here), and make_stats (`Scheduler.make_stats` builds the step's StepStats).

There are no separate prefill and decode phases. Every request has `num_tokens` tokens (prompt + output) of
which `num_computed_tokens` are in the KV cache; a step gives each scheduled request n tokens to compute,
from one token budget (`max_num_batched_tokens`):

1. Running requests first, in admission order: each gets min(num_tokens + len(spec_token_ids) -
   num_computed_tokens, budget) tokens: 1 for a decode (plus its draft tokens with speculative decoding,
   as many as the budget leaves), the next chunk for an unfinished prefill. If its blocks cannot be
   allocated, its draft tokens are dropped first; then the most recently admitted running request is
   preempted (blocks freed, num_computed_tokens = 0, back at the FRONT of the waiting queue) until they
   can, or until the request itself is the one preempted.
2. Then, if nothing was preempted this step, waiting requests in order while fewer than max_num_seqs run
   and budget remains: a prefix-cache hit sets their starting num_computed_tokens, and the rest of the
   prompt (or its first chunk) is scheduled. A request that does not fit stops admission (first come,
   first served: no later request overtakes it). A request whose grammar is still compiling
   (WAITING_FOR_FSM) is passed over and keeps its place; one whose grammar failed to compile is
   finished and reported "rejected" with the compile error (`take_rejected`).

A token is sampled for a request only when the step computes its last token (c + n == num_tokens, and
its scheduled drafts after it); a partial prefill chunk samples nothing. update_from_output takes the
model runner's ModelRunnerOutput, advances num_computed_tokens, appends the sampled tokens (and their
logprobs), checks stop conditions, frees finished requests, registers newly full blocks for prefix
caching, and returns the step's EngineCoreOutputs: one EngineCoreOutput per request that got tokens.

Speculative decoding (vLLM's `spec_token_ids` / `scheduled_spec_decode_tokens`): a running request's
draft tokens (`Request.spec_token_ids`, proposed after the previous step) are scheduled after its last
token, inside the token budget and with KV slots like any token, and never past max_model_len (the step
must leave room for the token it yields). A verified step yields a + 1 tokens for a accepted drafts; the
request's num_computed_tokens then advances by n - (drafts - a): the K/V written at rejected draft
positions lie beyond it and are overwritten when those positions are computed again, and only blocks
full of accepted tokens are registered for prefix caching. A request's drafts are dropped when it is
scheduled (used or not) and when it is preempted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from .config import EngineConfig
from .kv_cache_manager import KVCacheConfig, KVCacheGroups, KVCacheManager
from .outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, encode_logprobs_payloads
from .request import Request, RequestStatus, check_stop
from .spec_decode.metrics import SpecDecodingStats
from .stats import StepStats

__all__ = ["Scheduler", "SchedulerOutput"]


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step computes.

    For request r with n = num_scheduled_tokens[r.request_id] and c = r.num_computed_tokens (before the
    step), the step computes r.all_token_ids[c : c + n] at positions c .. c+n-1; r.block_ids already covers
    positions 0 .. c+n-1 and the K/V of positions < c are in the cache.

    Attributes:
        scheduled_requests: requests in the order the runner lays them out (running first, then new).
        num_scheduled_tokens: request_id -> tokens computed this step (>= 1).
        total_num_scheduled_tokens: sum of num_scheduled_tokens (N of the flattened batch).
        num_prefill_tokens: tokens of prompt chunks and of recomputation after preemption.
        num_decode_tokens: tokens of requests computing their newest sampled token and its drafts
            (n == 1 + drafts, c == num_tokens - 1, c >= num_prompt_tokens).
        scheduled_spec_decode_tokens: request_id -> the draft tokens scheduled after its last token
            (included in num_scheduled_tokens; vLLM's name); requests without drafts are absent.
        scheduled_new_request_ids: requests admitted from the waiting queue this step.
        num_computed_tokens: request_id -> c, a snapshot taken when scheduling.
        preempted_request_ids: requests preempted while scheduling this step.
        finished_request_ids: requests that finished or were aborted since the previous step (the
            runner may drop any state it keeps for them).
        block_ids: request_id -> its block table in every KV cache group, copied when scheduling
            (vLLM's `NewRequestData.block_ids`, a tuple of lists); filled only for a model of several
            groups, where -1 marks a sliding group's block that was freed. Empty: each request's one
            table is r.block_ids.
    """

    scheduled_requests: list[Request]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    scheduled_new_request_ids: list[str] = field(default_factory=list[str])
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict[str, list[int]])
    num_computed_tokens: dict[str, int] = field(default_factory=dict[str, int])
    preempted_request_ids: list[str] = field(default_factory=list[str])
    finished_request_ids: list[str] = field(default_factory=list[str])
    block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict[str, tuple[list[int], ...]])

    def samples_token(self, request: Request) -> bool:
        """Whether this step computes the request's last token, so a token is sampled from its logits."""
        rid = request.request_id
        end = request.num_tokens + len(self.scheduled_spec_decode_tokens.get(rid, ()))
        return self.num_computed_tokens[rid] + self.num_scheduled_tokens[rid] == end


class Scheduler:
    """Chooses each step's tokens within max_num_seqs and max_num_batched_tokens.

    Args:
        config: EngineConfig (max_num_seqs, max_num_batched_tokens, block_size, enable_prefix_caching).
        num_blocks: KV blocks in the pool (the model runner allocated as many).
        max_model_len: most tokens of a request (resolved from the checkpoint and the config).
        groups: the model's KV cache groups (`kv_cache_coordinator`); empty: one full-attention group.

    Attributes:
        waiting: deque of requests not running (WAITING, or PREEMPTED at the front).
        running: requests holding blocks, in admission order.
        kv_cache_manager: KVCacheManager.
        kv_cache_config: the pool (num_kv_blocks, block_size, max_model_len) requests are checked against.
        num_preemptions: preemptions so far.
        prefix_cache_at_schedule: the KV cache manager's (prefix_cache_queries, prefix_cache_hits) when
            the latest schedule() began (the step's lookups are the difference).
    """

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int, groups: KVCacheGroups = ()):
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.config, self.max_model_len, bs, g = config, max_model_len, config.block_size, groups
        self.kv_cache_manager = KVCacheManager(num_blocks, bs, config.enable_prefix_caching, g)
        self.kv_cache_config = KVCacheConfig.for_engine(
            num_blocks, bs, max_model_len, g, config.max_num_batched_tokens
        )
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_at_schedule = (0, 0)
        self._finished_ids: list[str] = []
        self._rejected: list[EngineCoreOutput] = []

    # ---- admission ------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, refusing it up front if it could never run.

        Raises:
            ValueError: the id is in use, or the prompt is longer than max_model_len.
            RequestTooLargeError: the request's largest context needs more than the whole pool
                (`KVCacheConfig.check_request_fits`, the one admission rule; a ValueError).
        """
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt of {request.num_prompt_tokens} tokens exceeds max_model_len "
                f"{self.max_model_len}"
            )
        self.kv_cache_config.check_request_fits(request.num_prompt_tokens, request.sampling_params.max_tokens)
        so = request.structured_output_request
        waiting_for_fsm = so is not None and not so.is_grammar_ready
        request.status = RequestStatus.WAITING_FOR_FSM if waiting_for_fsm else RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort): free their blocks; unknown or finished ids are ignored.

        Raises:
            ValueError: status is not a FINISHED_* state.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a FINISHED_* state, got {status.name}")
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._finish(request)

    def _finish(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue (including preempted ones)."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding blocks (vLLM's num_requests_running)."""
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        """Any request waiting or running."""
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------------------

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating their blocks (see the module docstring)."""
        cfg = self.config
        kv = self.kv_cache_manager
        self.prefix_cache_at_schedule = (kv.prefix_cache_queries, kv.prefix_cache_hits)
        budget = cfg.max_num_batched_tokens
        scheduled: list[Request] = []
        num_tokens: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            drafts, request.spec_token_ids = request.spec_token_ids, []
            c = request.num_computed_tokens
            n = min(request.num_tokens + len(drafts) - c, budget)
            # drafts scheduled: what the budget leaves after the request's own tokens, and no position the
            # token the step yields could not follow (max_model_len)
            num_spec = max(0, min(c + n - request.num_tokens, self.max_model_len - 1 - request.num_tokens))
            n = min(n, request.num_tokens - c + num_spec)
            while kv.allocate_slots(request, n) is None:
                if num_spec:  # the drafts give way first: the request decodes without them
                    n, num_spec = n - num_spec, 0
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(request)
                num_tokens[request.request_id] = n
                if num_spec:
                    spec_tokens[request.request_id] = drafts[:num_spec]
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted: nothing after it is running any more

        new_ids: list[str] = []
        skipped: list[Request] = []  # WAITING_FOR_FSM: keep their place, let the others past
        while not preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            request = self.waiting[0]
            if not self._grammar_ready(request):
                if request.status == RequestStatus.WAITING_FOR_FSM:
                    skipped.append(self.waiting.popleft())
                continue
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            n = min(request.num_tokens - num_hit, budget)
            if kv.allocate_slots(request, n, hit_blocks) is None:
                break
            self.waiting.popleft()
            kv.record_prefix_cache_lookup(request, num_hit)
            request.num_computed_tokens = num_hit
            request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(request)
            num_tokens[request.request_id] = n
            new_ids.append(request.request_id)
            budget -= n
        self.waiting.extendleft(reversed(skipped))

        computed = {r.request_id: r.num_computed_tokens for r in scheduled}
        num_decode = sum(
            num_tokens[r.request_id]
            for r in scheduled
            if num_tokens[r.request_id] == 1 + len(spec_tokens.get(r.request_id, ()))
            and computed[r.request_id] == r.num_tokens - 1
            and computed[r.request_id] >= r.num_prompt_tokens
        )
        total = sum(num_tokens.values())
        finished_ids = self._finished_ids
        if total:  # an empty step is not executed: report the finished ids with the next real one
            self._finished_ids = []
        return SchedulerOutput(
            scheduled_requests=scheduled,
            num_scheduled_tokens=num_tokens,
            total_num_scheduled_tokens=total,
            num_prefill_tokens=total - num_decode,
            num_decode_tokens=num_decode,
            scheduled_new_request_ids=new_ids,
            scheduled_spec_decode_tokens=spec_tokens,
            num_computed_tokens=computed,
            preempted_request_ids=preempted,
            finished_request_ids=list(finished_ids),
            block_ids=(
                {r.request_id: tuple(list(t) for t in kv.get_block_ids(r)) for r in scheduled}
                if kv.num_groups > 1
                else {}
            ),
        )

    def _grammar_ready(self, request: Request) -> bool:
        """Whether the waiting request at the front may be admitted: its grammar (if any) is compiled.
        A compile error finishes it (FINISHED_ABORTED, reported "rejected" by take_rejected)."""
        so = request.structured_output_request
        if so is None or request.status != RequestStatus.WAITING_FOR_FSM:
            return True
        if not so.is_grammar_ready:
            return False
        error = so.compile_error
        if error is None:
            request.status = RequestStatus.WAITING
            return True
        self.waiting.popleft()
        request.status = RequestStatus.FINISHED_ABORTED
        self._finish(request)
        self._rejected.append(EngineCoreOutput(request.request_id, [], "rejected", error))
        return False

    def take_rejected(self) -> list[EngineCoreOutput]:
        """The "rejected" outputs of requests whose grammar failed to compile since the last call."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Apply a computed step: advance, append samples and logprobs, stop, free, cache full blocks.

        Args:
            scheduler_output: the output of the latest schedule().
            model_runner_output: the tokens the step yielded (`model_runner.sample_tokens`): for exactly
                the requests whose last token the step computed (`scheduler_output.samples_token(r)`),
                one token, or with d scheduled drafts the a accepted ones and the token after them.

        Returns:
            EngineCoreOutputs with one EngineCoreOutput per request that got tokens, in scheduled order
            (its step_stats are the core's to add); the tokens stop at the first that ends the request (a
            stop token, max_tokens, max_model_len), whose status is then FINISHED_* and whose blocks are
            freed.

        Raises:
            ValueError: the output is not for the scheduled requests in order, gives a sampling request no
                token, a request that did not sample some, or one more than its drafts + 1 (checked
                before anything changes).
        """
        _check_model_runner_output(scheduler_output, model_runner_output)
        spec = scheduler_output.scheduled_spec_decode_tokens
        logprobs = model_runner_output.logprobs
        kv = self.kv_cache_manager
        outputs: list[EngineCoreOutput] = []
        for i, request in enumerate(scheduler_output.scheduled_requests):
            rid = request.request_id
            if request.status != RequestStatus.RUNNING:
                continue  # aborted between schedule() and now
            n = scheduler_output.num_scheduled_tokens[rid]
            tokens = model_runner_output.sampled_token_ids[i]
            if not tokens:
                request.num_computed_tokens += n
                kv.cache_full_blocks(request)
                continue
            # vLLM's rollback: the positions of rejected drafts are not computed tokens of the request
            num_rejected = len(spec.get(rid, ())) - (len(tokens) - 1)
            request.num_computed_tokens += n - num_rejected
            kept: list[int] = []
            stopped = grammar_stop = False
            grammar_error: str | None = None
            so = request.structured_output_request
            grammar = None if so is None else so.grammar
            for token in tokens:
                if grammar is not None and not grammar.accept_tokens([token]):
                    # the grammar engine gave up (a grammar too complex for it, say): this request
                    # alone fails; the step's other requests keep their tokens
                    grammar_error = f"token {token} breaks its grammar ({grammar.error})"
                    break
                request.append_output_token(token)
                kept.append(token)
                stopped = check_stop(request, self.max_model_len)
                if grammar is not None and not stopped and grammar.is_terminated():
                    request.status = RequestStatus.FINISHED_STOPPED  # the grammar is complete: "stop"
                    stopped = grammar_stop = True
                if stopped:
                    break
            if grammar_error is not None:
                self.running.remove(request)
                request.status = RequestStatus.FINISHED_ABORTED
                self._finish(request)
                outputs.append(EngineCoreOutput(rid, [], "error", f"structured output: {grammar_error}"))
                continue
            if logprobs is not None and logprobs[i]:  # none for tokens trimmed after a stop
                request.output_logprobs.extend(logprobs[i][: len(kept)])
            # tokens trimmed after a stop were computed as drafts but are not the request's
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            kv.cache_full_blocks(request)
            if stopped:
                self.running.remove(request)
                self._finish(request)
            outputs.append(
                EngineCoreOutput(
                    rid,
                    kept,
                    request.status.finish_reason,
                    new_logprobs=encode_logprobs_payloads(request, len(kept)),
                    num_cached_tokens=request.num_cached_tokens,
                    num_preemptions=request.num_preemptions,
                    grammar_stop=grammar_stop,
                )
            )
        return EngineCoreOutputs(outputs)

    def make_stats(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
        step_index: int,
        step_time_ms: float,
        step_cpu_ms: float,
    ) -> StepStats:
        """The StepStats of the step `update_from_output` just applied: the queues and the pool now,
        the prefix-cache lookups since its schedule() began, and with speculative decoding each verified
        request's drafts and accepted count (before a stop trimmed its tokens, as vLLM counts them)."""
        spec = self.config.speculative_config
        spec_stats = None if spec is None else SpecDecodingStats(spec.num_speculative_tokens)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        if spec_stats is not None:
            for rid, tokens in zip(
                model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True
            ):
                if drafts.get(rid):
                    spec_stats.observe_draft(len(drafts[rid]), len(tokens) - 1)
        kv = self.kv_cache_manager
        queries0, hits0 = self.prefix_cache_at_schedule
        return StepStats(
            step_index=step_index,
            num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
            num_prefill_tokens=scheduler_output.num_prefill_tokens,
            num_decode_tokens=scheduler_output.num_decode_tokens,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_free_blocks=kv.num_free_blocks,
            kv_cache_usage=kv.usage,
            num_preemptions=len(scheduler_output.preempted_request_ids),
            prefix_cache_queries=kv.prefix_cache_queries - queries0,
            prefix_cache_hits=kv.prefix_cache_hits - hits0,
            step_time_ms=step_time_ms,
            step_cpu_ms=step_cpu_ms,
            spec_decoding=spec_stats,
        )


def _check_model_runner_output(scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
    """ValueError unless `output` gives tokens to exactly the requests that sample this step, in the
    scheduled order, and at most drafts + 1 to each."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    req_ids = [r.request_id for r in scheduler_output.scheduled_requests]
    if output.req_ids != req_ids or len(output.sampled_token_ids) != len(req_ids):
        raise ValueError(f"the model runner output is for {output.req_ids}, the step scheduled {req_ids}")
    for request, tokens in zip(scheduler_output.scheduled_requests, output.sampled_token_ids, strict=True):
        num_drafts = len(spec.get(request.request_id, ()))
        want = scheduler_output.samples_token(request)
        if want != bool(tokens) or len(tokens) > num_drafts + 1:
            raise ValueError(
                f"request {request.request_id!r}: {len(tokens)} sampled tokens for {num_drafts} draft "
                f"tokens ({'a' if want else 'no'} token expected)"
            )
