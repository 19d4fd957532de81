"""Serving harness: streamed requests through a backend, per-request timestamps, latency metrics.

The load generator (`load.py`) sends requests through a backend (`backends.py`: a simulated server or an
OpenAI-compatible HTTP endpoint parsed by the one SSE parser and token decoder in `sse.py`, its
connection failures named by `client_errors.py`); `prompts.py` makes prompts of an exact token length
(a local tokenizer.json or the server's /tokenize) or reads a dataset; every request becomes a
`RequestRecord` (`records.py`) written as it finishes; `metrics.py` defines TTFT, ITL, TPOT, E2EL and
client lateness once; `summary.py` aggregates them with `timing.summarize_samples`;
`server_metrics.py` polls the server's gauges from a thread of its own; `config.py` validates a run's
settings, `planning.py` plans what it sends and `run.py` ties it together (`run_summary.py` its
summary). `trace.py` and `prefix_ideal.py` replay a trace and give its ideal prefix-hit rate,
`probes.py` sends probes beside a load, `repeats.py` puts confidence intervals on repeated runs,
`workers.py` splits a load over client processes and `client_cpu.py` measures the client's own CPU.
Nothing here prints: `cli/harness.py` and `cli/overhead.py` do.
"""
