"""A local OpenAI-compatible streaming server whose every byte and delay is scripted.

Used by the tests (edge cases of token streams, known TTFT/ITL/queue times) and by the overhead benchmark
(`overhead.py`). Only for 127.0.0.1. A `Script` (`scripted_streams.py`) is the HTTP status and a list of (delay, bytes) steps;
`timed_token_script` builds the common case: the first token `ttft_s` after the request arrives, then
one token every `itl_s`, scheduled on absolute deadlines (so the server's own lateness does not pile up),
with vLLM-style continuous usage, a final usage-only chunk and `[DONE]`.

Run as a process (`scripted_server_process`, or `python -m attention_kv_caceh.cli.scripted_server --ttft-ms 50
--itl-ms 10`): it prints `PORT <n>` and serves every request with `max_tokens` tokens until it is terminated.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any, cast

from aiohttp import web

from attention_kv_caceh.harness.scripted_streams import (
    DONE,
    Script,
    Step,
    chat_chunk,
    completion_chunk,
    sse,
    timed_token_script,
)

__all__ = [
    "DONE",
    "PrefixCacheModel",
    "Script",
    "ScriptedServer",
    "Step",
    "WordTokenizer",
    "chat_chunk",
    "completion_chunk",
    "scripted_server_process",
    "sse",
    "timed_token_script",
]


class WordTokenizer:
    """A deterministic test tokenizer: one token per whitespace-separated word (ids assigned in order
    of first sight, from 4), a BOS token (id 0) when special tokens are added, and a toy chat template
    (`encode_chat`)."""

    BOS, USER, END, ASSISTANT = 0, 1, 2, 3

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._words: list[str] = ["<s>", "<user>", "</user>", "<assistant>"]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.BOS] if add_special_tokens else []
        for word in text.split():
            if word not in self._ids:
                self._ids[word] = len(self._words)
                self._words.append(word)
            ids.append(self._ids[word])
        return ids

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """A toy chat template: BOS, a user marker, the words of every message, an end marker and an
        assistant marker (4 tokens besides the words)."""
        text = " ".join(str(m.get("content", "")) for m in messages)
        return [self.BOS, self.USER, *self.encode(text, False), self.END, self.ASSISTANT]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self._words[i] for i in ids if self.ASSISTANT < i < len(self._words))

    def prompt_tokens(self, payload: dict[str, Any]) -> int:
        """The prompt tokens of a request as a server with this tokenizer counts them: an id list as
        its length, a text with its BOS, chat messages in the toy chat template."""
        prompt = payload.get("prompt")
        if isinstance(prompt, list):
            return len(cast("list[Any]", prompt))
        if prompt is None:
            return len(self.encode_chat(cast("list[dict[str, Any]]", payload.get("messages") or [])))
        return len(self.encode(str(prompt)))


ScriptFor = Callable[[dict[str, Any], str], Script]


@dataclass
class _Counters:
    """What the server saw, per request in arrival order: its payload, when it arrived and when each
    step's bytes were handed to the transport (`time.perf_counter_ns`, the clock of the harness's
    records, so an in-process test can compare the two)."""

    in_flight: int = 0
    peak_in_flight: int = 0
    requests: int = 0
    payloads: list[dict[str, Any]] = field(default_factory=lambda: [])
    arrival_ns: list[int] = field(default_factory=lambda: list[int]())
    write_ns: list[list[int]] = field(default_factory=lambda: list[list[int]]())
    metrics_queries: list[str] = field(default_factory=lambda: [])
    resets: int = 0


class PrefixCacheModel:
    """A prefix cache as vLLM's counts it, for the scripted server's counters: a prompt's full blocks of
    `block_size` token ids are remembered (prompts only); a new prompt's hit is its longest run of
    remembered leading blocks, capped at len - 1 tokens as vLLM v1 caps it (the last prompt token is
    always computed). `queries` and `hits` count tokens; `enabled=False` never hits."""

    def __init__(self, block_size: int = 4, *, enabled: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enabled = enabled
        self.queries = 0
        self.hits = 0
        self._blocks: set[tuple[int, ...]] = set()

    def admit(self, ids: list[int]) -> int:
        """Count one prompt's lookup; remember its blocks; return its hit tokens."""
        n, b = len(ids), self.block_size
        hit = 0
        if self.enabled:
            while hit + b <= n - 1 and tuple(ids[: hit + b]) in self._blocks:
                hit += b
            for end in range(b, n + 1, b):
                self._blocks.add(tuple(ids[:end]))
        self.queries += n
        self.hits += hit
        return hit

    def reset(self) -> None:
        """Forget every block (POST /reset_prefix_cache); the counters keep counting."""
        self._blocks.clear()


