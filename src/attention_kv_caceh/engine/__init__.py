"""A small serving engine: vLLM v1's design (scheduler, paged KV blocks, prefix caching) at nano-vllm's size.

Modules, each named after the vLLM v1 file it corresponds to:

- `config`: EngineConfig (max_num_seqs, max_num_batched_tokens, block_size, KV cache size).
- `request`: Request, SamplingParams, RequestStatus and the stop checks.
- `block_pool` / `kv_cache_manager`: block ids, reference counts, the free queue and prefix caching.
- `scheduler`: the token-budget loop with chunked prefill and preemption by recompute.
- `sampler`: greedy, temperature, top-k and top-p sampling with per-request seeded generators.
- `llm_engine`: LLMEngine.step(): schedule -> execute_model -> sample -> update_from_output -> outputs.
- `benchmark`: run_engine_benchmark, vLLM's throughput benchmark plus each decode step's bytes against
  the lab's read probe.

The model side (model, layers, paged_attention, checkpoint loading, tokenizer, model_runner with the paged K/V buffers) lives in
its own modules; the engine talks to it only through `SchedulerOutput` and logits. The server side
(`async_llm`: the engine loop in a thread; `output_processor`: per-request state and streams; `stats` /
`metrics`: vLLM's Prometheus metrics; `server`, `serving`, `protocol`, `chat_utils`: the
OpenAI-compatible HTTP API) drives an LLMEngine from asyncio.
"""
