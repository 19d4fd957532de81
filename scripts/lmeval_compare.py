"""Compare lm-evaluation-harness's log-likelihoods with the engine's own float64 log-probabilities.

    uv run python scripts/lmeval_compare.py CHECKPOINT SAMPLES_JSONL

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


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