class ScriptedServer:
    """aiohttp server on 127.0.0.1 answering POST /v1/completions and /v1/chat/completions with
    `script_for(payload, path)`, GET /metrics with `metrics_text` (or, with `live_metrics`, vLLM's
    running/waiting gauges from the streams in flight, padded with `metrics_padding` bytes of comment
    lines to the size of a real exposition), GET /v1/models with one model, and, with `tokenizer`,
    POST /tokenize and /detokenize with a WordTokenizer (as vLLM's API: `{"prompt", "add_special_tokens"}`
    in, `{"tokens", "count"}` out; `{"tokens"}` in, `{"prompt"}` out).

    With `counters`, /metrics also carries vLLM's cumulative counters, kept as a server keeps them:
    `vllm:prompt_tokens_total` (each request's prompt ids as the WordTokenizer counts them),
    `vllm:generation_tokens_total` (`max_tokens` of each completed 200 stream: what `timed_token_script`
    sends), `vllm:request_success_total{finished_reason="length"}`, `vllm:num_preemptions_total` (0) and
    `vllm:prefix_cache_queries_total` / `_hits_total` from a PrefixCacheModel (`prefix_block_size`,
    `prefix_caching`); POST /reset_prefix_cache empties that model and answers 200 (404 with
    `reset_endpoint=False`).

    `async with ScriptedServer(...) as server:` starts it on a free port (`server.base_url`) and stops it.
    """

    def __init__(
        self,
        script_for: ScriptFor,
        *,
        port: int = 0,
        metrics_text: str | None = None,
        live_metrics: bool = False,
        metrics_padding: int = 0,
        tokenizer: bool = False,
        counters: bool = False,
        prefix_block_size: int = 4,
        prefix_caching: bool = True,
        reset_endpoint: bool = True,
    ):
        self.script_for = script_for
        self.counters_on = counters
        self.prefix_cache = PrefixCacheModel(prefix_block_size, enabled=prefix_caching)
        self.reset_endpoint = reset_endpoint
        self._count_tokenizer = WordTokenizer()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_length = 0
        self.tokenizer = WordTokenizer() if tokenizer else None
        self.live_metrics = live_metrics
        self.metrics_padding = metrics_padding
        self.port = port
        self.metrics_text = metrics_text
        self.counters = _Counters()
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        arrival_ns = perf_counter_ns()
        payload: dict[str, Any] = await request.json()
        self.counters.requests += 1
        self.counters.payloads.append(payload)
        self.counters.arrival_ns.append(arrival_ns)
        writes: list[int] = []
        self.counters.write_ns.append(writes)
        script = self.script_for(payload, request.path)
        if self.counters_on and script.status == 200:
            ids = self.prompt_ids(payload)
            self.prompt_tokens_total += len(ids)
            self.prefix_cache.admit(ids)
        if script.status != 200:
            return web.Response(status=script.status, body=script.body, headers=dict(script.headers))
        response = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        self.counters.in_flight += 1
        self.counters.peak_in_flight = max(self.counters.peak_in_flight, self.counters.in_flight)
        try:
            await response.prepare(request)
            for step in script.steps:
                wait = step.delay_s - (loop.time() - arrival) if step.absolute else step.delay_s
                if wait > 0:
                    await asyncio.sleep(wait)
                writes.append(perf_counter_ns())
                await response.write(step.data)
            if script.abort:
                if request.transport is not None:
                    request.transport.abort()
                return response
            await response.write_eof()
            self.generation_tokens_total += _max_tokens(payload)
            self.finished_length += 1
        except ConnectionResetError:
            pass  # the client went away; nothing to answer
        finally:
            self.counters.in_flight -= 1
        return response

    def prompt_ids(self, payload: dict[str, Any]) -> list[int]:
        """A request's prompt as token ids: an id list as it is, a text or chat messages through the
        WordTokenizer (the /tokenize one when there is one, so that ids from it match)."""
        tokenizer = self.tokenizer or self._count_tokenizer
        prompt = payload.get("prompt")
        if isinstance(prompt, list):
            return [int(x) for x in cast("list[Any]", prompt)]
        if prompt is None:
            return tokenizer.encode_chat(cast("list[dict[str, Any]]", payload.get("messages") or []))
        return tokenizer.encode(str(prompt))

    def _counter_text(self) -> str:
        if not self.counters_on:
            return ""
        rows = (
            ("vllm:prompt_tokens", self.prompt_tokens_total),
            ("vllm:generation_tokens", self.generation_tokens_total),
            ("vllm:num_preemptions", 0),
            ("vllm:prefix_cache_queries", self.prefix_cache.queries),
            ("vllm:prefix_cache_hits", self.prefix_cache.hits),
        )
        text = "".join(
            f'# TYPE {name} counter\n{name}_total{{model_name="scripted"}} {value}\n' for name, value in rows
        )
        return text + (
            "# TYPE vllm:request_success counter\n"
            f'vllm:request_success_total{{finished_reason="length",model_name="scripted"}} {self.finished_length}\n'
        )

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.reset_endpoint:
            return web.Response(status=404, text="not found")
        self.counters.resets += 1
        self.prefix_cache.reset()
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.counters.metrics_queries.append(request.query_string)
        if self.live_metrics:
            pad = "".join(f"# pad {'x' * 90}\n" for _ in range(self.metrics_padding // 97))
            text = (
                f"{pad}# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="scripted"}} {self.counters.in_flight}\n'
                "# TYPE vllm:num_requests_waiting gauge\n"
                'vllm:num_requests_waiting{model_name="scripted"} 0\n'
            ) + self._counter_text()
            return web.Response(text=text, content_type="text/plain")
        if self.metrics_text is None and self.counters_on:
            return web.Response(text=self._counter_text(), content_type="text/plain")
        if self.metrics_text is None:
            return web.Response(status=404, text="no metrics")
        return web.Response(text=self.metrics_text, content_type="text/plain")

    async def _tokenize(self, request: web.Request) -> web.Response:
        if self.tokenizer is None:
            return web.Response(status=404, text="no tokenizer")
        body: dict[str, Any] = await request.json()
        messages = body.get("messages")
        if isinstance(messages, list):
            ids = self.tokenizer.encode_chat(cast("list[dict[str, Any]]", messages))
        else:
            special = bool(body.get("add_special_tokens", True))
            ids = self.tokenizer.encode(str(body.get("prompt", "")), special)
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 1 << 20})

    async def _detokenize(self, request: web.Request) -> web.Response:
        if self.tokenizer is None:
            return web.Response(status=404, text="no tokenizer")
        body: dict[str, Any] = await request.json()
        return web.json_response({"prompt": self.tokenizer.decode(list(body.get("tokens", [])))})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    async def start(self) -> str:
        """Start serving; returns the base URL (http://127.0.0.1:PORT)."""
        app = web.Application()
        app.router.add_post("/v1/completions", self._stream)
        app.router.add_post("/v1/chat/completions", self._stream)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = int(sock.getsockname()[1])
        site = web.SockSite(self._runner, sock, backlog=1024)
        await site.start()
        self.base_url = f"http://127.0.0.1:{self.port}"
        return self.base_url

    async def stop(self) -> None:
        """Stop serving and close open connections."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ScriptedServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _max_tokens(payload: dict[str, Any]) -> int:
    value = payload.get("max_tokens", payload.get("max_completion_tokens", 16))
    return int(value) if isinstance(value, int) and value > 0 else 16


async def serve_timed(
    ttft_ms: float, itl_ms: float, port: int, metrics_padding: int, ready: Callable[[int], None]
) -> None:
    """Serve `timed_token_script` streams (every request its `max_tokens` tokens) on 127.0.0.1:`port`
    until SIGTERM or SIGINT; calls `ready(port)` once listening. The process form is `cli/scripted_server.py`."""
    server: ScriptedServer | None = None

    def script_for(payload: dict[str, Any], path: str) -> Script:
        assert server is not None
        prompt = len(server.prompt_ids(payload))
        return timed_token_script(
            ttft_ms / 1000, itl_ms / 1000, _max_tokens(payload), chat="chat" in path, prompt_tokens=prompt
        )

    server = ScriptedServer(
        script_for, port=port, live_metrics=True, metrics_padding=metrics_padding, counters=True
    )
    await server.start()
    ready(server.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


@contextlib.contextmanager
def scripted_server_process(ttft_ms: float, itl_ms: float, metrics_padding: int = 0) -> Generator[str]:
    """Run the timed scripted server in a child process (its own core and GIL); yields its base URL.
    Its /metrics serves live gauges padded to `metrics_padding` bytes.

    The child is terminated on exit. Raises RuntimeError if it does not report its port in 30 s.
    """
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "attention_kv_caceh.cli.scripted_server",
            f"--ttft-ms={ttft_ms}",
            f"--itl-ms={itl_ms}",
            f"--metrics-padding={metrics_padding}",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"scripted server did not start (said {line!r})")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
