"""The budget on large bodies served at once (entrypoints/openai/body_budget.py): past it a body gets 503 with
Retry-After before it is read, whatever the endpoint and however the body is sent; the budget comes back
when the requests end, and a body over --max-request-bytes still gets its 413."""

from __future__ import annotations

import asyncio
import json
import time
import unittest
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from attention_kv_caceh.entrypoints.openai.body_budget import LARGE_BODY_BYTES
from tests.serve_helpers import MODEL, fake_server

PAD = "x" * (LARGE_BODY_BYTES + 40_000)  # an ignored field that makes a body large


def big(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "a", "max_tokens": 3, "padding": PAD, **fields}


async def status_of(resp: aiohttp.ClientResponse) -> tuple[int, str | None, Any]:
    text = await resp.text()
    return resp.status, resp.headers.get("Retry-After"), json.loads(text) if text.startswith("{") else text


class BodyBudgetTest(unittest.TestCase):
    def test_a_large_body_past_the_budget_is_a_503_with_retry_after_until_the_budget_is_back(self) -> None:
        limit = LARGE_BODY_BYTES * 2  # room for one large body and a bit
        thread, engine, llm = fake_server(max_request_bytes=limit, max_request_bytes_in_flight=limit)
        engine.gate.clear()

        async def chunked() -> AsyncIterator[bytes]:
            data = json.dumps(big()).encode()
            for i in range(0, len(data), 65536):
                yield data[i : i + 65536]

        async def go(url: str) -> dict[str, Any]:
            got: dict[str, Any] = {}
            async with aiohttp.ClientSession() as session:
                # one large streamed request holds its body's bytes while it runs (held at the gate)
                held = await session.post(url + "/v1/completions", json=big(stream=True))
                got["held"] = held.status
                for name, path, body in (
                    ("completions", "/v1/completions", big()),
                    (
                        "chat",
                        "/v1/chat/completions",
                        {**big(), "messages": [{"role": "user", "content": "a"}]},
                    ),
                    ("tokenize", "/tokenize", {"prompt": "a", "padding": PAD}),
                ):
                    async with session.post(url + path, json=body) as resp:
                        got[name] = await status_of(resp)
                async with session.post(
                    url + "/v1/completions", data=chunked(), headers={"Content-Type": "application/json"}
                ) as resp:
                    got["chunked"] = await status_of(resp)
                over = {"prompt": "a", "padding": "y" * (limit + 1)}
                async with session.post(url + "/v1/completions", json=over) as resp:
                    got["over"] = await status_of(resp)
                async with session.post(url + "/tokenize", json={"prompt": "ab"}) as resp:
                    got["small"] = await status_of(resp)  # small bodies are not counted
                got["waiting"] = llm.num_unfinished
                engine.gate.set()
                got["held_text"] = await held.text()
                held.release()
                # the budget comes back when the stream's request ends (just after its last byte left,
                # so a client as quick as this one may still get one 503: it retries as Retry-After says)
                for _ in range(30):
                    async with session.post(url + "/v1/completions", json=big()) as resp:
                        got["after"] = await status_of(resp)
                    if got["after"][0] != 503:
                        break
                    await asyncio.sleep(float(got["after"][1]) / 10)
                for _ in range(30):  # again: the request before returns its bytes just after its answer
                    async with session.post(
                        url + "/v1/completions", data=chunked(), headers={"Content-Type": "application/json"}
                    ) as resp:
                        got["chunked_after"] = await status_of(resp)
                    if got["chunked_after"][0] != 503:
                        break
                    await asyncio.sleep(0.1)
            return got

        with (
            thread,
            self.assertLogs("attention_kv_caceh.entrypoints.openai.api_server", "WARNING"),
        ):  # `padding` ignored
            got = asyncio.run(go(thread.base_url))
        self.assertEqual(got["held"], 200)
        for name in ("completions", "chat", "tokenize", "chunked"):
            with self.subTest(name):
                status, retry, body = got[name]
                self.assertEqual((status, retry), (503, "1"))
                self.assertEqual(body["error"]["code"], 503)
                self.assertIn("--max-request-bytes-in-flight", body["error"]["message"])
        self.assertEqual(got["over"][0], 413)
        self.assertEqual(got["small"][0], 200)
        self.assertEqual(got["waiting"], 1)  # the refused bodies never reached the engine
        self.assertIn("[DONE]", got["held_text"])
        self.assertEqual(got["after"][0], 200)
        self.assertEqual(got["chunked_after"][0], 200)


