"""attention-kv-caceh: attention over a KV cache, batching and serving latency, measured."""
