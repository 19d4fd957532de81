"""The copy-heavy workload: "repeat this passage with one change", where n-gram drafts should pay.

Each prompt holds a passage of plain English sentences, drawn without repetition from a fixed bank with
a seeded generator until it has at least the asked number of words (so a run repeats), and asks for it
back with one word changed:

    Repeat the passage below word for word, but write "<new>" instead of "<old>".

    Passage:
    <passage>

    Repeated passage:

A model that follows it writes the passage again, so after its first few tokens every n-gram of its
output has occurred in the prompt and the proposer's drafts are the right tokens, except around the
changed word. That is the case speculative decoding with prompt lookup was made for (summaries,
edits of code given in the prompt, retrieval answers quoting their sources); the `random` workload,
whose prompts are random words and whose answers copy nothing, is the case where it cannot pay.
The form ends in a plain completion cue, so the completions endpoint and the chat endpoint (as the
one user message) ask the same thing.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from attention_kv_caceh.harness.backends import RequestSpec
from attention_kv_caceh.harness.load import LengthRange, make_request_specs

__all__ = ["COPY_SENTENCES", "copy_prompt", "copy_prompts", "copy_specs"]

COPY_SENTENCES = (
    "The cache keeps the keys and values of every token the model has already read.",
    "Each new token looks back at all of them once, so a longer context costs more to decode.",
    "A block of sixteen positions is the unit the scheduler hands out and takes back.",
    "When the pool runs out of blocks, the newest request is sent back to wait.",
    "Two requests that start with the same words can share the blocks of that prefix.",
    "The scheduler gives every step one budget of tokens for prompts and answers together.",
    "A long prompt is cut into chunks so that short requests keep getting their turns.",
    "Reading the weights from memory sets the pace of a step with one request in it.",
    "With more requests in the batch the same weights serve more tokens per read.",
    "Past a certain batch size the arithmetic, not the memory, decides how long a step takes.",
    "The server streams each token to its client as soon as the step that made it ends.",
    "Time to first token counts the wait in the queue and the whole prefill of the prompt.",
    "The time between tokens is one step, plus whatever else the engine did in it.",
    "A client that measures latency must not become the slowest part of the test.",
    "The small model guesses a few tokens and the large model checks them all at once.",
    "When the guess is right, one step yields several tokens instead of one.",
    "When it is wrong, the step still yields the one token it would have made anyway.",
    "Old notes on the shelf say the same thing in fewer words than the new ones.",
    "The river runs past the mill, under the bridge and out into the quiet harbour.",
    "On Tuesday the baker sold every loaf before the church bell rang at noon.",
    "The garden behind the station has three apple trees and a bench painted green.",
    "She wrote the address on the envelope, checked it twice and walked to the post office.",
    "A lamp in the window meant that someone was still awake and reading.",
    "The map showed a road along the coast that nobody in the village had ever taken.",
)

_CHANGES = (
    ("cache", "store"), ("tokens", "words"), ("blocks", "pages"), ("model", "network"), ("step", "round"),
    ("request", "query"), ("river", "stream"), ("baker", "grocer"), ("garden", "yard"), ("road", "path"),
)  # fmt: skip


def copy_prompt(rng: np.random.Generator, passage_words: int = 100) -> str:
    """One copy prompt (module docstring) whose passage has at least `passage_words` words (or the whole
    bank, about 400 words) and one of the words the change may name. Raises ValueError for
    passage_words < 1."""
    if passage_words < 1:
        raise ValueError(f"passage_words must be >= 1, got {passage_words}")
    order = rng.permutation(len(COPY_SENTENCES))
    picked: list[str] = []
    present: list[tuple[str, str]] = []
    for i in order:  # sentences until the passage is long enough and holds a word to change
        picked.append(COPY_SENTENCES[int(i)])
        present = [(old, new) for old, new in _CHANGES if f" {old} " in f" {' '.join(picked)} "]
        if present and sum(len(p.split()) for p in picked) >= passage_words:
            break
    passage = " ".join(picked)
    old, new = present[int(rng.integers(len(present)))]
    return (
        f'Repeat the passage below word for word, but write "{new}" instead of "{old}".\n\n'
        f"Passage:\n{passage}\n\nRepeated passage:\n"
    )


def copy_prompts(num_prompts: int, seed: int, passage_words: int = 100) -> list[str]:
    """`num_prompts` copy prompts from `np.random.default_rng([seed, 3])` (independent of the other
    draws seeded with `seed`)."""
    rng = np.random.default_rng([seed, 3])
    return [copy_prompt(rng, passage_words) for _ in range(num_prompts)]


def copy_specs(
    num_requests: int, prompt_len: LengthRange, output_len: LengthRange, rng: np.random.Generator, seed: int
) -> list[RequestSpec]:
    """The harness's `--workload copy` specs: output lengths drawn from `output_len` as for `random`,
    prompts `copy_prompt`s whose passages have at least the `prompt_len` drawn for them in words. The
    text is sent as it is (`from_dataset`): its token count is the server's."""
    drawn = make_request_specs(num_requests, prompt_len, output_len, rng)
    copy_rng = np.random.default_rng([seed, 3])
    out: list[RequestSpec] = []
    for spec in drawn:
        text = copy_prompt(copy_rng, spec.prompt_tokens)
        out.append(replace(spec, prompt=text, prompt_tokens=len(text.split()), from_dataset=True))
    return out
