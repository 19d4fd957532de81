"""Prometheus metrics of the server, with vLLM's names, label `model_name` and bucket boundaries.

Corresponds to vLLM v1's `vllm/v1/metrics/loggers.py` (PrometheusStatLogger), and sits in engine/ as that file
sits in `vllm/v1/`: it is a stat logger, fed IterationStats by AsyncLLM's output thread
(`AsyncLLM.add_stat_logger`), and imports nothing of HTTP; the server only exposes its text at
`GET /metrics` (entrypoints/openai/api_server.py), as vLLM's api_server mounts its registry. Each app gets its own
CollectorRegistry (never the process-global one), so several servers in one process (the tests) do not
collide. Counters are declared without the `_total` suffix, as vLLM declares them: prometheus_client adds
`_total` to the exposed sample (`vllm:prompt_tokens_total`) and a `_created` sample beside it.

The request gauges (`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`)
are read from AsyncLLM at the moment of the scrape (`Gauge.set_function`): running and KV usage as the
engine core last reported them (it reports when a step admits or ends a request, before the model runs),
waiting as every unfinished request that is not running, so a scrape between steps sees requests that
have just arrived.

With speculative decoding on (`num_speculative_tokens` > 0), vLLM's spec-decode counters too
(`vllm/v1/spec_decode/metrics.py`, SpecDecodingProm): `vllm:spec_decode_num_drafts`,
`vllm:spec_decode_num_draft_tokens`, `vllm:spec_decode_num_accepted_tokens` and
`vllm:spec_decode_num_accepted_tokens_per_pos` with a `position` label 0 .. K - 1 (definitions in
`spec_decode/metrics.py`); they exist from startup, at 0, so a client can diff them around a run.

Left out: vLLM's LoggingStatLogger (the periodic log line), the per-request phase histograms
(`vllm:request_prefill_time_seconds`, `_decode_time_seconds`, `_inference_time_seconds`,
`vllm:request_time_per_output_token_seconds`), the per-request token and parameter histograms
(`vllm:request_prompt_tokens`, `vllm:request_generation_tokens`, `vllm:request_params_n`,
`vllm:request_params_max_tokens`), the LoRA info gauge, KV-connector and external prefix-cache counters, and
the `engine` label of data-parallel engines.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from attention_kv_caceh.engine.stats import IterationStats

__all__ = [
    "E2E_BUCKETS",
    "ITERATION_TOKENS_BUCKETS",
    "ITL_BUCKETS",
    "METRIC_NAMES",
    "SPEC_DECODE_METRIC_NAMES",
    "TTFT_BUCKETS",
    "ServerMetrics",
]

# Bucket boundaries as vLLM v1's PrometheusStatLogger sets them (seconds, or tokens per step).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# The metric family names as a scrape shows them (counters with their `_total` sample).
METRIC_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:iteration_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)

# The spec-decode families (counters, exposed with `_total`), present with speculative decoding on.
SPEC_DECODE_METRIC_NAMES = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
)

_FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    """The server's metrics in their own registry; `record` is an AsyncLLM stat logger (thread-safe).

    `running`, `waiting`, `kv_usage`: zero-argument callables read at each scrape. `cache_config`: the
    KV cache's settings (`block_size`, `num_gpu_blocks`, `enable_prefix_caching`), exported as the labels
    of the gauge `vllm:cache_config_info` (value 1), as vLLM exports its CacheConfig; a client reads the
    block size there.
    `num_speculative_tokens`: K of the engine's speculative decoding, 0 when it is off (no spec-decode
    metrics then, as in vLLM).
    """

    def __init__(
        self,
        model_name: str,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
        cache_config: Mapping[str, str] | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str, read: Callable[[], float]) -> None:
            Gauge(name, doc, labels, registry=reg).labels(model_name).set_function(read)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage)
        if cache_config:
            names = sorted(cache_config)
            info = Gauge(
                "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", names, registry=reg
            )
            info.labels(*(cache_config[n] for n in names)).set(1)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(model_name)

        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        success = Counter(
            "vllm:request_success",
            "Count of finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.request_success = {reason: success.labels(model_name, reason) for reason in _FINISH_REASONS}
        self.spec_drafts: Counter | None = None
        self.spec_draft_tokens: Counter | None = None
        self.spec_accepted_tokens: Counter | None = None
        self.spec_accepted_per_pos: list[Counter] = []
        if num_speculative_tokens > 0:
            self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
            self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
            self.spec_accepted_tokens = counter(
                "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
            )
            per_pos = Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                [*labels, "position"],
                registry=reg,
            )
            self.spec_accepted_per_pos = [
                per_pos.labels(model_name, str(i)) for i in range(num_speculative_tokens)
            ]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=reg, buckets=buckets).labels(model_name)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            E2E_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            tuple(float(b) for b in ITERATION_TOKENS_BUCKETS),
        )

    def record(self, stats: IterationStats) -> None:
        """Add one engine step's statistics (called from AsyncLLM's output thread)."""
        self.num_preemptions.inc(stats.num_preemptions)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        if stats.num_scheduled_tokens > 0:
            self.iteration_tokens.observe(stats.num_scheduled_tokens)
        spec = stats.spec_decoding
        if spec is not None and self.spec_drafts is not None:
            self.spec_drafts.inc(spec.num_drafts)
            if self.spec_draft_tokens is not None and self.spec_accepted_tokens is not None:
                self.spec_draft_tokens.inc(spec.num_draft_tokens)
                self.spec_accepted_tokens.inc(spec.num_accepted_tokens)
            for counter, n in zip(self.spec_accepted_per_pos, spec.num_accepted_tokens_per_pos, strict=False):
                counter.inc(n)
        for ttft in stats.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in stats.inter_token_latencies:
            self.itl.observe(itl)
        for finished in stats.finished_requests:
            counter = self.request_success.get(finished.finish_reason)
            if counter is not None:
                counter.inc()
            if finished.finish_reason != "abort":  # a client that left is not a served latency
                self.e2e.observe(finished.e2e_latency)
                self.queue_time.observe(finished.queued_time)

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