class StalledBodyTest(unittest.TestCase):
    def test_a_large_body_that_stops_arriving_gets_408_and_gives_its_budget_back(self) -> None:
        """A client declares a large body (or sends part of a chunked one) and then sends nothing: after
        BODY_TIMEOUT_S it gets 408 with OpenAI's error body, and a body of the whole budget's size is
        served next, so the stalled one held nothing."""
        import socket
        from unittest import mock
        from urllib.parse import urlsplit

        limit = LARGE_BODY_BYTES * 2
        thread, _engine, _llm = fake_server(max_request_bytes=limit, max_request_bytes_in_flight=limit)

        def stalled(head: bytes, first: bytes) -> tuple[int, bytes]:
            parts = urlsplit(thread.base_url)
            with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
                sock.sendall(head + first)
                data = b""
                while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    data += chunk
            status = int(data.split(b" ", 2)[1]) if data else 0
            return status, data

        start = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        declared = start + f"Content-Length: {LARGE_BODY_BYTES + 10}\r\n\r\n".encode()
        piece = b"x" * (LARGE_BODY_BYTES + 10)
        chunked = start + b"Transfer-Encoding: chunked\r\n\r\n"
        with thread, mock.patch("attention_kv_caceh.entrypoints.openai.body_budget.BODY_TIMEOUT_S", 0.5):
            declared_status, declared_reply = stalled(declared, b'{"prompt": "')
            for _ in range(30):  # the first one's bytes return just after its answer left
                chunked_status, _ = stalled(chunked, f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                if chunked_status != 503:
                    break
                time.sleep(0.1)
            with self.assertLogs("attention_kv_caceh.entrypoints.openai.api_server", "WARNING"):
                status, _retry, body = asyncio.run(self.one_big(thread.base_url, limit - 1000))
        self.assertEqual(declared_status, 408, declared_reply)
        self.assertIn(b'"code":408', declared_reply)
        self.assertEqual(chunked_status, 408)
        self.assertEqual(status, 200, body)

    @staticmethod
    async def one_big(url: str, size: int) -> tuple[int, str | None, Any]:
        body = {"model": MODEL, "prompt": "a", "max_tokens": 2, "padding": "x" * size}
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/v1/completions", json=body) as resp,
        ):
            return await status_of(resp)


