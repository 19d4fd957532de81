"""Workloads: what the prompts of a run share, so that a server's prefix cache has something to find.

- `random` (the default): independent synthetic prompts (`load.make_request_specs`).
- `shared-prefix` (SGLang's `generated-shared-prefix`, guidellm's and AIPerf's prefix options):
  `num_prefixes` G shared "system prompts" of `prefix_len` P words each; request i is prefix
  i mod G followed by its own random suffix of `--prompt-len` words. Its workload group is i mod G.
  Each prefix is a run of seeded random words. With a tokenizer (exact prompts) the prefix is cut to
  exactly P tokens and each suffix to its own length, so the prompts of a group share exactly P tokens
  and then differ whatever the tokenizer; without one, a word stands for a token. A server whose prefix cache
  keeps every block computes each prefix once, so the run implies
  `(N - G) * floor(P / block_size) * block_size` hit tokens of its queries (`implied_prefix_hits`), when
  every group's first request is prefilled before the group's next one is admitted (concurrency 1,
  or a rate slow enough).
- `multi-turn` (vLLM's multi-turn benchmark, AIPerf's and guidellm's conversations): N / K conversations
  of `turns` K chat turns. Turn k sends the whole history (every earlier user message and the answer the
  server streamed to it) plus a new user message of `--prompt-len` words, so the prompt grows each turn
  and repeats the previous turn's prompt and answer. The conversations advance in rounds: round k sends
  turn k of every conversation (on the run's arrival schedule and concurrency limit) once round k - 1 has
  finished, so each turn waits for its previous answer and the server's counters can be read between
  rounds (per-turn prefix-cache hit rates, exact). A conversation whose request fails ends there. The
  workload group is the conversation, the turn its round. With `--dataset`, each line's
  `conversation` (a list of `{"role", "content"}` messages, or ShareGPT's `{"from", "value"}`) is
  replayed: its system message opens the history, its user messages (up to K) are the turns, and the
  answers are the server's own.

- `copy`: copy-heavy prompts, "repeat this passage with one change" (`copy_workload.py`): a passage of
  at least `--prompt-len` words of plain sentences to be written back with one word replaced, where a
  speculative decoder's n-gram drafts should pay (the `random` workload is where they cannot).

Every request records its workload group and turn (`RequestRecord.group`, `.turn`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from attention_kv_caceh.harness.backends import Backend, RequestSpec
from attention_kv_caceh.harness.dataset import dataset_objects
from attention_kv_caceh.harness.load import (
    SYNTHETIC_WORDS,
    InFlightTracker,
    LengthRange,
    make_request_specs,
    run_requests,
)
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.server_counters import CounterSnapshot, counter_delta
from attention_kv_caceh.harness.summary import stats_with_vllm_names
from attention_kv_caceh.options import ConfigError, check_options, option

__all__ = [
    "WORKLOADS",
    "Conversation",
    "TaggingBackend",
    "Workload",
    "WorkloadName",
    "implied_prefix_hits",
    "per_turn_summary",
    "plan_conversations",
    "read_conversations",
    "render_history",
    "run_rounds",
    "shared_prefix_specs",
]

WorkloadName = Literal["random", "shared-prefix", "multi-turn", "copy"]
WORKLOADS: tuple[WorkloadName, ...] = ("random", "shared-prefix", "multi-turn", "copy")

_WORDS = SYNTHETIC_WORDS
_ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}


@dataclass(frozen=True)
class Workload:
    """`kind` and its settings (`num_prefixes`, `prefix_len`: shared-prefix; `turns`: multi-turn).

    Raises ConfigError naming the field for a value out of range.
    """

    kind: WorkloadName = option(
        "random",
        flag="--workload",
        choices=WORKLOADS,
        help="random: independent prompts; shared-prefix: one of --num-prefixes shared prefixes of "
        "--prefix-len words, then --prompt-len words of its own; multi-turn: conversations of --turns "
        "turns, each sending the whole history (with --dataset: its `conversation` lines replayed); copy: "
        "repeat a passage of at least --prompt-len words with one change (copy-heavy, where speculative "
        "decoding pays)",
    )
    num_prefixes: int = option(4, help="shared-prefix: how many prefixes", minimum=1)
    prefix_len: int = option(
        256, help="shared-prefix: words (one token each with a tokenizer) per prefix", minimum=1
    )
    turns: int = option(
        4, help="multi-turn: turns per conversation; --num-requests must be a multiple", minimum=1
    )

    def __post_init__(self) -> None:
        check_options(self)

    def check_requests(self, num_requests: int) -> None:
        """Raise ConfigError (naming `num_requests`) when `num_requests` does not fit the workload
        (multi-turn: a multiple of `turns`)."""
        if self.kind == "multi-turn" and num_requests % self.turns:
            raise ConfigError(
                "num_requests",
                f"{num_requests}: with workload multi-turn it must be a multiple of turns={self.turns} "
                "(N / K conversations of K turns)",
            )

    def describe(self) -> dict[str, Any]:
        """The settings that apply to `kind`."""
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "shared-prefix":
            out |= {"num_prefixes": self.num_prefixes, "prefix_len": self.prefix_len}
        elif self.kind == "multi-turn":
            out["turns"] = self.turns
        return out


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(_WORDS[int(k)] for k in rng.integers(0, len(_WORDS), size=n))


def shared_prefix_specs(
    workload: Workload,
    num_requests: int,
    prompt_len: LengthRange,
    output_len: LengthRange,
    rng: np.random.Generator,
    seed: int,
) -> list[RequestSpec]:
    """`num_requests` specs: prefix i mod G (`prefix_len` words, drawn from `default_rng([seed, 2])`,
    so the prefixes do not depend on the suffixes) then a suffix of `prompt_len` words from `rng`.
    `prompt_tokens` = prefix_len + suffix length; `group` = i mod G."""
    prefix_rng = np.random.default_rng([seed, 2])
    prefixes = [_words(prefix_rng, workload.prefix_len) for _ in range(workload.num_prefixes)]
    suffixes = make_request_specs(num_requests, prompt_len, output_len, rng)
    return [
        replace(
            spec,
            prompt=prefixes[spec.request_id % workload.num_prefixes] + " " + spec.prompt,
            prompt_tokens=workload.prefix_len + spec.prompt_tokens,
            prefix=prefixes[spec.request_id % workload.num_prefixes],
            prefix_tokens=workload.prefix_len,
            group=spec.request_id % workload.num_prefixes,
        )
        for spec in suffixes
    ]


def implied_prefix_hits(workload: Workload, num_requests: int, block_size: int) -> int:
    """Prompt tokens a prefix cache of `block_size`-token blocks finds in a shared-prefix run of
    `num_requests` requests whose groups' first requests finish prefill first: every request after its
    group's first hits the prefix's whole blocks. Raises ValueError for block_size < 1."""
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    repeats = max(0, num_requests - min(num_requests, workload.num_prefixes))
    return repeats * (workload.prefix_len // block_size) * block_size


@dataclass(frozen=True)
class Conversation:
    """One conversation to run: its `group` (index), an optional `system` message, its user messages
    (one a turn) and the output tokens asked for each turn."""

    group: int
    user_messages: tuple[str, ...]
    output_lens: tuple[int, ...]
    system: str | None = None


def read_conversations(path: str | Path) -> list[tuple[str | None, tuple[str, ...]]]:
    """(system message or None, user messages) of each line of a JSONL file with a `conversation` field:
    a list of `{"role": "system"|"user"|"assistant", "content": str}` or ShareGPT's
    `{"from": "system"|"human"|"gpt", "value": str}`. Assistant messages are dropped (the server
    answers). Raises ValueError naming the file and line for unreadable JSON, a missing or empty
    conversation, an unknown role, a message that is not a string, or a conversation without a user
    message; and for a file without entries."""
    out: list[tuple[str | None, tuple[str, ...]]] = []
    for where, obj in dataset_objects(path):
        messages: object = cast("dict[str, Any]", obj).get("conversation") if isinstance(obj, dict) else None
        if not isinstance(messages, list) or not messages:
            raise ValueError(f'{where}: expected an object with a non-empty "conversation" list')
        system: str | None = None
        users: list[str] = []
        for message in cast("list[Any]", messages):
            if not isinstance(message, dict):
                raise ValueError(f"{where}: a message is not an object")
            body = cast("dict[str, Any]", message)
            role_raw: object = body.get("role", body.get("from"))
            content: object = body.get("content", body.get("value"))
            role = _ROLES.get(role_raw) if isinstance(role_raw, str) else None
            if role is None:
                raise ValueError(f"{where}: unknown role {role_raw!r}")
            if not isinstance(content, str):
                raise ValueError(f"{where}: a message's content is not a string")
            if role == "system" and system is None and not users:
                system = content
            elif role == "user":
                if not content.strip():
                    raise ValueError(f"{where}: an empty user message")
                users.append(content)
        if not users:
            raise ValueError(f"{where}: the conversation has no user message")
        out.append((system, tuple(users)))
    if not out:
        raise ValueError(f"--dataset {str(path)!r}: no entries")
    return out


def plan_conversations(
    workload: Workload,
    num_requests: int,
    prompt_len: LengthRange,
    output_len: LengthRange,
    rng: np.random.Generator,
    dataset: str | None = None,
) -> list[Conversation]:
    """N / K conversations of K turns: synthetic user messages of `prompt_len` words, or the first N / K
    conversations of `dataset` (up to K user messages each; a shorter one has fewer turns). Output
    lengths are drawn from `output_len`. Raises ValueError for a dataset with fewer conversations."""
    count, turns = num_requests // workload.turns, workload.turns
    outputs = output_len.draw(rng, count * turns)
    if dataset is None:
        lengths = prompt_len.draw(rng, count * turns)
        return [
            Conversation(
                c,
                tuple(_words(rng, lengths[c * turns + k]) for k in range(turns)),
                tuple(outputs[c * turns : (c + 1) * turns]),
            )
            for c in range(count)
        ]
    entries = read_conversations(dataset)
    if len(entries) < count:
        raise ValueError(
            f"--dataset {dataset!r} has {len(entries)} conversations, fewer than --num-requests / "
            f"--turns = {count}"
        )
    return [
        Conversation(c, users[:turns], tuple(outputs[c * turns : c * turns + len(users[:turns])]), system)
        for c, (system, users) in enumerate(entries[:count])
    ]


def render_history(messages: Sequence[tuple[str, str]]) -> str:
    """A chat history as one completions prompt: `Role: content` lines (the server sees the earlier
    turns verbatim at the start of every later prompt)."""
    return "\n".join(f"{role.capitalize()}: {content}" for role, content in messages) + "\nAssistant:"


class TaggingBackend:
    """Wraps a backend so that every record carries its spec's workload group and turn; with
    `requested=False` the record's `requested_prompt_tokens` is None (a multi-turn history's length was
    not asked for, so it is not compared with the server's count)."""

    def __init__(self, inner: Backend, *, requested: bool = True) -> None:
        self.inner = inner
        self.requested = requested

    async def generate(self, spec: RequestSpec, record: RequestRecord) -> None:
        record.group, record.turn = spec.group, spec.turn
        if not self.requested:
            record.requested_prompt_tokens = None
        await self.inner.generate(spec, record)


