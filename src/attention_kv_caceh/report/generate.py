"""The text `generate` prints: the per-step table, the warm-up note, the closing lines.

`StepTable` prints one row per engine step as the step ends (its columns and row rule are
`STEP_TABLE_HELP`, also the command's --help epilog); the other functions build one line each from what
`offline.OfflineRun` counted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from attention_kv_caceh.engine.config import EngineConfig
    from attention_kv_caceh.engine.spec_decode.config import SpeculativeConfig

__all__ = [
    "ALWAYS_ROWS",
    "EVERY",
    "STEP_TABLE_HELP",
    "StepTable",
    "acceptance_line",
    "kv_pool_text",
    "record_line",
    "spec_text",
    "start_line",
    "totals_line",
    "warm_up_note",
]


def warm_up_note(seconds: float | None, compiled: int, loaded: int) -> str:
    """What the load spent warming up: `(of which S s warm-up: C kernel signatures compiled, L loaded
    from Numba's disk cache)`; `seconds` from `offline.load_seconds` ("" when None), the counts
    `numba_compile_counts` taken around the load."""
    if seconds is None:
        return ""
    if compiled == loaded == 0:
        return f" (of which {seconds:.2f} s warm-up, every kernel already compiled in this process)"
    return (
        f" (of which {seconds:.2f} s warm-up: {compiled} kernel signature{'s' * (compiled != 1)} compiled, "
        f"{loaded} loaded from Numba's disk cache)"
    )


def record_line(r: dict[str, Any]) -> str:
    """One finished prompt: `[index] 'prompt' -> 'text' (N tokens, finish_reason)`."""
    return f"[{r['index']}] {r['prompt']!r} -> {r['text']!r} ({len(r['token_ids'])} tokens, {r['finish_reason']})"


def kv_pool_text(num_blocks: int, block_size: int, bytes_per_block: int) -> str:
    """The KV pool in words: `N KV blocks of B tokens (P positions, X MiB)`; `bytes_per_block` is K and V
    of one block over the layers that hold it (`ModelRunner.bytes_per_block`)."""
    from attention_kv_caceh.memory import format_bytes

    return (
        f"{num_blocks} KV blocks of {block_size} tokens ({num_blocks * block_size} positions, "
        f"{format_bytes(num_blocks * bytes_per_block)})"
    )


def start_line(
    config: EngineConfig,
    num_prompts: int,
    num_tokens: int,
    max_tokens: int,
    num_blocks: int,
    max_model_len: int,
    load: str,
    bytes_per_block: int,
) -> str:
    """The first line: the prompts, the engine's limits and KV pool (`kv_pool_text`), and how long
    loading took (`load`)."""
    return (
        f"{num_prompts} prompts ({num_tokens} tokens), max_tokens {max_tokens}; "
        f"max_num_seqs {config.max_num_seqs}, max_num_batched_tokens {config.max_num_batched_tokens}, "
        f"{kv_pool_text(num_blocks, config.block_size, bytes_per_block)}, max_model_len {max_model_len}, "
        f"prefix caching {'on' if config.enable_prefix_caching else 'off'}, {config.dtype}, "
        f"speculative decoding {spec_text(config.speculative_config)}; loaded in {load}"
    )


def totals_line(num_steps: int, totals: dict[str, int], generated: int, elapsed_s: float) -> str:
    """The run's step counts (`OfflineRun.totals`) and its tokens/s over the wall time of the steps."""
    return (
        f"{num_steps} steps, {totals['num_prefill_tokens']} prefill + "
        f"{totals['num_decode_tokens']} decode tokens computed, "
        f"{totals['num_preemptions']} preemptions, "
        f"{totals['prefix_cache_hits']} prefix-cache hit tokens; {generated} tokens "
        f"generated in {elapsed_s:.2f} s wall, printing and trace included "
        f"({generated / max(elapsed_s, 1e-9):.1f} tokens/s)"
    )


def spec_text(spec: SpeculativeConfig | None) -> str:
    """How the run speculates: "off", or the n-gram settings."""
    if spec is None:
        return "off"
    return f"ngram K={spec.num_speculative_tokens} (prompt_lookup {spec.prompt_lookup_min}..{spec.prompt_lookup_max})"


def acceptance_line(steps: list[Any], num_spec_tokens: int) -> str:
    """vLLM's acceptance figures over the run's steps (`spec_decode.metrics.acceptance_summary`)."""
    from attention_kv_caceh.engine.spec_decode.metrics import acceptance_summary

    s = acceptance_summary(steps, num_spec_tokens)
    if not s.num_drafts:
        return "speculative decoding: no draft was proposed (no n-gram recurred, or no output token or context was left for one)"
    per_pos = ", ".join(f"{r:.2f}" for r in s.per_position_acceptance_rates)
    return (
        f"speculative decoding: {s.num_drafts} drafts, {s.num_draft_tokens} draft tokens, "
        f"{s.num_accepted_tokens} accepted: acceptance rate {100 * s.acceptance_rate:.1f} %, "
        f"mean acceptance length {s.acceptance_length:.2f}, per position {per_pos}"
    )


