"""`bench-engine`: rows and arithmetic of what it writes, its usage errors (never its speed)."""

from __future__ import annotations

import json
import shutil
import statistics
import unittest
from unittest import mock

from tests.test_cli_engine import EngineCommandCase, quietly


class BenchEngineCommandTest(EngineCommandCase):
    def test_one_row_per_max_num_seqs_with_every_output_token_counted(self) -> None:
        out_json = self.out / "bench.json"
        code, out, err = quietly(
            [
                *("bench-engine", "--model", str(self.model), "--max-num-seqs", "3", "1"),
                *("--prompt-len", "9", "--output-len", "5", "--json", str(out_json)),
            ]
        )
        self.assertEqual(code, 0, err)
        rows = json.loads(out_json.read_text(encoding="utf-8"))["rows"]
        self.assertEqual([r["max_num_seqs"] for r in rows], [1, 3])  # sorted, one run each
        for r in rows:
            self.assertEqual(r["num_output_tokens"], r["max_num_seqs"] * 5)
            self.assertAlmostEqual(r["output_tokens_per_s"], r["num_output_tokens"] / r["total_time_s"])
            self.assertAlmostEqual(r["probe_ratio"], r["decode_gb_per_s"] / r["probe_gb_per_s"])
            self.assertAlmostEqual(r["linear_share"], r["linear_ms"] / r["decode_step_ms_p50"])
            self.assertAlmostEqual(r["attention_share"], r["attention_ms"] / r["decode_step_ms_p50"])
            self.assertAlmostEqual(r["fma_ratio"], r["linear_gflop_per_s"] / r["fma_gflop_per_s"])
            self.assertIn(r["gemm_path"], ("packed", "numpy"))
            self.assertGreater(r["core_step_cpu_ms_p50"], 0)
        gain = rows[1]["output_tokens_per_s"] / rows[0]["output_tokens_per_s"]
        self.assertIn(f"batching gain: {gain:.2f}x", out)
        last = json.loads(out.strip().splitlines()[-1])
        self.assertEqual(last["max_num_seqs"], [1, 3])

    def test_gemm_flag_picks_the_path_every_row_reports(self) -> None:
        out_json = self.out / "numpy.json"
        code, _, err = quietly(
            [
                *("bench-engine", "--model", str(self.model), "--max-num-seqs", "2", "--gemm", "numpy"),
                *("--prompt-len", "3", "--output-len", "3", "--json", str(out_json)),
            ]
        )
        self.assertEqual(code, 0, err)
        rows = json.loads(out_json.read_text(encoding="utf-8"))["rows"]
        self.assertEqual([r["gemm_path"] for r in rows], ["numpy"])

    def test_output_lengths_below_the_oracles_four_tokens_run(self) -> None:
        for output_len in ("2", "3"):
            with self.subTest(output_len=output_len):
                code, out, err = quietly(
                    [
                        *("bench-engine", "--model", str(self.model), "--max-num-seqs", "2"),
                        *("--prompt-len", "3", "--output-len", output_len),
                    ]
                )
                self.assertEqual(code, 0, err)
                last = json.loads(out.strip().splitlines()[-1])
                self.assertEqual(last["max_num_seqs"], [2])

    def test_token_budget_is_used_as_given_with_a_longer_prompt_prefilled_in_chunks(self) -> None:
        from attention_kv_caceh.benchmarks import engine as benchmark

        budgets: list[int] = []
        real = benchmark.EngineConfig

        def recording(**kwargs):  # type: ignore[no-untyped-def]
            budgets.append(kwargs["max_num_batched_tokens"])
            return real(**kwargs)

        with mock.patch.object(benchmark, "EngineConfig", recording):
            code, out, err = quietly(
                [
                    *("bench-engine", "--model", str(self.model), "--max-num-seqs", "2"),
                    *("--prompt-len", "9", "--output-len", "3", "--max-num-batched-tokens", "4"),
                ]
            )
        self.assertEqual(code, 0, err)
        self.assertEqual(budgets, [4])  # not raised to prompt + output length (12)
        self.assertEqual(json.loads(out.strip().splitlines()[-1])["max_num_seqs"], [2])

    def test_usage_errors_exit_2_with_one_line_and_write_nothing(self) -> None:
        out_json = self.out / "b.json"
        no_tokenizer = self.out / "no-tokenizer"
        shutil.copytree(self.model, no_tokenizer)
        (no_tokenizer / "tokenizer.json").unlink()
        cases = {
            "no config": ["--model", str(self.out)],
            "no tokenizer.json": ["--model", str(no_tokenizer)],
            "too long": ["--model", str(self.model), "--prompt-len", "2048", "--output-len", "8"],
            "one output token": ["--model", str(self.model), "--output-len", "1"],
            "zero seqs": ["--model", str(self.model), "--max-num-seqs", "0"],
            "packed float64": ["--model", str(self.model), "--gemm", "packed", "--dtype", "float64"],
            "default budget below a max_num_seqs": ["--model", str(self.model), "--max-num-seqs", "1", "600"],
            "budget below max_num_seqs": [
                *("--model", str(self.model), "--max-num-seqs", "4", "--max-num-batched-tokens", "2"),
            ],
        }
        for name, flags in cases.items():
            with self.subTest(name):
                code, out, err = quietly(["bench-engine", *flags, "--json", str(out_json)])
                self.assertEqual((code, out), (2, ""), err)
                self.assertEqual(len(err.strip().splitlines()), 1, err)
                self.assertFalse(out_json.exists())


if __name__ == "__main__":
    unittest.main()


