"""Serving harness: streamed requests through a backend, per-request timestamps, latency metrics.

The load generator (`load.py`) sends requests through a backend (`backends.py`: a simulated server or an
OpenAI-compatible HTTP endpoint parsed by the one SSE parser in `sse.py`); every request becomes a
`RequestRecord` (`records.py`) written as it finishes; `metrics.py` defines TTFT, ITL, TPOT, E2EL once;
`summary.py` aggregates them with `timing.summarize_samples`; `run.py` ties it together. Nothing here
prints: `cli/harness.py` and `cli/overhead.py` do.
"""