STEP_TABLE_HELP = """The per-step table `generate` prints: one row per engine step, as the step ends.

Columns (the numbers of `engine.llm_engine.StepStats`):
    step      step index (0, 1, ...)
    reqs      requests scheduled in the step (the batch's R)
    tokens    tokens computed in the step (the flattened batch's N), = prefill + decode
    prefill   tokens of prompt chunks (and of recomputation after a preemption)
    decode    tokens of requests computing their newest sampled token (1 each, plus its draft tokens
              with speculative decoding)
    draft/acc with --speculative-config only: draft tokens verified in the step / accepted
    run/wait  num_requests_running / num_requests_waiting after the step
    free      free KV blocks after the step (kv% = used / total blocks)
    preempt   requests preempted in the step (their blocks freed, recomputed later)
    hit/query prompt tokens found in / looked up in the prefix cache at the step's admissions
    ms        wall time of the step
    batch     request:tokens of every scheduled request, in batch order; `*` marks a request that
              finished in the step

Rows: each of the first 50 steps (ALWAYS_ROWS); after that, only the steps where something changes (a prefill
chunk or admission, a preemption, a finished request, a prefix-cache lookup, a different running or
waiting count), every 25th step (EVERY), and the last step. A line says how many unchanged decode steps
were left out between two rows; --trace of `generate` keeps every step.
"""

ALWAYS_ROWS = 50
"""Steps printed unconditionally at the start."""
EVERY = 25
"""After ALWAYS_ROWS, an unchanged step is still printed when its index is a multiple of this."""
_BATCH_WIDTH = 60

_HEADER = (
    f"{'step':>5} {'reqs':>4} {'tokens':>6} {'prefill':>7} {'decode':>6} {'run':>4} {'wait':>4} "
    f"{'free':>6} {'kv%':>5} {'preempt':>7} {'hit/query':>11} {'ms':>8}  batch (request:tokens, *finished)"
)


class StepTable:
    """Prints the header, then a row per StepStats under the row rule above, to `stream`; with
    `speculative`, a draft/acc column after decode."""

    def __init__(self, stream: TextIO, *, speculative: bool = False) -> None:
        self.stream = stream
        self.speculative = speculative
        self._header = _HEADER.replace(" run ", f" {'draft/acc':>9}  run ", 1) if speculative else _HEADER
        self.skipped = 0
        self.rows = 0
        self._previous: tuple[int, int] | None = None

    def _line(self, text: str) -> None:
        """One line of the table on the caller's stream (the command chooses it: stdout)."""
        self.stream.write(text + "\n")

    def header(self) -> None:
        """The column names and a rule."""
        self._line(self._header)
        self._line("-" * len(self._header))

    def _changed(self, stats: Any, finished: list[str]) -> bool:
        counts = (stats.num_running, stats.num_waiting)
        return bool(
            stats.num_prefill_tokens
            or stats.num_preemptions
            or finished
            or stats.prefix_cache_queries
            or counts != self._previous
        )

    def row(self, stats: Any, finished: list[str], *, last: bool = False) -> bool:
        """Print the row of one StepStats if the rule says so; return whether it was printed."""
        changed = self._changed(stats, finished)
        self._previous = (stats.num_running, stats.num_waiting)
        index = int(stats.step_index)
        if not (index < ALWAYS_ROWS or changed or index % EVERY == 0 or last):
            self.skipped += 1
            return False
        self._flush_skipped()
        done = set(finished)
        batch = " ".join(
            f"{rid}:{n}{'*' if rid in done else ''}" for rid, n in stats.num_scheduled_tokens.items()
        )
        if len(batch) > _BATCH_WIDTH:
            batch = batch[: _BATCH_WIDTH - 3] + "..."
        tokens = sum(stats.num_scheduled_tokens.values())
        hits = f"{stats.prefix_cache_hits}/{stats.prefix_cache_queries}"
        drafts = ""
        if self.speculative:
            sd = stats.spec_decoding
            drafts = f"{'0/0' if sd is None else f'{sd.num_draft_tokens}/{sd.num_accepted_tokens}':>9} "
        self._line(
            f"{index:>5} {len(stats.num_scheduled_tokens):>4} {tokens:>6} {stats.num_prefill_tokens:>7} "
            f"{stats.num_decode_tokens:>6} {drafts}{stats.num_running:>4} {stats.num_waiting:>4} "
            f"{stats.num_free_blocks:>6} {100 * stats.kv_cache_usage:>5.1f} {stats.num_preemptions:>7} "
            f"{hits:>11} {stats.step_time_ms:>8.2f}  {batch}"
        )
        self.rows += 1
        return True

    def _flush_skipped(self) -> None:
        if self.skipped:
            self._line(f"{'':>5} ... {self.skipped} decode steps without change not shown")
            self.skipped = 0

    def footer(self) -> None:
        """The count of steps left out at the end (an interrupted run), then a rule."""
        self._flush_skipped()
        self._line("-" * len(self._header))