class BenchEngineSamplingTest(EngineCommandCase):
    def outputs(self, *flags: str) -> tuple[list[list[list[int]]], str]:
        """Every (solo, batched) run's output token ids of one bench-engine command, and its stdout."""
        from attention_kv_caceh.benchmarks import engine as benchmark

        runs: list[list[list[int]]] = []
        real = benchmark._run  # pyright: ignore[reportPrivateUsage]

        def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
            result = real(*args, **kwargs)
            runs.append(result[0])
            return result

        with mock.patch.object(benchmark, "_run", recording):
            code, out, err = quietly(
                [
                    *("bench-engine", "--model", str(self.model), "--max-num-seqs", "3"),
                    *("--prompt-len", "5", "--output-len", "12", *flags),
                ]
            )
        self.assertEqual(code, 0, err)
        return runs, out

    def test_a_seeded_temperature_run_is_reproducible_and_differs_from_greedy(self) -> None:
        first, out = self.outputs("--temperature", "1.5", "--seed", "7")
        self.assertIn("temperature 1.5, seed 7", out.splitlines()[0])
        again, _ = self.outputs("--temperature", "1.5", "--seed", "7")
        self.assertEqual(first, again)  # same seed, same prompts and draws: same tokens
        greedy, out = self.outputs("--seed", "7")  # the same prompts, argmax
        self.assertIn("greedy (temperature 0), seed 7", out.splitlines()[0])
        self.assertNotEqual(first[1], greedy[1])  # the batched run sampled
        self.assertEqual([len(o) for o in first[1]], [12, 12, 12])

    def test_a_negative_temperature_exits_2_naming_it(self) -> None:
        code, out, err = quietly(["bench-engine", "--model", str(self.model), "--temperature", "-1"])
        self.assertEqual((code, out), (2, ""))
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn("--temperature", err)

    def test_a_seed_past_64_bits_exits_2_naming_it_as_serve_refuses_it(self) -> None:
        for seed in (str(2**63), "-1"):
            code, out, err = quietly(["bench-engine", "--model", str(self.model), "--seed", seed])
            self.assertEqual((code, out), (2, ""))
            self.assertEqual(len(err.splitlines()), 1, err)
            self.assertIn("--seed", err)


class BenchEngineSpeculativeTest(EngineCommandCase):
    SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'

    def test_with_and_without_speculation_in_one_run(self) -> None:
        out_json = self.out / "spec.json"
        for workload in ("random", "copy"):
            with self.subTest(workload=workload):
                code, out, err = quietly(
                    [
                        *("bench-engine", "--model", str(self.model), "--max-num-seqs", "2", "1"),
                        *("--prompt-len", "6", "--output-len", "12", "--speculative-config", self.SPEC),
                        *("--workload", workload, "--pairs", "2", "--json", str(out_json)),
                    ]
                )
                self.assertEqual(code, 0, err)
                rows = json.loads(out_json.read_text(encoding="utf-8"))["rows"]
                self.assertEqual([r["max_num_seqs"] for r in rows], [1, 2])
                for r in rows:
                    for ratio, on, off, median in (
                        ("tok_s_ratio", "runs_tok_s_on", "runs_tok_s_off", "output_tokens_per_s_on"),
                        ("tpot_ratio", "runs_tpot_ms_on", "runs_tpot_ms_off", "tpot_ms_on"),
                    ):
                        pairs = [a / b for a, b in zip(r[on], r[off], strict=True)]
                        self.assertAlmostEqual(
                            r[ratio], statistics.median(pairs)
                        )  # a pair's runs side by side
                        self.assertAlmostEqual(r[median], statistics.median(r[on]))
                        self.assertEqual(len(r[on]), 2)
                    self.assertLessEqual(r["num_accepted_tokens"], r["num_draft_tokens"])
                    self.assertEqual(r["pairs"], 2)
                    if r["num_drafts"]:
                        self.assertAlmostEqual(
                            r["acceptance_length"], 1 + r["num_accepted_tokens"] / r["num_drafts"]
                        )
                        self.assertGreater(r["verify_rows_mean"], r["max_num_seqs"] - 1)
                last = json.loads(out.strip().splitlines()[-1])
                self.assertEqual(last["max_num_seqs"], [1, 2])
                self.assertEqual(last["tpot_ms"], [r["tpot_ms_on"] for r in rows])
                self.assertIn("accept len", out)

    def test_workload_and_pairs_need_a_speculative_config(self) -> None:
        for extra in (["--workload", "copy"], ["--pairs", "3"]):
            with self.subTest(extra=extra):
                code, _, err = quietly(["bench-engine", "--model", str(self.model), *extra])
                self.assertEqual(code, 2)
                self.assertIn("needs --speculative-config", err)


class BenchEngineThreadsWarningTest(EngineCommandCase):
    def test_an_explicit_count_beside_a_busy_cpu_warns_once_before_the_benchmark(self) -> None:
        from attention_kv_caceh import cpu_load
        from attention_kv_caceh.benchmarks import bench_engine
        from attention_kv_caceh.cpus import numba_pool_size, usable_cpus
        from attention_kv_caceh.oracle import OracleMismatch

        if usable_cpus().count < 2 or numba_pool_size() < 2:
            self.skipTest("needs two usable CPUs and a Numba pool of two")
        with (
            mock.patch.object(cpu_load, "measure_others_busy", return_value=1.0),
            mock.patch.object(bench_engine, "bench_engine", side_effect=OracleMismatch("stopped here")),
        ):
            code, _, err = quietly(
                [
                    *("bench-engine", "--model", str(self.model), "--max-num-seqs", "1"),
                    *("--prompt-len", "3", "--output-len", "2", "--threads", "1", "2"),
                ]
            )
        self.assertEqual(code, 1, err)
        warnings = [line for line in err.splitlines() if "--threads 2 on" in line]
        self.assertEqual(len(warnings), 1, err)
        self.assertIn("bench-engine: warning:", warnings[0])
