"""A small serving engine in NumPy: vLLM v1's design (scheduler, paged KV cache, model runner) at nano-vllm's size."""