def _urllib_status(url: str, body: bytes) -> int | str:
    """Status of a POST by Python's urllib, which writes its whole body before it reads; the error's
    repr when the connection was reset under it."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError) as exc:
        return repr(exc)


class RefusalsReadTheBodyTest(unittest.TestCase):
    def test_a_client_that_writes_its_whole_body_first_reads_its_503_or_401(self) -> None:
        # a body larger than the sockets' buffers, so that unread bytes would reset the connection
        body = json.dumps({**big(), "padding": "x" * 7_800_000}).encode()
        limit = len(body) + 100_000
        thread, engine, _llm = fake_server(max_request_bytes=limit, max_request_bytes_in_flight=limit)
        engine.gate.clear()

        async def held_then(url: str) -> tuple[int, int | str]:
            async with aiohttp.ClientSession() as session:
                held = await session.post(url + "/v1/completions", json=big(stream=True))
                status = await asyncio.to_thread(_urllib_status, url + "/v1/completions", body)
                engine.gate.set()
                await held.text()
                return held.status, status

        with thread, self.assertLogs("attention_kv_caceh.entrypoints.openai.api_server", "WARNING"):
            held, refused = asyncio.run(held_then(thread.base_url))
        self.assertEqual((held, refused), (200, 503))
        keyed, _engine, _llm = fake_server(max_request_bytes=limit, api_key="k")
        with keyed:
            self.assertEqual(_urllib_status(keyed.base_url + "/v1/completions", body), 401)

    def test_a_declared_body_holds_only_the_bytes_that_arrived(self) -> None:
        """Four clients declare a body as large as the budget and send nothing: a large body is still
        served beside them (the budget counts bytes received, not Content-Length)."""
        import socket
        from urllib.parse import urlsplit

        limit = LARGE_BODY_BYTES * 2
        thread, _engine, _llm = fake_server(max_request_bytes=limit, max_request_bytes_in_flight=limit)
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {limit}\r\n\r\n".encode()
        )
        with thread:
            parts = urlsplit(thread.base_url)
            stalled = [socket.create_connection((parts.hostname, parts.port), timeout=30) for _ in range(4)]
            try:
                for sock in stalled:
                    sock.sendall(head + b'{"prompt": "')
                time.sleep(0.2)
                with self.assertLogs("attention_kv_caceh.entrypoints.openai.api_server", "WARNING"):
                    status, _retry, body = asyncio.run(StalledBodyTest.one_big(thread.base_url, limit - 1000))
            finally:
                for sock in stalled:
                    sock.close()
        self.assertEqual(status, 200, body)


class TokenizeWeightTest(unittest.TestCase):
    def test_a_tokenize_body_counts_four_times_its_size_and_one_is_always_served(self) -> None:
        """The middleware alone over an app that holds every request until released."""
        from attention_kv_caceh.entrypoints.openai.body_budget import TOKENIZE_WEIGHT, BodyBudgetMiddleware

        size = LARGE_BODY_BYTES
        release = asyncio.Event()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await receive()  # the budget counts the bytes as the app reads them
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        async def call(budget: BodyBudgetMiddleware, path: str) -> int:
            scope = {"type": "http", "path": path, "headers": [(b"content-length", str(size).encode())]}
            statuses: list[int] = []

            async def receive() -> dict[str, Any]:
                return {"type": "http.request", "body": b"x" * size, "more_body": False}

            async def send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])

            await budget(scope, receive, send)
            return statuses[0]

        async def go() -> tuple[list[int], list[int], list[int], int]:
            budget = BodyBudgetMiddleware(
                app, max_bytes_in_flight=2 * size * TOKENIZE_WEIGHT - 1, max_request_bytes=size
            )
            completions = [asyncio.ensure_future(call(budget, "/v1/completions")) for _ in range(2)]
            tokenize = [asyncio.ensure_future(call(budget, "/tokenize")) for _ in range(2)]
            await asyncio.sleep(0.05)
            refused = [t.result() for t in tokenize if t.done()]
            release.set()
            first = await asyncio.gather(*completions)
            rest = [await t for t in tokenize]
            small = BodyBudgetMiddleware(app, max_bytes_in_flight=size, max_request_bytes=size)
            alone = await call(small, "/tokenize")  # weighted past the whole budget: still served alone
            return refused, first, rest, alone

        refused, completions, tokenize, alone = asyncio.run(go())
        self.assertEqual(refused, [503])  # the second /tokenize did not fit beside two bodies and the first
        self.assertEqual(completions, [200, 200])
        self.assertEqual(sorted(tokenize), [200, 503])
        self.assertEqual(alone, 200)


if __name__ == "__main__":
    unittest.main()


class PromptFormMemoryTest(unittest.TestCase):
    def test_a_long_token_id_prompt_is_validated_as_ids_only(self) -> None:
        """Validating `prompt` as a union tried each form; a failed form kept one error per item, so an
        8 MB list of 4 M ids cost about 1 GB in errors (as a list of strings) before it was refused.
        Peak RSS of a fresh process around the validation: a small multiple of the body; and each form
        still validates, a wrong one still names `prompt`."""
        import subprocess
        import sys

        script = """
import gc, json, resource
from attention_kv_caceh.entrypoints.openai.protocol import CompletionRequest, DetokenizeRequest
body = json.dumps({"prompt": [5] * 4_000_000}, separators=(",", ":")).encode()
data = json.loads(body)
tokens = json.loads(json.dumps({"tokens": [[5] * 1000] * 2000}))
gc.collect()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
request = CompletionRequest.model_validate(data)
DetokenizeRequest.model_validate(tokens)
print(len(body), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base, len(request.prompt))
"""
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        self.assertEqual(out.returncode, 0, out.stderr)
        size, grew, n = (int(x) for x in out.stdout.split())
        self.assertEqual(n, 4_000_000)
        self.assertLess(grew, 10 * size)  # the validated copies of the lists: 8 bytes a slot (was 131 x)

        from pydantic import ValidationError

        from attention_kv_caceh.entrypoints.openai.protocol import CompletionRequest, validation_error

        for prompt in ("a", ["a", "b"], [1, 2], [[1], [2, 3]], []):
            self.assertEqual(CompletionRequest.model_validate({"prompt": prompt}).prompt, prompt)
        for bad in (5, [1, "a"], ["a", 1], [[1], "a"], [True], {"a": 1}, [1.5]):
            with self.subTest(bad=bad), self.assertRaises(ValidationError) as caught:
                CompletionRequest.model_validate({"prompt": bad})
            errors = [{**e, "loc": ("body", *e["loc"])} for e in caught.exception.errors()]
            self.assertEqual(validation_error(errors)[2], "prompt")
