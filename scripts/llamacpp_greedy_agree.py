"""llama.cpp's greedy tokens on the prompts of engine runs, against a reference run (e.g. transformers').

Reads `generate --output` JSONL files (as `scripts/hf_reference.py agree-gguf` writes them: one line per
prompt with `prompt_token_ids` and `token_ids`), starts llama.cpp's `llama-server` on the GGUF file (one
thread, 127.0.0.1, stopped at the end), asks it for the same number of greedy tokens on the same prompt
ids (`/completion`, top_k 1, no prompt cache), and prints for llama.cpp and each other run how many
prompts give the reference's tokens and where each first differs (None: equal).

    python scripts/llamacpp_greedy_agree.py --llama-server /path/to/llama-server --gguf smollm2-Q4_K_M.gguf \
        --reference /tmp/hf-q4km/engine-2.jsonl --runs int8=/tmp/hf-q4km/engine-4.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ over their common length, or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--reference", required=True, help="JSONL of the reference run")
    parser.add_argument("--runs", nargs="*", default=[], help="NAME=JSONL of other runs to compare")
    parser.add_argument("--port", type=int, default=8391)
    args = parser.parse_args()

    def load(path: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

    reference = load(args.reference)
    runs = {name: [r["token_ids"] for r in load(path)] for name, path in (s.split("=", 1) for s in args.runs)}
    server = subprocess.Popen(
        [args.llama_server, "--model", args.gguf, "--host", "127.0.0.1", "--port", str(args.port),
         "--threads", "1", "--ctx-size", "2048", "--parallel", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        tokens = []
        for row in reference:
            body = {"prompt": row["prompt_token_ids"], "n_predict": len(row["token_ids"]), "temperature": 0,
                    "top_k": 1, "samplers": ["top_k"], "return_tokens": True, "cache_prompt": False}  # fmt: skip
            request = urllib.request.Request(
                f"{base}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=300) as response:
                tokens.append(json.load(response)["tokens"])
        runs["llama.cpp"] = tokens
    finally:
        os.killpg(server.pid, signal.SIGTERM)
    for name, rows in runs.items():
        firsts = [first_difference(r["token_ids"], t) for r, t in zip(reference, rows, strict=True)]
        equal = sum(f is None for f in firsts)
        print(
            f"{name}: {equal} of {len(reference)} prompts give the reference's tokens; first differences {firsts}"
        )


if __name__ == "__main__":
    main()
