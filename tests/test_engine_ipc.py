"""The engine core's channels are private: a foreign process that connects to them gets no request and
injects no output, and no socket file or folder is left behind (engine/ipc.py, engine/core_client.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from unittest import mock

from attention_kv_caceh.engine.async_llm import AsyncLLM
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.core_client import EngineDeadError, MPClient
from attention_kv_caceh.engine.ipc import _peer_pid  # pyright: ignore[reportPrivateUsage]
from attention_kv_caceh.engine.request import SamplingParams
from tests.engine_fakes import CharTokenizer, expected_ids, make_text_core, wait_for

# A process of the same user (root, in CI) that does what an attacker would: pull requests off the core's
# input and push a frame into the front end's output, until SIGTERM; then it prints what it got and sent.
_FOREIGN = r"""
import signal, sys, zmq
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL)
pull.connect(sys.argv[1])
push = ctx.socket(zmq.PUSH)
push.setsockopt(zmq.LINGER, 0)
push.connect(sys.argv[2])
print("connected", flush=True)
got = sent = 0
while not stop:
    try:
        push.send(b"\x91\xc0", zmq.NOBLOCK)  # a msgpack frame the front end cannot decode as outputs
        sent += 1
    except zmq.Again:
        pass
    if pull.poll(20):
        pull.recv_multipart()
        got += 1
print(got, sent, flush=True)
"""


class PeerPidTest(unittest.TestCase):
    def test_the_pid_is_the_last_field_of_a_unix_peer_address(self) -> None:
        self.assertEqual(_peer_pid(b"localhost:0:0:8851"), 8851)
        self.assertEqual(_peer_pid(b":1000:1000:42"), 42)
        self.assertIsNone(_peer_pid(b"127.0.0.1"))
        self.assertIsNone(_peer_pid(b"localhost:0:0:"))


class PrivateChannelsTest(unittest.TestCase):
    def test_a_foreign_process_connected_before_the_core_gets_no_request_and_injects_nothing(self) -> None:
        client = MPClient()  # bound; no core yet: the window an attacker has
        channels = client.channels
        assert channels is not None
        self.assertEqual(stat.S_IMODE(os.stat(channels.folder).st_mode), 0o700)
        foreign = subprocess.Popen(
            [sys.executable, "-c", _FOREIGN, client.input_address, client.output_address],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert foreign.stdout is not None
            self.assertEqual(foreign.stdout.readline().strip(), "connected")
            # both of its sockets knocked and were turned away (ZMQ retries; each try is refused)
            self.assertTrue(wait_for(lambda: channels.refused >= 2, 30))
            core, _runner = make_text_core(max_num_seqs=4)
            client.start_thread(core)
            self.assertFalse(channels.folder.exists())  # the socket files went once the core connected
            llm = AsyncLLM(client, CharTokenizer(), max_num_seqs=4, max_model_len=core.max_model_len)

            async def one(i: int) -> list[int]:
                params = SamplingParams(max_tokens=4, ignore_eos=True)
                stream = llm.generate([60 + i], params, f"r{i}")
                return [t async for d in stream for t in d.new_token_ids]

            async def go() -> list[list[int]]:
                llm.start()
                try:
                    return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(6))), 60)
                finally:
                    await llm.shutdown(5)

            tokens = asyncio.run(go())
        finally:
            foreign.send_signal(signal.SIGTERM)
            out, _ = foreign.communicate(timeout=30)
        got, sent = (int(x) for x in out.split())
        self.assertEqual(tokens, [expected_ids([60 + i], 4) for i in range(6)])  # every request answered
        self.assertEqual(got, 0)  # no request reached the foreign process
        self.assertGreater(sent, 0)  # it did try to inject
        self.assertIsNone(llm.errored)  # and nothing it sent was read

    def test_a_core_that_fails_to_start_leaves_no_socket_folder(self) -> None:
        made: list[str] = []
        real = tempfile.mkdtemp

        def mkdtemp(prefix: str) -> str:
            path = real(prefix=prefix)
            made.append(path)
            return path

        with mock.patch("attention_kv_caceh.engine.ipc.tempfile.mkdtemp", mkdtemp):
            started = time.monotonic()
            with self.assertRaises(EngineDeadError):
                MPClient.launch_process("/nonexistent/model", EngineConfig(), startup_timeout_s=120)
        self.assertLess(time.monotonic() - started, 120)
        self.assertEqual(len(made), 1)
        self.assertFalse(Path(made[0]).exists())

    def test_once_the_core_runs_no_process_can_connect_to_its_sockets(self) -> None:
        """/proc/net/unix still lists the bound names (the kernel keeps them), but the files are gone: a
        plain Unix-socket connect to either address fails, as a foreign ZMQ socket's would."""
        core, _runner = make_text_core(max_num_seqs=2)
        client = MPClient.launch_thread(core)
        try:
            for address in (client.input_address, client.output_address):
                path = address.removeprefix("ipc://")
                if path.startswith("@"):  # an abstract-namespace name (no file): Linux spells it with a NUL
                    path = "\0" + path[1:]
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock, self.assertRaises(OSError):
                    sock.connect(path)  # FileNotFoundError: nothing there to connect to
        finally:
            client.shutdown(5)
            client.close()


if __name__ == "__main__":
    unittest.main()
