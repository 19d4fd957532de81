"""Each check of a request runs once, at the boundary that owns it: the server checks a body's fields once
(before any tokenizing), builds one SamplingParams per prompt, and the engine's own copies (a sample's
seed, the checkpoint's extra eos ids) are not validated again. The one other validation is the engine
core's msgpack decode, one per engine request (msgspec builds the dataclass through `__post_init__`),
which these counts do not see.

Oracle: the calls counted per thread against the numbers written out here.
"""

from __future__ import annotations

import collections
import tempfile
import threading
import unittest
from pathlib import Path
from typing import Any
from unittest import mock

from attention_kv_caceh.engine.core import EngineCore
from attention_kv_caceh.engine.outputs import EngineCoreRequest
from attention_kv_caceh.engine.parallel_sampling import ParentRequest
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.entrypoints.openai import serving, serving_engine
from tests.engine_fakes import make_text_core
from tests.serve_helpers import MODEL, fake_server
from tests.test_engine_server_limits import request_json


class _Counter:
    """SamplingParams.__post_init__ wrapped (`hook`, a function: it binds as a method) to count its calls
    per thread name."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        original = SamplingParams.__post_init__

        def hook(params: SamplingParams) -> None:
            self.calls[threading.current_thread().name] += 1
            original(params)

        self.hook = hook


class ServerChecksOnceTest(unittest.TestCase):
    def test_a_request_of_two_prompts_and_n_3_is_checked_once_and_builds_two_params(self) -> None:
        thread, _engine, _llm = fake_server(max_num_seqs=8)
        counter = _Counter()
        fields = mock.Mock(wraps=serving_engine.check_request_fields)
        with (
            thread,
            mock.patch.object(SamplingParams, "__post_init__", counter.hook),
            mock.patch.object(serving_engine, "check_request_fields", fields),
            mock.patch.object(serving, "check_request_fields", fields),
        ):
            body: dict[str, Any] = {
                "model": MODEL,
                "prompt": ["ab", "cd"],
                "n": 3,
                "seed": 1,
                "max_tokens": 2,
            }
            status, answer = request_json(thread.base_url, body)
            self.assertEqual(status, 200, answer)
            self.assertEqual(len(answer["choices"]), 6)
        self.assertEqual(fields.call_count, 1)  # checked once, not again per prompt
        # the core's msgpack decode is not counted: msgspec holds the __post_init__ of when its Decoder
        # was built
        self.assertEqual(sum(counter.calls.values()), 2)  # one per prompt; the six samples' are copies

    def test_a_refused_field_is_still_a_400_naming_it(self) -> None:
        thread, _engine, _llm = fake_server()
        with thread:
            body = {"model": MODEL, "prompt": "ab", "n": 0}
            status, answer = request_json(thread.base_url, body)
        self.assertEqual(status, 400)
        self.assertEqual(answer["error"]["param"], "n")


class EngineCopiesTest(unittest.TestCase):
    def test_derive_copies_without_validating_and_leaves_the_original(self) -> None:
        params = SamplingParams(max_tokens=4, seed=7, stop_token_ids=(3,))
        counter = _Counter()
        with mock.patch.object(SamplingParams, "__post_init__", counter.hook):
            child = params.derive(seed=9)
        self.assertEqual(sum(counter.calls.values()), 0)
        self.assertEqual((child.seed, params.seed), (9, 7))
        self.assertEqual(child.stop_token_ids, (3,))
        with self.assertRaises(TypeError):
            params.derive(no_such_field=1)

    def test_parallel_samples_and_extra_eos_ids_are_copies(self) -> None:
        params = SamplingParams(max_tokens=4, seed=5)
        core: EngineCore = make_text_core()[0]
        core.extra_eos_token_ids = (11, 12)
        counter = _Counter()
        with mock.patch.object(SamplingParams, "__post_init__", counter.hook):
            parent = ParentRequest("r", 3, params)
            seeds = [parent.child_info(i)[1].seed for i in range(3)]
            request = core.preprocess_add_request(EngineCoreRequest("r", [1, 2], params))
        self.assertEqual(sum(counter.calls.values()), 0)
        self.assertEqual(seeds, [5, 6, 7])
        self.assertEqual(request.sampling_params.stop_token_ids, (11, 12))


class GGUFSourceTest(unittest.TestCase):
    def test_gguf_on_a_safetensors_folder_is_refused_once_by_the_weight_reader(self) -> None:
        from attention_kv_caceh.model_executor import model_weights
        from attention_kv_caceh.model_executor.model import Model
        from attention_kv_caceh.toy_model.make_model import write_random_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            folder = write_random_checkpoint(Path(tmp) / "tiny", "llama", "tiny", seed=1)
            reader = mock.Mock(wraps=model_weights.WeightReader)
            with (
                mock.patch("attention_kv_caceh.model_executor.model.WeightReader", reader),
                self.assertRaisesRegex(ValueError, "gguf"),
            ):
                Model.load(folder, quantization="gguf")
            self.assertEqual(reader.call_count, 1)  # the check is the reader's, not load's beforehand


class BenchEngineChecksTest(unittest.TestCase):
    def test_bench_engine_refuses_a_checkpoint_as_plan_engine_does_in_the_same_order(self) -> None:
        """--quantization gguf on a Hugging Face folder whose tokenizer is also missing: both commands
        name the first of plan_engine's checks that fails, the GGUF one (bench-engine once read the
        tokenizer first, its own copy of the checks in its own order)."""
        from attention_kv_caceh.cli.common import UsageError
        from attention_kv_caceh.cli.engine_args import plan_engine
        from attention_kv_caceh.toy_model.make_model import write_random_checkpoint
        from tests.test_cli_engine import quietly

        with tempfile.TemporaryDirectory() as tmp:
            folder = write_random_checkpoint(Path(tmp) / "tiny", "llama", "tiny", seed=1)
            (folder / "tokenizer.json").unlink()
            with self.assertRaises(UsageError) as caught:
                plan_engine(str(folder), {"quantization": "gguf"})
            code, _out, err = quietly(["bench-engine", "--model", str(folder), "--quantization", "gguf"])
        self.assertEqual(code, 2)
        self.assertIn(str(caught.exception), err)
        self.assertIn("--quantization gguf", err)


if __name__ == "__main__":
    unittest.main()
