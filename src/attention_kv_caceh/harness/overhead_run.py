"""The harness's own overhead as a lab measurement: its config (the scripted server's delays, the
concurrencies) and the loop that starts the server and yields one row per concurrency.

`overhead.measure_overhead` measures one concurrency against a running scripted server
(`scripted_server`, a child process on 127.0.0.1); `measure_overheads` runs it at each
`OverheadConfig.concurrency` in turn. The table is `report/overhead.py`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from attention_kv_caceh.options import ConfigError, check_options, option

__all__ = ["OverheadConfig", "measure_overheads"]


@dataclass(frozen=True)
class OverheadConfig:
    """The concurrencies to measure and the server's script: one token every `itl_ms` after a first
    one at `ttft_ms`, `tokens` per request, max(16, waves x concurrency) requests per run. Raises
    ConfigError naming the field (a run above `config.MAX_REQUESTS` requests included)."""

    concurrency: tuple[int, ...] = option(
        (1, 64, 256),
        help="client in-flight limits to measure, one run each",
        metavar="N",
        parse=int,
        nargs="+",
        minimum=1,
        default_text="[1, 64, 256]",
    )
    itl_ms: float = option(10.0, help="scripted inter-token delay (ms)", minimum=0.0)
    ttft_ms: float = option(20.0, help="scripted time to first token (ms)", minimum=0.0)
    tokens: int = option(
        50, help="tokens per request (>= 2: ITL needs two tokens)", metavar="TOKENS", minimum=2
    )
    waves: int = option(
        2,
        help="requests per concurrency slot: each run sends max(16, waves x concurrency) requests",
        metavar="WAVES",
        minimum=1,
    )

    def __post_init__(self) -> None:
        check_options(self)
        for name in ("itl_ms", "ttft_ms"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(name, f"must be a finite number, got {getattr(self, name)!r}")
        from attention_kv_caceh.harness.config import MAX_REQUESTS

        if self.waves * max(self.concurrency) > MAX_REQUESTS:
            raise ConfigError(
                "waves", f"{self.waves}: at most {MAX_REQUESTS} requests per run (waves x concurrency)"
            )


def measure_overheads(config: OverheadConfig) -> Iterator[dict[str, Any]]:
    """Start the scripted server and yield `measure_overhead`'s row at each concurrency; the server
    stops when the loop ends (or is left). Raises RuntimeError when a request failed."""
    from attention_kv_caceh.harness.overhead import measure_overhead
    from attention_kv_caceh.harness.scripted_server import scripted_server_process

    with scripted_server_process(config.ttft_ms, config.itl_ms, metrics_padding=55_000) as url:
        for concurrency in config.concurrency:
            yield measure_overhead(
                url,
                concurrency,
                itl_ms=config.itl_ms,
                ttft_ms=config.ttft_ms,
                tokens=config.tokens,
                waves=config.waves,
            )
