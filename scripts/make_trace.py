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
import random
from pathlib import Path


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--block-size", type=int, default=16, help="tokens per hash id")
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--system-prompts", type=int, default=3)
    p.add_argument("--system-blocks", type=int, default=8)
    p.add_argument("--turn-blocks", type=int, default=2)
    p.add_argument("--unique-blocks", type=int, default=2)
    p.add_argument("--max-blocks", type=int, default=40, help="a conversation restarts past this")
    p.add_argument("--min-output", type=int, default=4)
    p.add_argument("--max-output", type=int, default=16)
    p.add_argument("--rate", type=float, default=20.0, help="requests/s (Poisson)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rows = make_trace(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
