"""The engine benchmark's arithmetic and its oracle gate, on tiny random checkpoints and tiny lengths.

Oracles: the bytes a decode step reads recomputed here from config.json alone, the decode contexts of
requests that run in lockstep (prompt P, output O: contexts P + 1 .. P + O - 1), and a model runner
that corrupts batched logits, which the gate must refuse. No assertion depends on how fast anything ran.
"""

from __future__ import annotations

import json
import tempfile
import unittest
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from attention_kv_caceh.benchmarks import engine as benchmark
from attention_kv_caceh.benchmarks.engine import run_engine_benchmark
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.engine.scheduler import SchedulerOutput
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint

PROMPT, OUT = 5, 6  # prompt and output lengths


def weights_read_per_step(config: dict[str, Any], num_seqs: int) -> int:
    """float32 bytes of every layer, the final norm, the LM head and num_seqs embedding rows."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    h, h_kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or hidden // h
    layer = hidden * (h + 2 * h_kv) * d + h * d * hidden + 3 * hidden * inter + 2 * hidden
    if config["model_type"] == "qwen2":  # q/k/v biases
        layer += (h + 2 * h_kv) * d
    if config["model_type"] == "qwen3":  # q_norm and k_norm
        layer += 2 * d
    items = config["num_hidden_layers"] * layer + hidden + config["vocab_size"] * hidden + num_seqs * hidden
    return 4 * items


def linear_weights(config: dict[str, Any]) -> int:
    """Weights of the q/k/v, o, gate/up and down projections of every layer and of the LM head."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    h, h_kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or hidden // h
    layer = hidden * (h + 2 * h_kv) * d + h * d * hidden + 3 * hidden * inter
    return config["num_hidden_layers"] * layer + config["vocab_size"] * hidden


class CorruptBatchRunner(ModelRunner):
    """Shifts request 0's logits by one token whenever more than one request is scheduled."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> np.ndarray:
        logits = super().execute_model(scheduler_output)
        if len(scheduler_output.scheduled_requests) > 1:
            logits[0] = np.roll(logits[0], 1)
        return logits


class TestEngineBenchmark(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        root = Path(cls._tmp.name)
        cls.llama = write_random_checkpoint(root / "llama", "llama", "tiny")  # untied LM head
        cls.qwen = write_random_checkpoint(root / "qwen", "qwen2", "tiny")  # tied, q/k/v biases

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def test_rows_count_tokens_steps_and_bytes_read_as_the_config_implies(self) -> None:
        for folder in (self.llama, self.qwen):
            config = json.loads((folder / "config.json").read_text())
            result = run_engine_benchmark(folder, (1, 3), prompt_len=PROMPT, output_len=OUT, probe_every=2)
            self.assertEqual([r.max_num_seqs for r in result.rows], [1, 3])
            self.assertEqual(result.environment["dtype"], "float32")
            for row in result.rows:
                r = row.max_num_seqs
                with self.subTest(folder=folder.name, max_num_seqs=r):
                    self.assertEqual(row.num_output_tokens, r * OUT)
                    self.assertEqual(row.num_decode_steps, OUT - 1)  # the first token comes from prefill
                    self.assertEqual(row.mean_num_seqs, r)
                    self.assertEqual(
                        row.mean_context_len, PROMPT + OUT / 2
                    )  # mean of PROMPT + 1 .. PROMPT + OUT - 1
                    self.assertEqual(row.weight_bytes_per_decode_step, weights_read_per_step(config, r))
                    kv_per_position = 2 * config["num_hidden_layers"] * config["num_key_value_heads"]
                    kv_per_position *= 4 * (
                        config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
                    )
                    self.assertEqual(row.kv_bytes_per_decode_step, kv_per_position * r * (PROMPT + OUT / 2))
                    self.assertEqual(
                        row.bytes_per_decode_step,
                        row.weight_bytes_per_decode_step + row.kv_bytes_per_decode_step,
                    )
                    self.assertAlmostEqual(
                        row.decode_gb_per_s, row.bytes_per_decode_step / (row.decode_step_ms_p50 * 1e6)
                    )
                    self.assertAlmostEqual(row.probe_ratio, row.decode_gb_per_s / row.probe_gb_per_s)
                    flops = 2 * r * linear_weights(config)  # per replay of the step's linear layers
                    self.assertAlmostEqual(row.linear_gflop_per_s, flops / (row.linear_ms * 1e6))
                    self.assertAlmostEqual(row.fma_ratio, row.linear_gflop_per_s / row.fma_gflop_per_s)
                    self.assertAlmostEqual(row.linear_share, row.linear_ms / row.decode_step_ms_p50)
                    self.assertGreater(row.attention_ms, 0.0)  # a pure-decode step preceded every probe
                    self.assertAlmostEqual(row.attention_share, row.attention_ms / row.decode_step_ms_p50)
                    self.assertEqual(row.gemm_path, result.environment["gemm_path"])
                    self.assertAlmostEqual(row.output_tokens_per_s * row.total_time_s, r * OUT)
                    self.assertAlmostEqual(row.decode_tokens_per_s * row.decode_time_s, r * (OUT - 1))
                    self.assertLessEqual(row.decode_step_ms_p50, row.decode_step_ms_p95)
                    self.assertGreater(row.decode_step_cpu_ms_p50, 0.0)
                    self.assertLess(row.decode_time_s, row.total_time_s)

    def test_tied_lm_head_is_counted_once(self) -> None:
        result = run_engine_benchmark(self.qwen, (2,), prompt_len=PROMPT, output_len=OUT, probe_every=3)
        hidden = json.loads((self.qwen / "config.json").read_text())["hidden_size"]
        params = result.environment["num_parameters"]
        self.assertEqual(result.rows[0].weight_bytes_per_decode_step, 4 * (params + 2 * hidden))

    def test_a_batched_run_that_differs_from_the_solo_run_is_refused(self) -> None:
        with (
            mock.patch.object(benchmark, "ModelRunner", CorruptBatchRunner),
            self.assertRaisesRegex(OracleMismatch, "max_num_seqs=2: request 0's first tokens"),
        ):
            run_engine_benchmark(self.llama, (1, 2), prompt_len=PROMPT, output_len=OUT, probe_every=3)

    def test_invalid_arguments_are_refused_before_loading(self) -> None:
        for kwargs, pattern in (
            ({"max_num_seqs_list": ()}, "max_num_seqs_list"),
            ({"max_num_seqs_list": (0,)}, "max_num_seqs_list"),
            ({"output_len": 1}, "output_len >= 2"),
            ({"oracle_tokens": OUT + 1}, "oracle_tokens"),
        ):
            with self.subTest(kwargs=kwargs), self.assertRaisesRegex(ValueError, pattern):
                run_engine_benchmark("/nonexistent", **{"prompt_len": PROMPT, "output_len": OUT, **kwargs})  # type: ignore[arg-type]
        with self.assertRaisesRegex(ValueError, "max_position_embeddings"):
            run_engine_benchmark(self.llama, (1,), prompt_len=4000, output_len=200)


if __name__ == "__main__":
    unittest.main()
