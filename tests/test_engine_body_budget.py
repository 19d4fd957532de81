"""The budget on large bodies served at once (engine/body_budget.py): past it a body gets 503 with
Retry-After before it is read, whatever the endpoint and however the body is sent; the budget comes back
when the requests end, and a body over --max-request-bytes still gets its 413."""

from __future__ import annotations

import asyncio
import json
import unittest
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from attention_kv_caceh.engine.body_budget import LARGE_BODY_BYTES
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
                async with session.post(
                    url + "/v1/completions", data=chunked(), headers={"Content-Type": "application/json"}
                ) as resp:
                    got["chunked_after"] = await status_of(resp)
            return got

        with thread, self.assertLogs("attention_kv_caceh.engine.server", "WARNING"):  # `padding` ignored
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


if __name__ == "__main__":
    unittest.main()
