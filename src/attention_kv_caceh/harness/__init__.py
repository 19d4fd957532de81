"""Serving harness: streamed requests through a backend, per-request timestamps, latency metrics.

The load generator (`load.py`) sends requests through a backend (`backends.py`: a simulated server or an
OpenAI-compatible HTTP endpoint parsed by the one SSE parser and token decoder in `sse.py`, its
connection failures named by `client_errors.py`); `prompts.py` makes prompts of an exact token length
(a local tokenizer.json or the server's /tokenize) or reads a dataset; every request becomes a
`RequestRecord` (`records.py`) written as it finishes; `metrics.py` defines TTFT, ITL, TPOT, E2EL and
client lateness once; `summary.py` aggregates them with `timing.summarize_samples`;
`server_metrics.py` polls the server's gauges from a thread of its own; `config.py` validates a run's
settings and `run.py` ties it together. Nothing here prints: `cli/harness.py` and `cli/overhead.py` do.
"""
