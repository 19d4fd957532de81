"""What a run sends: the planned requests (warm-up, measured, arrival offsets) and their exact prompts.

`plan_requests` draws every measured spec and arrival from `--seed` (or reads them from `--dataset` or
`--trace`); `exact_specs` makes the prompts exact with the target's tokenizer (a local tokenizer.json, else
the server's `/tokenize`) and `prompt_lengths` says afterwards whether they were.
"""

from __future__ import annotations

from dataclasses import replace

import aiohttp
import numpy as np

from attention_kv_caceh.harness.backends import RequestSpec
from attention_kv_caceh.harness.config import HarnessConfig
from attention_kv_caceh.harness.copy_workload import copy_specs
from attention_kv_caceh.harness.dataset import read_dataset
from attention_kv_caceh.harness.load import SmokeTestError, arrival_offsets_s, make_request_specs
from attention_kv_caceh.harness.prompts import (
    LocalTokenizer,
    PromptTokenizer,
    ServerTokenizer,
    exact_prompts,
    local_tokenizer,
    probe_server_tokenizer,
)
from attention_kv_caceh.harness.records import RequestRecord
from attention_kv_caceh.harness.trace import read_trace, trace_offsets_s, trace_specs, trace_text
from attention_kv_caceh.harness.workloads import shared_prefix_specs

__all__ = ["exact_specs", "plan_requests", "prompt_lengths"]


def plan_requests(config: HarnessConfig) -> tuple[list[RequestSpec], list[RequestSpec], list[float]]:
    """(warm-up specs, measured specs, arrival offsets in s) of `config`.

    The measured specs and arrivals come from `seed` alone; warm-ups draw from their own stream
    (`default_rng([seed, 1])`), so adding warm-ups never changes the measured prompts. With a
    `dataset`, the measured prompts are its first `num_requests` entries (their `output_len`, else the
    drawn one; the requested prompt length is the word count until a tokenizer counts it). A
    shared-prefix workload's specs are `workloads.shared_prefix_specs`; a multi-turn workload's measured
    requests are planned by `workloads.plan_conversations` instead (these specs are unused). A trace's
    are its first `num_requests` rows (`trace.trace_specs`) at their timestamps (`trace.trace_offsets_s`).
    Raises ValueError for a dataset or trace that cannot be read or has fewer entries than
    `num_requests`.
    """
    rng = np.random.default_rng(config.seed)
    if config.trace is not None:
        rows = read_trace(config.trace)[: config.num_requests]
        specs = trace_specs(rows, config.trace.tokens_per_hash)
    elif config.workload.kind == "shared-prefix":
        specs = shared_prefix_specs(
            config.workload, config.num_requests, config.prompt_len, config.output_len, rng, config.seed
        )
    elif config.workload.kind == "copy":
        specs = copy_specs(config.num_requests, config.prompt_len, config.output_len, rng, config.seed)
    else:
        specs = make_request_specs(config.num_requests, config.prompt_len, config.output_len, rng)
    if config.dataset is not None and config.workload.kind == "random":
        specs = _dataset_specs(config, specs)
    offsets = arrival_offsets_s(config.num_requests, config.request_rate, config.burstiness, rng)
    if config.trace is not None:
        offsets = trace_offsets_s(read_trace(config.trace)[: config.num_requests], config.trace)
    warm_rng = np.random.default_rng([config.seed, 1])
    warm_specs = make_request_specs(
        config.warmup_requests, config.prompt_len, config.output_len, warm_rng, first_id=-1 - 10**6
    )
    return warm_specs, specs, offsets


def _dataset_specs(config: HarnessConfig, drawn: list[RequestSpec]) -> list[RequestSpec]:
    assert config.dataset is not None
    entries = read_dataset(config.dataset)
    if len(entries) < config.num_requests:
        raise ValueError(
            f"--dataset {config.dataset!r} has {len(entries)} entries, fewer than --num-requests "
            f"{config.num_requests}"
        )
    return [
        RequestSpec(
            spec.request_id,
            max(1, len(prompt.split())),
            output_len if output_len is not None else spec.output_tokens,
            prompt,
            from_dataset=True,
        )
        for spec, (prompt, output_len) in zip(drawn, entries, strict=False)
    ]


