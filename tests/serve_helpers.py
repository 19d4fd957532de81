"""Run an app under a real uvicorn server in a thread on a free loopback port (as httpx's tests do).

The listening socket is bound before the thread starts, so clients may connect at once: the kernel queues
them until uvicorn accepts (no polling for readiness).
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from attention_kv_caceh.engine.async_llm import AsyncLLM
from attention_kv_caceh.engine.server import build_app
from tests.fake_engine import FakeEngine, FakeTokenizer

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


def fake_server(
    max_num_seqs: int = 4,
    *,
    max_model_len: int = 256,
    api_key: str | None = None,
    max_queue: int | None = None,
    eos_at: int | None = None,
) -> tuple[ServerThread, FakeEngine, AsyncLLM]:
    engine = FakeEngine(max_num_seqs=max_num_seqs, eos_at=eos_at)
    tokenizer = FakeTokenizer()
    llm = AsyncLLM(engine, tokenizer)
    app = build_app(llm, tokenizer, MODEL, max_model_len, api_key=api_key, max_queue=max_queue)
    return ServerThread(app), engine, llm
