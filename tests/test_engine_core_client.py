"""MPClient's send path: sends queue in the front end while the core is not reading, in order, and a core
is declared dead only when it has exited."""

from __future__ import annotations

import os
import threading
import time
import unittest

from attention_kv_caceh.engine.core import EngineCoreProc, EngineCoreRequest
from attention_kv_caceh.engine.core_client import EngineDeadError, MPClient
from attention_kv_caceh.engine.request import SamplingParams
from tests.engine_fakes import expected_ids, make_text_core


class MPClientSendTest(unittest.TestCase):
    def test_frames_sent_before_the_core_connects_wait_in_the_front_end_and_arrive_in_order(self) -> None:
        """With no peer connected a PUSH socket takes nothing (zmq.Again): the frames wait in the client
        and the output loop sends them once the core's input socket connects; an abort sent after an add
        is applied after it."""
        client = MPClient()
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        client.add_request(EngineCoreRequest("kept", [40], params))
        client.add_request(
            EngineCoreRequest("aborted", [41], SamplingParams(max_tokens=200, ignore_eos=True))
        )
        client.abort_requests(["aborted"])
        self.assertEqual(len(client._pending), 3)  # pyright: ignore[reportPrivateUsage]
        self.assertIsNone(client.dead)
        core, _runner = make_text_core()
        if client.channels is not None:  # the private channels admit only the core's process (ipc.py)
            client.channels.admit(os.getpid())
        client.proc = EngineCoreProc(core, client.input_address, client.output_address)
        client.thread = threading.Thread(target=client.proc.run, daemon=True)
        client.thread.start()
        tokens: dict[str, list[int]] = {"kept": [], "aborted": []}
        reasons: dict[str, str] = {}
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                outputs = client.get_output(0.2)
                for out in [] if outputs is None else outputs.outputs:
                    tokens[out.request_id].extend(out.new_token_ids)
                    if out.finish_reason is not None:
                        reasons[out.request_id] = out.finish_reason
                if "kept" in reasons and not core.has_unfinished_requests():
                    break
        finally:
            client.shutdown(5.0)
            client.close()
        self.assertEqual(tokens["kept"], expected_ids([40], 3))
        self.assertEqual(reasons.get("kept"), "length")
        self.assertLess(len(tokens["aborted"]), 200)  # the abort reached the core after its add
        self.assertNotIn("aborted", reasons)
        self.assertFalse(core.has_unfinished_requests())

    def test_a_shut_down_client_refuses_to_send(self) -> None:
        client = MPClient()
        client.close()
        with self.assertRaises(EngineDeadError):
            client.add_request(EngineCoreRequest("late", [1], SamplingParams()))


if __name__ == "__main__":
    unittest.main()
