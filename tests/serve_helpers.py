"""Run an app under a real uvicorn server in a thread on a free loopback port (as httpx's tests do).

The listening socket is bound before the thread starts, so clients may connect at once: the kernel queues
them until uvicorn accepts (no polling for readiness).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from types import TracebackType

import numpy as np
import uvicorn
from fastapi import FastAPI

from attention_kv_caceh.engine.async_llm import AsyncLLM
from attention_kv_caceh.engine.core import EngineCore, StepStats
from attention_kv_caceh.engine.spec_decode.config import SpeculativeConfig
from attention_kv_caceh.entrypoints.openai.api_server import build_app
from tests.engine_fakes import CharTokenizer, GatedRunner, letter_logits, make_text_core, wait_for

MODEL = "fake-model"


class ServerThread:
    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(512)
        port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(app, log_level="error", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.sock.close()


class ServedEngine:
    """The core behind a test server, with the GatedRunner's controls."""

    def __init__(self, core: EngineCore, runner: GatedRunner) -> None:
        self.core = core
        self.runner = runner
        self.gate = runner.gate
        self.total_blocks = core.scheduler.kv_cache_manager.num_blocks

    @property
    def blocked(self) -> bool:
        return self.runner.blocked

    @property
    def fail_steps(self) -> int:
        return self.runner.fail_steps

    @fail_steps.setter
    def fail_steps(self, n: int) -> None:
        self.runner.fail_steps = n

    @property
    def step_stats(self) -> list[StepStats]:
        return list(self.core.step_stats)

    @property
    def num_free_blocks(self) -> int:
        return self.core.scheduler.kv_cache_manager.num_free_blocks

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 60.0) -> bool:
        return wait_for(predicate, timeout)


def fake_server(
    max_num_seqs: int = 4,
    *,
    max_model_len: int = 256,
    api_key: str | None = None,
    max_queue: int | None = None,
    eos_at: int | None = None,
    max_request_bytes: int | None = None,
    max_seqs_per_request: int | None = None,
    enable_prefix_caching: bool = True,
    max_request_bytes_in_flight: int | None = None,
    speculative_config: SpeculativeConfig | None = None,
    logits_fn: Callable[[Sequence[int], int], np.ndarray] = letter_logits,
) -> tuple[ServerThread, ServedEngine, AsyncLLM]:
    """The app over a real EngineCore (GatedRunner, CharTokenizer) whose busy loop runs in a thread."""
    core, runner = make_text_core(
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        eos_after=eos_at,
        enable_prefix_caching=enable_prefix_caching,
        speculative_config=speculative_config,
        logits_fn=logits_fn,
    )
    tokenizer = CharTokenizer()
    llm = AsyncLLM.from_engine_core(core, tokenizer)
    extra: dict[str, int] = {}
    if max_request_bytes is not None:
        extra["max_request_bytes"] = max_request_bytes
    if max_seqs_per_request is not None:
        extra["max_seqs_per_request"] = max_seqs_per_request
    if max_request_bytes_in_flight is not None:
        extra["max_request_bytes_in_flight"] = max_request_bytes_in_flight
    if speculative_config is not None:
        extra["num_speculative_tokens"] = speculative_config.num_speculative_tokens
    app = build_app(llm, tokenizer, MODEL, max_model_len, api_key=api_key, max_queue=max_queue, **extra)
    return ServerThread(app), ServedEngine(core, runner), llm