RoundHook = Callable[[int], Awaitable[None]]


async def run_rounds(
    backend: Backend,
    answers: dict[int, str],
    conversations: Sequence[Conversation],
    offsets_s: Sequence[float],
    concurrency: int,
    *,
    tracker: InFlightTracker,
    on_record: Callable[[RequestRecord], None] | None = None,
    before_round: RoundHook | None = None,
    after_round: RoundHook | None = None,
) -> list[RequestRecord]:
    """Run `conversations` in rounds (module docstring): round k sends turn k of every conversation still
    going, conversation c arriving `offsets_s[c]` after the round starts, at most `concurrency` in
    flight; `answers[request_id]` (filled by the backend) is the answer appended to the history.
    `before_round(k)` / `after_round(k)` are awaited around each round (to read server counters).
    Request ids: conversation * K + turn, K the most turns of any conversation. Returns every
    record in (turn, conversation) order."""
    if len(offsets_s) != len(conversations):
        raise ValueError(f"{len(conversations)} conversations but {len(offsets_s)} arrival offsets")
    most = max((len(c.user_messages) for c in conversations), default=0)
    histories: list[list[tuple[str, str]]] = [
        [("system", c.system)] if c.system is not None else [] for c in conversations
    ]
    going = [True] * len(conversations)
    records: list[RequestRecord] = []
    for turn in range(most):
        specs: list[RequestSpec] = []
        offsets: list[float] = []
        for c, conv in enumerate(conversations):
            if not going[c] or turn >= len(conv.user_messages):
                continue
            histories[c].append(("user", conv.user_messages[turn]))
            prompt = render_history(histories[c])
            spec = RequestSpec(
                conv.group * most + turn,
                max(1, math.ceil(len(prompt.split()))),
                conv.output_lens[turn],
                prompt,
                from_dataset=True,  # the text is sent as it is
                group=conv.group,
                turn=turn,
                messages=tuple(histories[c]),
            )
            specs.append(spec)
            offsets.append(offsets_s[c])
        if not specs:
            break
        if before_round is not None:
            await before_round(turn)
        done = await run_requests(
            TaggingBackend(backend, requested=False),
            specs,
            offsets,
            concurrency,
            tracker=tracker,
            on_record=on_record,
        )
        if after_round is not None:
            await after_round(turn)
        for spec, record in zip(specs, done, strict=True):
            assert spec.group is not None
            c = spec.group
            if record.ok:
                histories[c].append(("assistant", answers.pop(spec.request_id, "")))
            else:
                going[c] = False
        records += done
    return records


