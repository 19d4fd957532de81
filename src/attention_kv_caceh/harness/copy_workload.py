"""The copy-heavy workload: "repeat this passage with one change", where n-gram drafts should pay.

Each prompt holds a passage of `sentences` plain English sentences (drawn with a seeded generator from a
fixed bank, so a run repeats) and asks for it back with one word changed:

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

import numpy as np

__all__ = ["COPY_SENTENCES", "copy_prompt", "copy_prompts"]

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


def copy_prompt(rng: np.random.Generator, sentences: int = 6) -> str:
    """One copy prompt of `sentences` sentences drawn from COPY_SENTENCES (module docstring); the change
    names a word of the passage when one of the listed words occurs in it. Raises ValueError for
    sentences < 1."""
    if sentences < 1:
        raise ValueError(f"sentences must be >= 1, got {sentences}")
    picks = rng.choice(len(COPY_SENTENCES), size=min(sentences, len(COPY_SENTENCES)), replace=False)
    passage = " ".join(COPY_SENTENCES[int(i)] for i in picks)
    present = [(old, new) for old, new in _CHANGES if f" {old} " in f" {passage} "]
    old, new = present[int(rng.integers(len(present)))] if present else _CHANGES[0]
    return (
        f'Repeat the passage below word for word, but write "{new}" instead of "{old}".\n\n'
        f"Passage:\n{passage}\n\nRepeated passage:\n"
    )


def copy_prompts(num_prompts: int, seed: int, sentences: int = 6) -> list[str]:
    """`num_prompts` copy prompts from `np.random.default_rng([seed, 3])` (independent of other draws
    seeded with `seed`)."""
    rng = np.random.default_rng([seed, 3])
    return [copy_prompt(rng, sentences) for _ in range(num_prompts)]
