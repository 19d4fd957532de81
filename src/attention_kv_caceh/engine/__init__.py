"""A small serving engine core: vLLM v1's design (scheduler, paged KV blocks, prefix caching), in NumPy.

Modules, most named after the vLLM v1 file they correspond to:

- `config`: EngineConfig (max_num_seqs, max_num_batched_tokens, block_size, KV cache size).
- `request`: Request, SamplingParams, RequestStatus and the stop checks.
- `block_pool` / `kv_cache_manager`: block ids, reference counts, the free queue and prefix caching.
- `scheduler`: the token-budget loop with chunked prefill and preemption by recompute.
- `sampler`: greedy, temperature, top-k and top-p sampling, the penalties, logit bias and min_tokens, and
  logprobs, with per-request seeded generators.
- `core`: EngineCore.step(): schedule -> execute_model -> sample -> update_from_output -> outputs;
  EngineCoreProc: its busy loop behind ZMQ sockets, with input and output IO threads.
- `core_client`: InprocClient (the core in the caller's thread) and MPClient (the core in its own process,
  or a thread, behind pyzmq + msgspec).
- `llm_engine`: LLMEngine, the offline front end: an InprocClient and the OutputProcessor.
- `spec_decode/`: speculative decoding as vLLM v1 does it for `ngram`: SpeculativeConfig, the n-gram
  proposer, draft verification (the rejection sampler) and the acceptance counts.

The model side (model, layers, paged_attention, warm-up, checkpoint loading) is `attention_kv_caceh.model_executor`,
which imports nothing of engine/; `model_runner` (with the paged K/V buffers) drives it from here, and the
engine talks to it only through `SchedulerOutput` and logits. The server side runs
in the API process (`async_llm`: AsyncLLM, an MPClient to the engine-core process plus an output thread;
`parallel_sampling`: a request of `n` samples as `n` child requests;
`output_processor`: one incremental detokenizer per request, stop strings, per-request timestamps and
streams; `stats` / `metrics`: vLLM's Prometheus metrics). The OpenAI-compatible HTTP API over AsyncLLM is
not here: it is `attention_kv_caceh.entrypoints`, as vLLM's is `vllm/entrypoints/openai/`. The tools
around the engine live outside it too: `benchmarks/` (the throughput and speculative-decoding
benchmarks) and `toy_model/` (random test checkpoints).

Left out, against vLLM v1 as a whole: GPU workers and tensor, pipeline, data and expert parallelism; CUDA
graphs and torch.compile; quantization other than GGUF's block types (the IQ family too); LoRA, multimodal inputs,
pooling models and structured outputs; KV connectors (disaggregated prefill, KV offloading); sliding-window
and hybrid attention; speculative methods other than `ngram`.
"""
