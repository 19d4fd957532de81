"""The configuration of one harness run, validated on construction, and the run's size limits.

Every flag of the harness is a field declared with `options.option` (its help and bounds beside it):
`HarnessConfig` here, `Workload`, `SamplingOptions`, `TraceSettings` nested in it. A bad value raises
`options.ConfigError` naming the field (`num_requests: must be >= 1, got 0`) before anything is started
or written; the command line shows the field's flag instead (`cli.flags.config_from_args`).
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
from attention_kv_caceh.options import ConfigError, check_options, option

__all__ = [
    "BACKENDS",
    "DEFAULT_NUM_REQUESTS",
    "ENGINE_BACKEND",
    "MAX_REQUESTS",
    "MAX_SCHEDULE_S",
    "MAX_TOKENS",
    "MIN_SERVER_SAMPLES",
    "BackendName",
    "HarnessConfig",
]

BackendName = Literal["simulated", "openai-completions", "openai-chat"]
BACKENDS: tuple[BackendName, ...] = ("simulated", "openai-completions", "openai-chat")
# The backend the command line adds: it starts `serve` for the run and uses openai-completions against it.
ENGINE_BACKEND = "engine"

# What one load test of this tool can sensibly do: every request is a task, a spec with its prompt and a
# record holding all its token times, all in this process's memory.
MAX_REQUESTS = 10_000_000  # num_requests, and warmup_requests
MAX_TOKENS = 10_000_000  # prompt_len and output_len (more than any model's context)
# Measured upper bounds (bytes) of what a run holds: per request (task, spec, record), per prompt token
# (the prompt text and, while it is drawn, its word indices), per output token (its timestamps).
_BYTES_PER_REQUEST = 4096
_BYTES_PER_PROMPT_TOKEN = 16
_BYTES_PER_OUTPUT_TOKEN = 128


MAX_SCHEDULE_S = 1e7  # about 116 days: the longest arrival schedule a run accepts (ns stay exact ints)
MIN_SERVER_SAMPLES = 10  # fewer samples than this get a warning: peaks from them are guesses
MAX_WORKERS = 64  # workers: client processes
DEFAULT_NUM_REQUESTS = 16


def _backend(text: str) -> str:
    """The text of --backend: one of BACKENDS or ENGINE_BACKEND (which the command line resolves)."""
    if text not in (*BACKENDS, ENGINE_BACKEND):
        raise ValueError(f"expected one of {', '.join((*BACKENDS, ENGINE_BACKEND))}, got {text!r}")
    return text


_LENGTH_HELP = f"N, or LOW:HIGH drawn uniformly; at most {MAX_TOKENS}"


@dataclass(frozen=True)
class HarnessConfig:
    """Everything a run needs; validated on construction (ConfigError names the field and its value).

    Times: `prefill_ms`, `per_token_ms` in ms (simulated backend); `server_metrics_interval_s` and
    `timeout_s` in seconds (interval 0 disables polling); `request_rate` and `probe_rate` in requests/s
    (inf = all at once; probe rate 0: no probes). `prompt_len` / `output_len` also take their text
    ("32", "16:64") and `goodput` its items (["ttft:500"]). `trace`: replay a trace file (its first
    `num_requests` rows); `workers`: client processes the load is split over (`workers.py`).
    """

    backend: BackendName = option(
        "simulated",
        help=f"where requests go; {ENGINE_BACKEND}: start `serve --model MODEL` on a free loopback port "
        "for the run and use openai-completions against it",
        choices=BACKENDS,
        parse=_backend,
        metavar="{" + ",".join((*BACKENDS, ENGINE_BACKEND)) + "}",
    )
    base_url: str = option(
        "http://127.0.0.1:8000", help="OpenAI-compatible server root", default_text="http://127.0.0.1:8000"
    )
    model: str = option(
        "",
        help=f"model name (default: the first model listed by GET /v1/models); with --backend "
        f"{ENGINE_BACKEND}: the checkpoint to serve, as serve's --model takes it (required)",
    )
    api_key: str | None = field(default=None, repr=False)
    timeout_s: float = option(600.0, flag="--timeout", metavar="TIMEOUT", help="per-request timeout (s)")
    ignore_eos: bool = option(
        False,
        help="ask the server (vLLM) to ignore EOS so that every request yields its output length",
        default_text="off",
    )
    smoke_test: bool = option(
        True, negatable=True, help="send one request first and stop with a clear message if it fails"
    )
    num_requests: int = option(
        DEFAULT_NUM_REQUESTS,
        help=f"measured requests, at most {MAX_REQUESTS}; a run whose requests would need more than half "
        "of the memory is refused",
        default_text="16; with --trace, every row",
        minimum=1,
        maximum=MAX_REQUESTS,
    )
    concurrency: int = option(4, help="client in-flight limit (the semaphore)", minimum=1)
    request_rate: float = option(math.inf, help="arrivals per second (inf: all at once; else Poisson/gamma)")
    burstiness: float = option(1.0, help="gamma shape of arrival gaps (1: Poisson; <1 burstier), as vLLM")
    seed: int = option(0, help="seed of lengths, prompts and arrivals", minimum=0)
    prompt_len: LengthRange = option(
        default_factory=lambda: LengthRange(32, 32),
        help=f"prompt tokens: {_LENGTH_HELP}; with --workload "
        "shared-prefix: words after the prefix (one token each with a tokenizer); multi-turn: words of each "
        "new user message, sent after the whole history; with --trace the rows give the lengths, and it "
        "shapes only --warmup-requests",
        default_text="32",
    )
    output_len: LengthRange = option(
        default_factory=lambda: LengthRange(16, 16),
        help=f"output tokens: {_LENGTH_HELP}; with --trace the rows give "
        "the lengths, and it shapes only --warmup-requests",
        default_text="16",
    )
    tokenizer: str | None = option(
        None,
        metavar="DIR",
        help="folder with the target's tokenizer.json (or a .gguf file or model name serve takes), to build "
        "prompts of exactly --prompt-len tokens",
        default_text="the server's POST /tokenize if it has one, else approximate lengths",
    )
    dataset: str | None = option(
        None,
        metavar="PATH.jsonl",
        help='real prompts, one {"prompt": ..., "output_len": ...} a line; the first --num-requests are sent',
        default_text="synthetic prompts",
    )
    workload: Workload = field(default_factory=Workload)
    warmup_requests: int = option(
        0,
        help=f"unrecorded requests before the run (same concurrency limit), at most {MAX_REQUESTS}",
        minimum=0,
        maximum=MAX_REQUESTS,
    )
    trace: TraceSettings | None = None
    probe_rate: float = option(
        0.0,
        metavar="R",
        help="one-token probe requests per second beside the load, one at a time, outside "
        "--concurrency and the load's statistics; the summary gives their TTFT and E2EL "
        "(vLLM's --probe-request-rate)",
        default_text="0.0, none",
    )
    workers: int = option(
        1,
        help="client processes the load is split over, one event loop each, on one arrival schedule "
        f"(--concurrency is split between them); at most {MAX_WORKERS}",
    )
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    server_slots: int = option(8, help="simulated server batch slots", minimum=1)
    prefill_ms: float = option(50.0, help="simulated time to first token")
    per_token_ms: float = option(10.0, help="simulated inter-token time")
    goodput: GoodputSLO = option(
        default_factory=GoodputSLO,
        nargs="+",
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000",
        default_text="none, no goodput",
    )
    label: str | None = option(
        None,
        help="a name for this run, written into the summary (vLLM's --label)",
        default_text="none",
    )
    server_metrics_interval_s: float = option(
        DEFAULT_INTERVAL_S,
        flag="--server-metrics-interval",
        metavar="SERVER_METRICS_INTERVAL",
        help="seconds between polls of the server's /metrics (0: off), from a thread of its own, "
        "stretched so that polls cost the server < 1%% of its time",
    )

    def __post_init__(self) -> None:
        self._parse_texts()
        check_options(self)
        if self.backend != "simulated":
            _check_base_url(self.base_url)
        elif self.sampling.body_fields():
            raise ConfigError(
                next(iter(self.sampling.body_fields())),
                "the simulated backend has no server that samples; sampling needs an HTTP backend "
                "(openai-completions, openai-chat or engine)",
                SamplingOptions,
            )
        self._check_numbers()
        if self.tokenizer is not None:
            from attention_kv_caceh.model_executor.model_source import gguf_file_of

            path = Path(self.tokenizer)
            tokenizer_json = (path / "tokenizer.json").is_file() or (
                path.is_file() and path.suffix == ".json"
            )
            if not tokenizer_json and gguf_file_of(path) is None:
                raise ConfigError(
                    "tokenizer",
                    f"{self.tokenizer!r}: expected a folder with tokenizer.json, a .gguf file or a model name",
                )
        self.workload.check_requests(self.num_requests)
        self._check_load_options()
        self._check_dataset()
        self._check_size()

    def _parse_texts(self) -> None:
        """`prompt_len` / `output_len` given as text, `goodput` as items: parsed (ConfigError naming them)."""
        for name in ("prompt_len", "output_len", "goodput"):
            value: Any = getattr(self, name)
            try:
                parsed = LengthRange.of(value) if name != "goodput" else GoodputSLO.of(value)
            except ValueError as exc:
                raise ConfigError(name, str(exc)) from None
            object.__setattr__(self, name, parsed)

    def _check_numbers(self) -> None:
        """The bounds `option` cannot say: open intervals and finiteness."""
        checks: list[tuple[str, bool, str]] = [
            ("request_rate", self.request_rate > 0, "must be > 0 or inf"),
            ("burstiness", self.burstiness > 0 and math.isfinite(self.burstiness), "must be a positive finite number"),
            ("prefill_ms", self.prefill_ms >= 0 and math.isfinite(self.prefill_ms), "must be a finite number >= 0"),
            ("per_token_ms", self.per_token_ms >= 0 and math.isfinite(self.per_token_ms), "must be a finite number >= 0"),
            (
                "server_metrics_interval_s",
                self.server_metrics_interval_s >= 0 and math.isfinite(self.server_metrics_interval_s),
                "must be >= 0 s",
            ),
            ("timeout_s", self.timeout_s > 0 and math.isfinite(self.timeout_s), "must be > 0 s"),
            (
                "probe_rate",
                self.probe_rate >= 0 and math.isfinite(self.probe_rate),
                "must be a finite number >= 0 (req/s)",
            ),
        ]  # fmt: skip
        for name, ok, message in checks:
            if not ok:
                raise ConfigError(name, f"{message}, got {getattr(self, name)}")
        if math.isfinite(self.request_rate) and self.num_requests / self.request_rate > MAX_SCHEDULE_S:
            raise ConfigError(
                "request_rate",
                f"{self.request_rate}: {self.num_requests} requests would arrive over about "
                f"{self.num_requests / self.request_rate:.3g} s, more than {MAX_SCHEDULE_S:g} s (the most "
                "a run can schedule); use a higher rate",
            )

    def _check_dataset(self) -> None:
        """The dataset file, its use with the workload and its entries (ConfigError naming `dataset`)."""
        if self.dataset is None:
            return
        name = repr(self.dataset)
        if not Path(self.dataset).is_file():
            exists = Path(self.dataset).exists()
            what = "not a regular file (a folder, FIFO, device or socket)" if exists else "no such file"
            raise ConfigError("dataset", f"{name}: {what}")
        kind = self.workload.kind
        if kind in ("shared-prefix", "copy"):
            raise ConfigError(
                "dataset",
                f"{name}: workload {kind} builds its own prompts (a dataset goes with workload random, "
                "or multi-turn for conversations)",
            )
        if kind == "multi-turn":
            conversations = read_conversations(self.dataset)
            if len(conversations) < self.num_requests // self.workload.turns:
                raise ConfigError(
                    "dataset",
                    f"{name} has {len(conversations)} conversations, fewer than num_requests / turns = "
                    f"{self.num_requests // self.workload.turns}",
                )
            return
        entries = read_dataset(self.dataset)  # its contents too, before any server is contacted
        if len(entries) < self.num_requests:
            raise ConfigError(
                "dataset", f"{name} has {len(entries)} entries, fewer than num_requests={self.num_requests}"
            )
        longest = max((n for _, n in entries[: self.num_requests] if n is not None), default=0)
        if longest > MAX_TOKENS:
            raise ConfigError("dataset", f"{name}: an output_len of {longest} is above {MAX_TOKENS}")

    def _check_load_options(self) -> None:
        """`trace` and `workers` against the rest (ConfigError naming the field)."""
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError("workers", f"must be in [1, {MAX_WORKERS}], got {self.workers}")
        if self.workers > 1:
            problem = (
                "the simulated server lives in the client's process; several client processes need an "
                "HTTP backend"
                if self.backend == "simulated"
                else "a multi-turn run waits for every answer between rounds in one process"
                if self.workload.kind == "multi-turn"
                else f"the concurrency {self.concurrency} is split between the workers, so it must be at "
                "least the number of workers"
                if self.concurrency < self.workers
                else None
            )
            if problem is not None:
                raise ConfigError("workers", f"{self.workers}: {problem}")
        if self.trace is not None:
            self._check_trace(self.trace)

    def _check_trace(self, trace: TraceSettings) -> None:
        def refuse(message: str) -> ConfigError:
            return ConfigError("path", f"{trace.path!r}: {message}", TraceSettings)

        if self.workload.kind != "random" or self.dataset is not None:
            raise refuse("the trace gives the prompts (no workload or dataset with it)")
        if self.backend == "openai-chat":
            raise refuse(
                "a trace's prompts are token ids for /v1/completions (a chat template would shift every "
                "block); use the backend openai-completions or engine"
            )
        if math.isfinite(self.request_rate) or self.burstiness != 1.0:
            raise refuse(
                "the trace's timestamps give the arrivals (no request_rate or burstiness; its speedup "
                "scales them)"
            )
        rows = read_trace(trace)
        if self.num_requests > len(rows):
            rows_word = "row" if len(rows) == 1 else "rows"
            raise ConfigError(
                "num_requests",
                f"{self.num_requests}: the trace {trace.path!r} has only {len(rows)} {rows_word}",
            )
        longest = max(row.input_length for row in rows[: self.num_requests])
        if longest > MAX_TOKENS:
            raise refuse(f"an input_length of {longest} is above {MAX_TOKENS}")
        span = (rows[self.num_requests - 1].timestamp - rows[0].timestamp) * trace.seconds_per_unit
        if span / trace.speedup > MAX_SCHEDULE_S:
            raise refuse(
                f"its arrivals span {span / trace.speedup:.3g} s, more than {MAX_SCHEDULE_S:g} s (the most "
                "a run can schedule); raise its speedup"
            )

    def _check_size(self) -> None:
        """Raise ConfigError naming the field when the run is beyond MAX_TOKENS, or its requests would
        need more memory than `memory.memory_budget_bytes()` allows."""
        for name, length in (("prompt_len", self.prompt_len), ("output_len", self.output_len)):
            if length.high > MAX_TOKENS:
                raise ConfigError(name, f"must be <= {MAX_TOKENS} tokens, got {length}")
        if self.workload.prefix_len > MAX_TOKENS:
            raise ConfigError(
                "prefix_len", f"must be <= {MAX_TOKENS} tokens, got {self.workload.prefix_len}", Workload
            )
        requests = self.num_requests + self.warmup_requests
        prompt_high, output_high = self.prompt_len.high, self.output_len.high
        if self.trace is not None:
            rows = read_trace(self.trace)[: self.num_requests]
            prompt_high = max(prompt_high, *(r.input_length for r in rows))
            output_high = max(output_high, *(r.output_length for r in rows))
        parts = {
            "num_requests": requests * _BYTES_PER_REQUEST,
            "prompt_len": requests * prompt_high * _BYTES_PER_PROMPT_TOKEN,
            "output_len": requests * output_high * _BYTES_PER_OUTPUT_TOKEN,
        }
        need, limit = sum(parts.values()), memory_budget_bytes()
        if limit is not None and need > limit:
            name = max(parts, key=lambda k: parts[k])
            raise ConfigError(
                name,
                f"got {getattr(self, name)}: {requests} requests of up to {self.prompt_len.high} prompt and "
                f"{self.output_len.high} output tokens need about {format_bytes(need)} of memory, more "
                f"than the {format_bytes(limit)} a run may plan to use ({MEMORY_FRACTION:.0%} of physical "
                "memory or of the address-space limit); use fewer or shorter requests",
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
    """Raise ConfigError naming `base_url` unless it is an http(s) URL with a host."""
    try:
        parts = urlsplit(base_url)
        host = parts.hostname if parts.port is None or parts.port > 0 else None
    except ValueError:  # a bad port or bracketed host
        host = None
    if not base_url.startswith(("http://", "https://")) or not host:
        raise ConfigError("base_url", f"expected http://HOST[:PORT] or https://HOST[:PORT], got {base_url!r}")