def per_turn_summary(
    records: Sequence[RequestRecord],
    rounds: Sequence[tuple[int, CounterSnapshot | None, CounterSnapshot | None]],
) -> list[dict[str, Any]]:
    """One row per turn of a multi-turn run: requests, mean prompt tokens, TTFT statistics (vLLM names,
    ms) of its successful requests, and the server's prefix-cache counters over its round
    (`rounds`: (turn, counters before the round, after it); None where they could not be read)."""
    out: list[dict[str, Any]] = []
    for turn, before, after in rounds:
        mine = [r for r in records if r.turn == turn]
        ok = [r for r in mine if r.ok]
        prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        ttft = [m.ttft_ms for m in (r.metrics() for r in ok) if m.ttft_ms is not None]
        row: dict[str, Any] = {
            "turn": turn,
            "requests": len(mine),
            "completed": len(ok),
            "mean_prompt_tokens": sum(prompts) / len(prompts) if prompts else None,
        }
        row |= stats_with_vllm_names("ttft", ttft)
        if before is not None and after is not None:
            p, o = sum(prompts), sum(r.output_tokens for r in ok)
            delta = counter_delta(before, after, client_prompt_tokens=p, client_output_tokens=o)
            for key in ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate"):
                row[key] = delta[key]
        out.append(row)
    return out
