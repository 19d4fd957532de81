"""The harness and speculative decoding: the spec-decode counters diffed around a run as `vllm bench serve`
diffs them, the copy-heavy workload, and one real run against `serve --speculative-config`.

Oracles: the figures computed by hand from a vLLM-shaped exposition; the engine's own step counts (read
from the server after the run) against the harness's counter differences.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import numpy as np

from attention_kv_caceh.harness.copy_workload import COPY_SENTENCES, copy_prompt, copy_specs
from attention_kv_caceh.harness.load import LengthRange
from attention_kv_caceh.harness.server_counters import (
    counter_delta,
    parse_counters,
    spec_decode_result,
)
from attention_kv_caceh.harness.summary_text import spec_decode_lines
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint


def exposition(drafts: int, drafted: int, accepted: int, per_pos: list[int]) -> str:
    lines = [
        "# TYPE vllm:spec_decode_num_drafts counter",
        f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9',
        "# TYPE vllm:spec_decode_num_draft_tokens counter",
        f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {drafted}.0',
        "# TYPE vllm:spec_decode_num_accepted_tokens counter",
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}.0',
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
    ]
    lines += [
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{i}"}} {n}.0'
        for i, n in enumerate(per_pos)
    ]
    return "\n".join(lines) + "\n"


class SpecDecodeCountersTest(unittest.TestCase):
    def test_acceptance_as_vllm_bench_serve_reports_it(self) -> None:
        before = parse_counters(exposition(10, 40, 20, [8, 6, 4, 2]))
        after = parse_counters(exposition(30, 120, 50, [24, 14, 8, 4]))
        self.assertEqual(dict(after.accepted_per_pos), {0: 24.0, 1: 14.0, 2: 8.0, 3: 4.0})
        delta = counter_delta(before, after, client_prompt_tokens=0, client_output_tokens=0)
        spec = delta["spec_decode"]
        self.assertEqual((spec["num_drafts"], spec["draft_tokens"], spec["accepted_tokens"]), (20, 80, 30))
        self.assertAlmostEqual(spec["acceptance_rate"], 100 * 30 / 80)
        self.assertAlmostEqual(spec["acceptance_length"], 1 + 30 / 20)
        self.assertEqual(spec["per_position_acceptance_rates"], [16 / 20, 8 / 20, 4 / 20, 2 / 20])
        result = spec_decode_result(delta)
        self.assertEqual(result["spec_decode_num_drafts"], 20)
        self.assertAlmostEqual(result["spec_decode_acceptance_length"], 2.5)
        (line,) = spec_decode_lines(result)
        self.assertIn("acceptance rate 37.50 %", line)
        self.assertIn("per position (%): 80.0, 40.0, 20.0, 10.0", line)

    def test_nothing_without_drafts_or_without_the_counters(self) -> None:
        same = parse_counters(exposition(3, 9, 2, [2]))
        self.assertIsNone(
            counter_delta(same, same, client_prompt_tokens=0, client_output_tokens=0)["spec_decode"]
        )
        plain = parse_counters("# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total 5.0\n")
        delta = counter_delta(plain, plain, client_prompt_tokens=5, client_output_tokens=0)
        self.assertIsNone(delta["spec_decode"])
        self.assertEqual(spec_decode_result(delta), {})
        self.assertEqual(spec_decode_lines({}), [])


class CopyWorkloadTest(unittest.TestCase):
    def test_prompts_hold_a_passage_of_the_asked_length_and_one_change(self) -> None:
        for words in (1, 40, 120, 10_000):
            with self.subTest(words=words):
                prompt = copy_prompt(np.random.default_rng(words), words)
                passage = prompt.split("Passage:\n")[1].split("\n\nRepeated passage:")[0]
                self.assertGreaterEqual(
                    len(passage.split()), min(words, sum(len(s.split()) for s in COPY_SENTENCES))
                )
                old = prompt.split('instead of "')[1].split('"')[0]
                self.assertIn(f" {old} ", f" {passage} ")
                self.assertTrue(prompt.endswith("Repeated passage:\n"))

    def test_specs_repeat_with_the_seed(self) -> None:
        def specs(seed: int) -> list[str]:
            rng = np.random.default_rng(seed)
            return [s.prompt for s in copy_specs(5, LengthRange(30, 60), LengthRange(8, 8), rng, seed)]

        self.assertEqual(specs(1), specs(1))
        self.assertNotEqual(specs(1), specs(2))
        (spec,) = copy_specs(1, LengthRange(30, 30), LengthRange(8, 8), np.random.default_rng(0), 0)
        self.assertTrue(spec.from_dataset)
        self.assertEqual(spec.output_tokens, 8)


class HarnessAgainstSpeculativeServeTest(unittest.TestCase):
    def test_the_summary_reports_the_servers_acceptance(self) -> None:
        config = (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
        )
        with tempfile.TemporaryDirectory() as d:
            model = write_random_checkpoint(Path(d) / "tiny", "llama", "tiny", seed=0)
            summary_path = Path(d) / "s.json"
            argv = [
                sys.executable,
                "-c",
                "import sys; from attention_kv_caceh.cli import main; sys.exit(main())",
            ]
            argv += ["harness", "--backend", "engine", "--model", str(model), "--speculative-config", config]
            argv += ["--workload", "copy", "--num-requests", "4", "--concurrency", "2", "--prompt-len", "20"]
            argv += [
                "--output-len",
                "24",
                "--ignore-eos",
                "--temperature",
                "0",
                "--summary-json",
                str(summary_path),
            ]
            env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
            done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
            self.assertEqual(done.returncode, 0, done.stderr)
            summary = json.loads(summary_path.read_text())
        self.assertEqual(summary["completed"], 4)
        self.assertEqual(
            summary["server"]["flags"][-2:],
            ["--speculative-config", json.dumps(json.loads(config), separators=(",", ":"))],
        )
        spec = summary["server_counters"]["spec_decode"]
        self.assertGreater(spec["draft_tokens"], 0)
        self.assertEqual(summary["spec_decode_draft_tokens"], spec["draft_tokens"])
        self.assertAlmostEqual(
            summary["spec_decode_acceptance_rate"], 100 * spec["accepted_tokens"] / spec["draft_tokens"]
        )
        self.assertEqual(summary["server_counters"]["generation_tokens"], 4 * 24)
        self.assertIn("speculative decoding: acceptance rate", done.stdout)


if __name__ == "__main__":
    unittest.main()
