"""Write a synthetic Mooncake-style trace: JSONL rows of timestamp (ms), input_length, output_length and
hash_ids, with the prefix reuse such traces have.

What and why: `harness --trace` replays Mooncake's and vLLM's `timed_trace` JSONL. Real traces are large
and not in the repository; this script writes a small one with the same shape, seeded. Each request
belongs to one of `--sessions` conversations; each conversation opens with one of `--system-prompts`
shared system prompts (`--system-blocks` blocks), and each later turn of a conversation sends the
previous turn's prompt again, plus `--turn-blocks` new blocks. Every request also has `--unique-blocks`
blocks of its own. Hash ids are given as Mooncake gives them: one id per distinct block *prefix* (a trie
of blocks), so an id stands for the block and every block before it. Arrivals are Poisson at `--rate`
requests/s. The last block of a prompt is cut at random (input_length is not a multiple of the block).

    uv run python scripts/make_trace.py --out examples/mooncake-trace.jsonl

writes the repository's example (its defaults). A development tool, not part of the package.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from pathlib import Path

from attention_kv_caceh.files import atomic_write_text


def make_trace(args: argparse.Namespace) -> list[dict[str, object]]:
    rng = random.Random(args.seed)
    trie: dict[tuple[int, str], int] = {}  # (parent id, block name) -> hash id

    def ids_of(blocks: list[str]) -> list[int]:
        out: list[int] = []
        parent = -1
        for name in blocks:
            parent = trie.setdefault((parent, name), len(trie))
            out.append(parent)
        return out

    sessions: list[list[str]] = []  # each conversation's prompt blocks so far
    rows: list[dict[str, object]] = []
    t_ms = 0.0
    for i in range(args.rows):
        s = rng.randrange(args.sessions)
        while len(sessions) <= s:
            system = rng.randrange(args.system_prompts)
            sessions.append([f"sys{system}-{k}" for k in range(args.system_blocks)])
        history = sessions[s]
        history += [f"s{s}-t{len(history)}-{k}" for k in range(args.turn_blocks)]
        if len(history) + args.unique_blocks > args.max_blocks:  # the conversation ends; a new one starts
            system = rng.randrange(args.system_prompts)
            history[:] = [f"sys{system}-{k}" for k in range(args.system_blocks)]
            history += [f"s{s}-r{i}-{k}" for k in range(args.turn_blocks)]
        blocks = history + [f"u{i}-{k}" for k in range(args.unique_blocks)]
        length = len(blocks) * args.block_size - rng.randrange(args.block_size)
        rows.append(
            {
                "timestamp": round(t_ms),
                "input_length": length,
                "output_length": rng.randint(args.min_output, args.max_output),
                "hash_ids": ids_of(blocks),
            }
        )
        t_ms += rng.expovariate(args.rate) * 1000
    return rows


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    positive, count = _int_at_least(1), _int_at_least(0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", type=positive, default=200)
    p.add_argument("--block-size", type=positive, default=16, help="tokens per hash id")
    p.add_argument("--sessions", type=positive, default=24)
    p.add_argument("--system-prompts", type=positive, default=3)
    p.add_argument("--system-blocks", type=count, default=8)
    p.add_argument("--turn-blocks", type=count, default=2)
    p.add_argument("--unique-blocks", type=count, default=2)
    p.add_argument(
        "--max-blocks",
        type=positive,
        default=40,
        help="a conversation restarts past this; no prompt has more blocks",
    )
    p.add_argument("--min-output", type=positive, default=4)
    p.add_argument("--max-output", type=positive, default=16)
    p.add_argument("--rate", type=_positive_float, default=20.0, help="requests/s (Poisson)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.min_output > args.max_output:
        p.error(f"--min-output {args.min_output} is above --max-output {args.max_output}")
    fewest = args.system_blocks + args.turn_blocks + args.unique_blocks  # a new conversation's first prompt
    if fewest < 1:
        p.error("--system-blocks, --turn-blocks and --unique-blocks are all 0: a prompt needs a block")
    if args.max_blocks < fewest:
        p.error(
            f"--max-blocks {args.max_blocks}: a conversation's first prompt already has {fewest} blocks "
            "(--system-blocks + --turn-blocks + --unique-blocks)"
        )
    rows = make_trace(args)
    try:
        atomic_write_text(args.out, "".join(json.dumps(row) + "\n" for row in rows))
    except OSError as exc:
        p.error(f"--out {args.out}: {exc.strerror or exc}")
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