async def exact_specs(
    config: HarnessConfig, session: aiohttp.ClientSession | None, model: str | None, *specs: list[RequestSpec]
) -> tuple[PromptTokenizer | None, list[list[RequestSpec]]]:
    """The tokenizer used (local --tokenizer, else the server's /tokenize, else None) and `specs`
    with exact prompts (unchanged without a tokenizer or with the simulated backend; a trace's prompts
    then as words, `trace.trace_text`). Raises ValueError for an unreadable --tokenizer,
    SmokeTestError when tokenizing fails mid-way."""
    tokenizer: PromptTokenizer | None = None
    if config.backend == "simulated":
        return None, list(specs)
    if config.tokenizer is not None:
        tokenizer = local_tokenizer(config.tokenizer)
    elif session is not None and model is not None:
        chat = config.backend == "openai-chat"
        server = ServerTokenizer(session, config.base_url, model, config.timeout_s, chat=chat)
        tokenizer = server if await probe_server_tokenizer(server) else None
    if tokenizer is None:
        return None, [[replace(s, prompt=trace_text(s)) if s.hash_ids else s for s in g] for g in specs]
    ids = config.backend == "openai-completions"
    try:
        groups = [await exact_prompts(group, tokenizer, token_ids=ids) for group in specs]
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise SmokeTestError(
            f"building prompts of exact length with {tokenizer.name} failed: {type(exc).__name__}: {exc}"
        ) from None
    if _without_template(config, tokenizer):
        # the local count leaves out the chat template: never record it as the length the server saw
        groups = [[replace(spec, prompt_tokens_checked=None) for spec in group] for group in groups]
    return tokenizer, groups


def _without_template(config: HarnessConfig, tokenizer: PromptTokenizer | None) -> bool:
    """True when chat prompts were counted by a local tokenizer.json, which has no chat template."""
    return config.backend == "openai-chat" and isinstance(tokenizer, LocalTokenizer)


def prompt_lengths(
    config: HarnessConfig,
    tokenizer: PromptTokenizer | None,
    records: list[RequestRecord],
    off_pct: float | None,
) -> tuple[str, str | None]:
    """("exact" or "approximate", the warning saying why when approximate) for a run against a server.

    Exact: prompts built with the server's /tokenize, or with a local tokenizer for `/v1/completions`;
    chat prompts built with a local tokenizer only where the server's usage reported, for every
    successful request, exactly the requested length (the template's tokens are not in the local count).
    In every case a server count that differs from the requested length makes them approximate (a chat
    template with more tokens than --prompt-len, a server tokenizing otherwise than the local one).
    """
    measured = (
        f"the server counted {off_pct:+.1f} % against the requested tokens"
        if off_pct is not None
        else "the server reported no prompt token counts"
    )
    if tokenizer is None:
        return "approximate", (
            f"prompt lengths are approximate (no --tokenizer and no POST /tokenize on the server): {measured}"
        )
    if _without_template(config, tokenizer):
        ok = [r for r in records if r.ok]
        if ok and all(r.prompt_tokens == r.requested_prompt_tokens for r in ok):
            return "exact", None  # the server's own counts confirm every prompt
        return "approximate", (
            f"prompt lengths are approximate: --tokenizer {tokenizer.name} has no chat template, and the "
            f"server counts the template's tokens of /v1/chat/completions too: {measured}"
        )
    ok = [
        r for r in records if r.ok and r.prompt_tokens is not None and r.requested_prompt_tokens is not None
    ]
    off = [r for r in ok if r.prompt_tokens != r.requested_prompt_tokens]
    if off:  # the server's own counts are the judge: e.g. a chat template longer than --prompt-len
        return "approximate", (
            f"prompt lengths are approximate: {len(off)} of {len(ok)} requests' server-counted prompt tokens "
            f"differ from the requested length (first: {off[0].prompt_tokens} for {off[0].requested_prompt_tokens}"
            f" requested): {measured}"
        )
    return "exact", None
