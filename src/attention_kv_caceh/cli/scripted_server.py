"""A local OpenAI-compatible streaming server whose every byte and delay is scripted.

The process form of `harness.scripted_server` (its `scripted_server_process` starts it; no subcommand of
`attention-kv-caceh`): `python -m attention_kv_caceh.cli.scripted_server --ttft-ms 50 --itl-ms 10` prints
`PORT <n>` on stdout, for the parent, then serves timed token streams until SIGTERM or SIGINT. Bad
flags: one line on stderr, exit 2.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass

from attention_kv_caceh.cli.common import HelpFormatter, OneLineParser, UsageError
from attention_kv_caceh.cli.flags import add_options, config_from_args
from attention_kv_caceh.options import check_options, option

__all__ = ["ProcessOptions", "main"]


@dataclass(frozen=True)
class ProcessOptions:
    """The flags of the server's process form (`main`)."""

    ttft_ms: float = option(50.0, help="time to first token (ms)", minimum=0.0)
    itl_ms: float = option(10.0, help="inter-token delay (ms)", minimum=0.0)
    port: int = option(0, help="port on 127.0.0.1 (0: any free)", minimum=0, maximum=65535)
    metrics_padding: int = option(0, help="bytes of padding in the /metrics answer", minimum=0)

    def __post_init__(self) -> None:
        check_options(self)


def _ready(port: int) -> None:
    print(f"PORT {port}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Serve timed token streams until terminated (SIGTERM/SIGINT). Bad flags: one line, exit 2."""
    from attention_kv_caceh.harness.scripted_server import serve_timed

    parser = OneLineParser(
        description=__doc__.splitlines()[0] if __doc__ else None, formatter_class=HelpFormatter
    )
    add_options(parser, ProcessOptions)
    try:
        options = config_from_args(ProcessOptions, parser.parse_args(argv))
    except UsageError as exc:
        print(f"scripted_server: error: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve_timed(options.ttft_ms, options.itl_ms, options.port, options.metrics_padding, _ready))
    return 0


if __name__ == "__main__":
    sys.exit(main())
