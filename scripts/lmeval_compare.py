"""Compare lm-evaluation-harness's log-likelihoods with the engine's own float64 log-probabilities, or
two lm-evaluation-harness runs of the same task with each other.

    uv run python scripts/lmeval_compare.py CHECKPOINT SAMPLES_JSONL
    uv run python scripts/lmeval_compare.py --versus REFERENCE_SAMPLES_JSONL SAMPLES_JSONL

The second form reads two `samples_<task>_*.jsonl` files of the same task (say `lm_eval --model hf` on
transformers and `lm_eval --model local-completions` against `serve`), prints every continuation's
log-likelihood from both side by side, each run's accuracy and the largest difference, and exits 1
unless the accuracies are equal and every difference is below --tolerance (default 1e-3).

SAMPLES_JSONL is the `samples_<task>_*.jsonl` file `lm_eval --log_samples` wrote. For every (context,
continuation) pair it tokenizes as lm-evaluation-harness's `_encode_pair` does (the context's trailing
spaces move to the continuation; no special tokens; the continuation's ids are those of the whole text
after the context's), runs the engine in float64 with prompt logprobs on the whole text, sums the
continuation tokens' logprobs and prints them beside lm-eval's, with the largest difference last.
"""

from __future__ import annotations

import json
import sys

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.tokenizer import Tokenizer


def main(checkpoint: str, samples_path: str) -> int:
    engine = LLMEngine.from_pretrained(checkpoint, EngineConfig(dtype="float64", num_kv_blocks=256))
    tokenizer = Tokenizer.load(checkpoint)
    worst = 0.0
    count = 0
    with open(samples_path, encoding="utf-8") as f:
        for line in f:
            sample = json.loads(line)
            args = sample["arguments"]  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
            pairs = [args[f"gen_args_{i}"] for i in range(len(args))]
            for arg, resp in zip(pairs, sample["resps"], strict=True):
                context, continuation = arg["arg_0"], arg["arg_1"]
                spaces = len(context) - len(context.rstrip())
                if spaces:
                    context, continuation = context[:-spaces], context[-spaces:] + continuation
                whole = tokenizer.encode(context + continuation, add_special_tokens=False)
                n_context = len(tokenizer.encode(context, add_special_tokens=False))
                rid = f"q{sample['doc_id']}-{count}"
                engine.add_request(rid, whole, SamplingParams(max_tokens=1, prompt_logprobs=0))
                prompt_logprobs = None
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.request_id == rid and out.prompt_logprobs is not None:
                            prompt_logprobs = out.prompt_logprobs
                assert prompt_logprobs is not None
                # entry j - 1 scores token j of the whole text
                ours = sum(e.logprob for e in prompt_logprobs[n_context - 1 :])
                theirs = float(resp[0][0])
                worst = max(worst, abs(ours - theirs))
                count += 1
                print(
                    f"doc {sample['doc_id']} {continuation!r:40} lm-eval {theirs:.6f} engine float64 {ours:.6f}"
                )
    print(f"{count} continuations; largest |difference| = {worst:.2e}")
    return 0 if worst < 1e-4 else 1


def _samples(path: str) -> dict[int, dict[str, object]]:
    with open(path, encoding="utf-8") as f:
        return {int(sample["doc_id"]): sample for sample in map(json.loads, filter(str.strip, f))}


def versus(reference_path: str, samples_path: str, tolerance: float = 1e-3) -> int:
    """Both runs' log-likelihoods per (document, choice), their accuracies and the largest difference."""
    reference, samples = _samples(reference_path), _samples(samples_path)
    if sorted(reference) != sorted(samples):
        print(f"the two files hold different documents: {sorted(reference)} and {sorted(samples)}")
        return 1
    worst = 0.0
    correct = [0, 0]
    for doc in sorted(reference):
        a, b = reference[doc], samples[doc]
        for i, (ra, rb) in enumerate(zip(a["resps"], b["resps"], strict=True)):  # type: ignore[arg-type]
            la, lb = float(ra[0][0]), float(rb[0][0])
            worst = max(worst, abs(la - lb))
            choice = a["arguments"][f"gen_args_{i}"]["arg_1"]  # type: ignore[index]
            print(f"doc {doc:>3} {choice!r:28} reference {la:12.6f}  other {lb:12.6f}  diff {lb - la:+.2e}")
        correct[0] += int(float(a["acc"]) == 1.0)  # type: ignore[arg-type]
        correct[1] += int(float(b["acc"]) == 1.0)  # type: ignore[arg-type]
    n = len(reference)
    print(
        f"accuracy: reference {correct[0]}/{n}, other {correct[1]}/{n}; "
        f"largest |log-likelihood difference| = {worst:.2e} (tolerance {tolerance:g})"
    )
    return 0 if correct[0] == correct[1] and worst < tolerance else 1


if __name__ == "__main__":
    if sys.argv[1] == "--versus":
        raise SystemExit(versus(sys.argv[2], sys.argv[3], *(float(t) for t in sys.argv[4:5])))
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
