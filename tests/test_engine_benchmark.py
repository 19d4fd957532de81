"""The engine benchmark's arithmetic and its oracle gate, on tiny random checkpoints and tiny lengths.

Oracles: the bytes a decode step reads recomputed here from config.json and the panel width of the kernel
variant in effect (the packer's width for one output; NumPy's path has no padding), the decode contexts of
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
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.engine.scheduler import SchedulerOutput
from attention_kv_caceh.kernels.gemm import pack_weight
from attention_kv_caceh.oracle import OracleMismatch
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint

PROMPT, OUT = 5, 6  # prompt and output lengths


def panel_width(gemm_path: str) -> int:
    """NR of the float32 panels the packed path stores on this variant (32 on AVX-512, 12 on AVX2 and
    NEON): the padded width of a one-output weight as the packer lays it out; 1 for NumPy's path."""
    if gemm_path != "packed":
        return 1
    return pack_weight(np.ones((1, 1), dtype=np.float32)).padded_out_features


def linear_shapes(config: dict[str, Any]) -> list[tuple[int, int]]:
    """(N, K) of every linear weight a decode step reads: each layer's fused qkv, o, fused gate/up and
    down projections, and the LM head."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    h, h_kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or hidden // h
    layer = [((h + 2 * h_kv) * d, hidden), (hidden, h * d), (2 * inter, hidden), (hidden, inter)]
    return config["num_hidden_layers"] * layer + [(config["vocab_size"], hidden)]


def panel_padding_bytes(config: dict[str, Any], nr: int) -> int:
    """float32 bytes of the zero columns packing adds: N rounded up to a multiple of NR, for each weight."""
    return 4 * sum((-(-n // nr) * nr - n) * k for n, k in linear_shapes(config))


def weights_read_per_step(config: dict[str, Any], num_seqs: int, nr: int) -> int:
    """float32 bytes of every layer, the final norm, the LM head and num_seqs embedding rows, linear
    weights padded to panels of width nr."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    h, h_kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or hidden // h
    layer = hidden * (h + 2 * h_kv) * d + h * d * hidden + 3 * hidden * inter + 2 * hidden
    if config["model_type"] == "qwen2":  # q/k/v biases
        layer += (h + 2 * h_kv) * d
    if config["model_type"] == "qwen3":  # q_norm and k_norm
        layer += 2 * d
    items = config["num_hidden_layers"] * layer + hidden + config["vocab_size"] * hidden + num_seqs * hidden
    return 4 * items + panel_padding_bytes(config, nr)


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
            nr = panel_width(result.environment["gemm_path"])
            for row in result.rows:
                r = row.max_num_seqs
                with self.subTest(folder=folder.name, max_num_seqs=r):
                    self.assertEqual(row.num_output_tokens, r * OUT)
                    self.assertEqual(row.num_decode_steps, OUT - 1)  # the first token comes from prefill
                    self.assertEqual(row.mean_num_seqs, r)
                    self.assertEqual(
                        row.mean_context_len, PROMPT + OUT / 2
                    )  # mean of PROMPT + 1 .. PROMPT + OUT - 1
                    self.assertEqual(row.weight_bytes_per_decode_step, weights_read_per_step(config, r, nr))
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
                    self.assertEqual(row.threads, EngineConfig().resolved_threads())  # the default
                    self.assertTrue(1.0 <= row.mean_threads <= row.threads)  # what the load left of it

    def test_a_given_thread_count_is_every_steps(self) -> None:
        result = run_engine_benchmark(self.llama, (2,), prompt_len=PROMPT, output_len=OUT, threads=1)
        self.assertEqual((result.rows[0].threads, result.rows[0].mean_threads), (1, 1.0))

    def test_tied_lm_head_is_counted_once(self) -> None:
        result = run_engine_benchmark(self.qwen, (2,), prompt_len=PROMPT, output_len=OUT, probe_every=3)
        config = json.loads((self.qwen / "config.json").read_text())
        params = result.environment["num_parameters"]
        padding = panel_padding_bytes(config, panel_width(result.environment["gemm_path"]))
        self.assertEqual(
            result.rows[0].weight_bytes_per_decode_step, 4 * (params + 2 * config["hidden_size"]) + padding
        )

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
