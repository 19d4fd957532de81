"""The engine's benchmarks, outside the engine as vLLM keeps its own in `vllm/benchmarks/`.

- `engine`: `run_engine_benchmark`, vLLM's offline throughput benchmark (random prompts, ignore_eos,
  every request at once) plus each decode step's bytes and FLOPs against the same run's read and FMA
  probes (`probes`).
- `spec_decode`: `run_spec_benchmark`, the same requests with and without n-gram drafts.

Nothing here prints: each returns rows, which `bench-engine` formats (`report/engine_bench.py`).
"""
