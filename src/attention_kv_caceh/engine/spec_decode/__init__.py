"""Speculative decoding with n-gram drafts, as vLLM v1 does it (`vllm/v1/spec_decode/`, `vllm/v1/sample/
rejection_sampler.py`, `vllm/config/speculative.py`).

- `config`: SpeculativeConfig, the `--speculative-config` JSON with vLLM's defaults and errors, and the
  draft schedule that stops proposing where a step is compute-bound.
- `ngram_proposer`: the draft tokens, from the longest recurring suffix of a request's own tokens.
- `rejection_sampler`: which draft tokens the model keeps, and the token after them.
- `metrics`: SpecDecodingStats, vLLM's draft and acceptance counts.

The scheduler schedules drafts (`Request.spec_token_ids`) in the token budget, the model runner computes
logits at each request's last token and every draft in the same flattened batch, and the engine core
verifies, rolls back the rejected positions and proposes the next drafts (scheduler.py, model_runner.py,
core.py).

Left out: the draft-model, EAGLE / EAGLE-3, MTP, Medusa and suffix-decoding proposers, tree attention, and a
Triton rejection sampler over the whole batch.
"""
