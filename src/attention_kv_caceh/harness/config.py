"""The configuration of one harness run, validated on construction, and the run's size limits.

Every flag of the harness maps to one field of `HarnessConfig`; a bad value raises ValueError naming the
flag before anything is started or written.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from attention_kv_caceh.harness.dataset import read_dataset
from attention_kv_caceh.harness.load import LengthRange
from attention_kv_caceh.harness.metrics import GoodputSLO
from attention_kv_caceh.harness.sampling import SamplingOptions
from attention_kv_caceh.harness.server_metrics import DEFAULT_INTERVAL_S
from attention_kv_caceh.harness.trace import TraceSettings, read_trace
from attention_kv_caceh.harness.workloads import Workload, read_conversations
from attention_kv_caceh.memory import MEMORY_FRACTION, format_bytes, memory_budget_bytes

__all__ = [
    "BACKENDS",
    "MAX_REQUESTS",
    "MAX_SCHEDULE_S",
    "MAX_TOKENS",
    "MIN_SERVER_SAMPLES",
    "BackendName",
    "HarnessConfig",
]

BackendName = Literal["simulated", "openai-completions", "openai-chat"]
BACKENDS: tuple[BackendName, ...] = ("simulated", "openai-completions", "openai-chat")

# What one load test of this tool can sensibly do: every request is a task, a spec with its prompt and a
# record holding all its token times, all in this process's memory.
MAX_REQUESTS = 10_000_000  # --num-requests, and --warmup-requests
MAX_TOKENS = 10_000_000  # --prompt-len and --output-len (more than any model's context)
# Measured upper bounds (bytes) of what a run holds: per request (task, spec, record), per prompt token
# (the prompt text and, while it is drawn, its word indices), per output token (its timestamps).
_BYTES_PER_REQUEST = 4096
_BYTES_PER_PROMPT_TOKEN = 16
_BYTES_PER_OUTPUT_TOKEN = 128


MAX_SCHEDULE_S = 1e7  # about 116 days: the longest arrival schedule a run accepts (ns stay exact ints)
MIN_SERVER_SAMPLES = 10  # fewer samples than this get a warning: peaks from them are guesses
MAX_WORKERS = 64  # --workers: client processes


@dataclass(frozen=True)
class HarnessConfig:
    """Everything a run needs; validated on construction (ValueError names the bad value).

    Times: `prefill_ms`, `per_token_ms` in ms (simulated backend); `server_metrics_interval_s` and
    `timeout_s` in seconds (interval 0 disables polling); `request_rate` and `probe_rate` in requests/s
    (inf = all at once; probe rate 0: no probes). `trace`: replay a trace file (its first
    `num_requests` rows); `workers`: client processes the load is split over (`workers.py`).
    """

    backend: BackendName = "simulated"
    base_url: str = "http://127.0.0.1:8000"
    model: str = ""
    api_key: str | None = field(default=None, repr=False)
    num_requests: int = 16
    concurrency: int = 4
    request_rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0
    prompt_len: LengthRange = field(default_factory=lambda: LengthRange(32, 32))
    output_len: LengthRange = field(default_factory=lambda: LengthRange(16, 16))
    warmup_requests: int = 0
    server_slots: int = 8
    prefill_ms: float = 50.0
    per_token_ms: float = 10.0
    goodput: GoodputSLO = field(default_factory=GoodputSLO)
    server_metrics_interval_s: float = DEFAULT_INTERVAL_S
    timeout_s: float = 600.0
    smoke_test: bool = True
    ignore_eos: bool = False
    label: str | None = None
    tokenizer: str | None = None
    dataset: str | None = None
    workload: Workload = field(default_factory=Workload)
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    trace: TraceSettings | None = None
    probe_rate: float = 0.0
    workers: int = 1

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.backend != "simulated":
            _check_base_url(self.base_url)
        elif self.sampling.body_fields():
            raise ValueError(
                f"{self.sampling.given_flags()[0]}: the simulated backend has no server that samples; "
                "sampling flags need an HTTP backend (openai-completions, openai-chat or engine)"
            )
        checks: list[tuple[bool, str]] = [
            (self.num_requests >= 1, f"--num-requests must be >= 1, got {self.num_requests}"),
            (self.concurrency >= 1, f"--concurrency must be >= 1, got {self.concurrency}"),
            (
                self.request_rate > 0 and not math.isnan(self.request_rate),
                f"--request-rate must be > 0 or inf, got {self.request_rate}",
            ),
            (
                self.burstiness > 0 and math.isfinite(self.burstiness),
                f"--burstiness must be a positive finite number, got {self.burstiness}",
            ),
            (self.seed >= 0, f"--seed must be >= 0, got {self.seed}"),
            (self.warmup_requests >= 0, f"--warmup-requests must be >= 0, got {self.warmup_requests}"),
            (self.server_slots >= 1, f"--server-slots must be >= 1, got {self.server_slots}"),
            (
                self.prefill_ms >= 0 and math.isfinite(self.prefill_ms),
                f"--prefill-ms must be a finite number >= 0, got {self.prefill_ms}",
            ),
            (
                self.per_token_ms >= 0 and math.isfinite(self.per_token_ms),
                f"--per-token-ms must be a finite number >= 0, got {self.per_token_ms}",
            ),
            (
                self.server_metrics_interval_s >= 0 and math.isfinite(self.server_metrics_interval_s),
                f"--server-metrics-interval must be >= 0 s, got {self.server_metrics_interval_s}",
            ),
            (
                self.timeout_s > 0 and math.isfinite(self.timeout_s),
                f"--timeout must be > 0 s, got {self.timeout_s}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if math.isfinite(self.request_rate) and self.num_requests / self.request_rate > MAX_SCHEDULE_S:
            raise ValueError(
                f"--request-rate {self.request_rate}: {self.num_requests} requests would arrive over about "
                f"{self.num_requests / self.request_rate:.3g} s, more than {MAX_SCHEDULE_S:g} s (the most "
                "a run can schedule); use a higher rate"
            )
        if self.tokenizer is not None:
            from attention_kv_caceh.engine.model_source import gguf_file_of

            path = Path(self.tokenizer)
            tokenizer_json = (path / "tokenizer.json").is_file() or (
                path.is_file() and path.suffix == ".json"
            )
            if not tokenizer_json and gguf_file_of(path) is None:
                raise ValueError(
                    f"--tokenizer {self.tokenizer!r}: expected a folder with tokenizer.json, a .gguf file or "
                    "a model name"
                )
        if self.dataset is not None and not Path(self.dataset).is_file():
            exists = Path(self.dataset).exists()
            what = "not a regular file (a folder, FIFO, device or socket)" if exists else "no such file"
            raise ValueError(f"--dataset {self.dataset!r}: {what}")
        self.workload.check_requests(self.num_requests)
        self._check_load_options()
        if self.dataset is not None and self.workload.kind == "shared-prefix":
            raise ValueError(
                f"--dataset {self.dataset!r}: --workload shared-prefix builds its own prompts "
                "(a dataset goes with --workload random, or multi-turn for conversations)"
            )
        if self.dataset is not None and self.workload.kind == "copy":
            raise ValueError(
                f"--dataset {self.dataset!r}: --workload copy builds its own prompts (a passage to repeat)"
            )
        if self.dataset is not None and self.workload.kind == "multi-turn":
            conversations = read_conversations(self.dataset)
            if len(conversations) < self.num_requests // self.workload.turns:
                raise ValueError(
                    f"--dataset {self.dataset!r} has {len(conversations)} conversations, fewer than "
                    f"--num-requests / --turns = {self.num_requests // self.workload.turns}"
                )
        elif self.dataset is not None:  # its contents too, before any server is contacted
            entries = read_dataset(self.dataset)
            if len(entries) < self.num_requests:
                raise ValueError(
                    f"--dataset {self.dataset!r} has {len(entries)} entries, fewer than --num-requests "
                    f"{self.num_requests}"
                )
            longest = max((n for _, n in entries[: self.num_requests] if n is not None), default=0)
            if longest > MAX_TOKENS:
                raise ValueError(
                    f"--dataset {self.dataset!r}: an output_len of {longest} is above {MAX_TOKENS}"
                )
        self._check_size()

    def _check_load_options(self) -> None:
        """--trace, --probe-rate and --workers against the rest (ValueError naming the flag)."""
        if not (self.probe_rate >= 0 and math.isfinite(self.probe_rate)):
            raise ValueError(f"--probe-rate must be a finite number >= 0 (req/s), got {self.probe_rate}")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"--workers must be in [1, {MAX_WORKERS}], got {self.workers}")
        if self.workers > 1:
            if self.backend == "simulated":
                raise ValueError(
                    f"--workers {self.workers}: the simulated server lives in the client's process; "
                    "several client processes need an HTTP backend"
                )
            if self.workload.kind == "multi-turn":
                raise ValueError(
                    f"--workers {self.workers}: a multi-turn run waits for every answer between rounds "
                    "in one process"
                )
            if self.concurrency < self.workers:
                raise ValueError(
                    f"--workers {self.workers}: the --concurrency {self.concurrency} is split between the "
                    "workers, so it must be at least the number of workers"
                )
        if self.trace is None:
            return
        flag = f"--trace {self.trace.path!r}"
        if self.workload.kind != "random" or self.dataset is not None:
            raise ValueError(f"{flag}: the trace gives the prompts (no --workload or --dataset with it)")
        if self.backend == "openai-chat":
            raise ValueError(
                f"{flag}: a trace's prompts are token ids for /v1/completions (a chat template would shift "
                "every block); use --backend openai-completions or engine"
            )
        if math.isfinite(self.request_rate) or self.burstiness != 1.0:
            raise ValueError(
                f"{flag}: the trace's timestamps give the arrivals (no --request-rate or --burstiness; "
                "--trace-speedup scales them)"
            )
        rows = read_trace(self.trace)
        if self.num_requests > len(rows):
            rows_word = "row" if len(rows) == 1 else "rows"
            raise ValueError(f"--num-requests {self.num_requests}: {flag} has only {len(rows)} {rows_word}")
        longest = max(row.input_length for row in rows[: self.num_requests])
        if longest > MAX_TOKENS:
            raise ValueError(f"{flag}: an input_length of {longest} is above {MAX_TOKENS}")
        span = (rows[self.num_requests - 1].timestamp - rows[0].timestamp) * self.trace.seconds_per_unit
        if span / self.trace.speedup > MAX_SCHEDULE_S:
            raise ValueError(
                f"{flag}: its arrivals span {span / self.trace.speedup:.3g} s, more than {MAX_SCHEDULE_S:g} s "
                "(the most a run can schedule); raise --trace-speedup"
            )

    def _check_size(self) -> None:
        """Raise ValueError naming the flag when the run is beyond MAX_REQUESTS or MAX_TOKENS, or its
        requests would need more memory than `memory.memory_budget_bytes()` allows."""
        for flag, value in (
            ("--num-requests", self.num_requests),
            ("--warmup-requests", self.warmup_requests),
        ):
            if value > MAX_REQUESTS:
                raise ValueError(f"{flag} must be <= {MAX_REQUESTS}, got {value}")
        for flag, length in (("--prompt-len", self.prompt_len), ("--output-len", self.output_len)):
            if length.high > MAX_TOKENS:
                raise ValueError(f"{flag} must be <= {MAX_TOKENS} tokens, got {length}")
        if self.workload.prefix_len > MAX_TOKENS:
            raise ValueError(f"--prefix-len must be <= {MAX_TOKENS} tokens, got {self.workload.prefix_len}")
        requests = self.num_requests + self.warmup_requests
        prompt_high, output_high = self.prompt_len.high, self.output_len.high
        if self.trace is not None:
            rows = read_trace(self.trace)[: self.num_requests]
            prompt_high = max(prompt_high, *(r.input_length for r in rows))
            output_high = max(output_high, *(r.output_length for r in rows))
        parts = {
            "--num-requests": requests * _BYTES_PER_REQUEST,
            "--prompt-len": requests * prompt_high * _BYTES_PER_PROMPT_TOKEN,
            "--output-len": requests * output_high * _BYTES_PER_OUTPUT_TOKEN,
        }
        need, limit = sum(parts.values()), memory_budget_bytes()
        if limit is not None and need > limit:
            flag = max(parts, key=lambda k: parts[k])
            value = {"--num-requests": self.num_requests, "--prompt-len": self.prompt_len}.get(
                flag, self.output_len
            )
            raise ValueError(
                f"{flag} {value}: {requests} requests of up to {self.prompt_len.high} prompt and "
                f"{self.output_len.high} output tokens need about {format_bytes(need)} of memory, more "
                f"than the {format_bytes(limit)} a run may plan to use ({MEMORY_FRACTION:.0%} of physical "
                "memory or of the address-space limit); use fewer or shorter requests"
            )

    def describe(self) -> dict[str, Any]:
        """The config as JSON-ready values, only what the backend uses: the API key left out; the
        simulated server's `server_slots`, `prefill_ms`, `per_token_ms` only for the simulated backend,
        and the HTTP settings (`base_url`, `model`, `timeout_s`, `ignore_eos`, `tokenizer`) only for
        the others, with `sampling`: the sampling fields sent in every request body ({}: none, the
        server's defaults)."""
        out = asdict(self)
        out.pop("api_key")
        unused = (
            ("server_slots", "prefill_ms", "per_token_ms")
            if self.backend != "simulated"
            else ("base_url", "model", "timeout_s", "ignore_eos", "tokenizer", "sampling")
        )
        for key in unused:
            out.pop(key)
        out["prompt_len"] = str(self.prompt_len)
        out["output_len"] = str(self.output_len)
        out["goodput"] = self.goodput.as_dict()
        out["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        out["workload"] = self.workload.describe()
        out["trace"] = self.trace.describe() if self.trace is not None else None
        if self.backend != "simulated":
            out["sampling"] = self.sampling.body_fields()
        return out


def _check_base_url(base_url: str) -> None:
    """Raise ValueError naming --base-url unless it is an http(s) URL with a host."""
    try:
        parts = urlsplit(base_url)
        host = parts.hostname if parts.port is None or parts.port > 0 else None
    except ValueError:  # a bad port or bracketed host
        host = None
    if not base_url.startswith(("http://", "https://")) or not host:
        raise ValueError(f"--base-url {base_url!r}: expected http://HOST[:PORT] or https://HOST[:PORT]")
