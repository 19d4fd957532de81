"""The engine's commands, `make-model` and `generate`, on a tiny random checkpoint the CLI writes itself.

Oracle for `generate`: the same checkpoint run by `LLMEngine.generate` one prompt at a time, without
chunking, prefix caching or preemption, in float64. The batched run is forced (small token budget, small
KV pool) to chunk prefills and preempt, and its trace is checked to show that it did.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
import unittest
import unittest.mock
from pathlib import Path
from typing import Any

from attention_kv_caceh import cli
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.llm_engine import LLMEngine, StepStats
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.report.generate import ALWAYS_ROWS, StepTable

PROMPTS = [
    "The cache",
    "Once upon a time there was a key and a value, and the query looked at both",
    "Attention",
    "A block table maps each position of a sequence to a slot in the pool of blocks",
    "Prefill then decode",
]


def quietly(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


class EngineCommandCase(unittest.TestCase):
    """A tiny llama checkpoint written by `make-model` once per class, and a folder for outputs."""

    tmp: Path
    model: Path

    @classmethod
    def setUpClass(cls) -> None:
        cls.tmp = Path(tempfile.mkdtemp())
        cls.model = cls.tmp / "tiny"
        code, out, err = quietly(["make-model", "--out", str(cls.model), "--preset", "tiny"])
        assert code == 0, err
        assert "parameters" in out, out

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self) -> None:
        self.out = Path(tempfile.mkdtemp(dir=self.tmp))
        self.prompts_file = self.out / "prompts.txt"
        self.prompts_file.write_text("\n".join(PROMPTS) + "\n\n", encoding="utf-8")

    def generate(self, *flags: str) -> tuple[int, str, str]:
        return quietly(["generate", "--model", str(self.model), *flags])


class GenerateEqualsOnePromptAtATimeTest(EngineCommandCase):
    FLAGS = ("--max-tokens", "8", "--ignore-eos", "--dtype", "float64", "--block-size", "4")

    def solo_outputs(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        config = EngineConfig(
            dtype="float64", num_kv_blocks=64, block_size=4, max_num_seqs=1, enable_prefix_caching=False
        )
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        return [
            LLMEngine.from_pretrained(str(self.model), config).generate([p], params)[0] for p in prompt_ids
        ]

    def test_batched_chunked_preempted_tokens_equal_one_prompt_at_a_time(self) -> None:
        output, trace = self.out / "out.jsonl", self.out / "steps.jsonl"
        code, stdout, err = self.generate(
            "--prompts-file", str(self.prompts_file), *self.FLAGS,
            "--max-num-seqs", "4", "--max-num-batched-tokens", "8", "--num-kv-blocks", "14",
            "--output", str(output), "--trace", str(trace),
        )  # fmt: skip
        self.assertEqual(code, 0, err)
        records = read_jsonl(output)
        tokenizer = Tokenizer.load(self.model)
        self.assertEqual([r["index"] for r in records], list(range(len(PROMPTS))))
        self.assertEqual([r["prompt"] for r in records], PROMPTS)
        self.assertEqual([r["prompt_token_ids"] for r in records], [tokenizer.encode(p) for p in PROMPTS])
        solo = self.solo_outputs([r["prompt_token_ids"] for r in records])
        self.assertEqual([r["token_ids"] for r in records], solo)
        for r in records:
            self.assertEqual(r["text"], tokenizer.decode(r["token_ids"]))
            self.assertEqual(r["finish_reason"], "length")
            self.assertIn(f"[{r['index']}] {r['prompt']!r} -> {r['text']!r}", stdout)

        steps = read_jsonl(trace)
        self.assertGreater(sum(s["num_preemptions"] for s in steps), 0, "no preemption happened")
        long_prompt = max(range(len(PROMPTS)), key=lambda i: len(records[i]["prompt_token_ids"]))
        prefill_chunks = [
            s["num_scheduled_tokens"][str(long_prompt)]
            for s in steps
            if s["num_scheduled_tokens"].get(str(long_prompt), 0) > 1
        ]
        self.assertGreater(len(prefill_chunks), 1, "the longest prompt was not prefilled in chunks")
        self.assertTrue(all(n <= 8 for n in prefill_chunks))


class TraceTest(EngineCommandCase):
    def test_one_line_per_step_and_tokens_sum_to_prompts_plus_outputs(self) -> None:
        output, trace = self.out / "out.jsonl", self.out / "steps.jsonl"
        code, stdout, err = self.generate(
            "--prompt", *PROMPTS[:3], "--max-tokens", "5", "--ignore-eos", "--no-prefix-caching",
            "--max-num-batched-tokens", "16", "--output", str(output), "--trace", str(trace),
        )  # fmt: skip
        self.assertEqual(code, 0, err)
        steps, records = read_jsonl(trace), read_jsonl(output)
        self.assertEqual([s["step_index"] for s in steps], list(range(len(steps))))
        self.assertIn(f"{len(steps)} steps,", stdout)
        for s in steps:
            self.assertEqual(
                sum(s["num_scheduled_tokens"].values()), s["num_prefill_tokens"] + s["num_decode_tokens"]
            )
        self.assertEqual(sum(s["num_preemptions"] for s in steps), 0)
        # Without preemption or prefix caching every token is computed once, except each request's last
        # sampled token, which is never fed back.
        expected = sum(len(r["prompt_token_ids"]) + len(r["token_ids"]) - 1 for r in records)
        self.assertEqual(sum(s["num_prefill_tokens"] + s["num_decode_tokens"] for s in steps), expected)
        self.assertEqual(
            sum(s["num_prefill_tokens"] for s in steps), sum(len(r["prompt_token_ids"]) for r in records)
        )
        finished = [rid for s in steps for rid in s["finished_request_ids"]]
        self.assertEqual(sorted(finished), ["0", "1", "2"])

    def test_ctrl_c_keeps_the_finished_prompts_and_every_step_that_ran(self) -> None:
        output, trace = self.out / "out.jsonl", self.out / "steps.jsonl"
        original = LLMEngine.step
        calls = 0

        def step(engine: LLMEngine) -> Any:
            nonlocal calls
            calls += 1
            if calls == 10:
                raise KeyboardInterrupt
            return original(engine)

        # One request at a time, 4 tokens each: prompt 0 ends at step 3, prompt 1 at step 7.
        with unittest.mock.patch.object(LLMEngine, "step", step):
            code, out, err = self.generate(
                "--prompt", *PROMPTS[:3], "--max-tokens", "4", "--ignore-eos", "--max-num-seqs", "1",
                "--output", str(output), "--trace", str(trace),
            )  # fmt: skip
        self.assertEqual(code, 130)
        self.assertEqual(
            err, f"attention-kv-caceh: interrupted; 2 of 3 prompts finished, written to {output}\n"
        )
        self.assertEqual([r["index"] for r in read_jsonl(output)], [0, 1])
        self.assertEqual(len(read_jsonl(trace)), 9)
        # the totals count prompt 2's first token too (step 8), not only the finished prompts' 4 + 4
        self.assertIn("; 9 tokens generated in", out)


class LoadLineTest(EngineCommandCase):
    def test_the_first_line_counts_the_kernels_the_load_compiled_and_loaded_from_the_cache(self) -> None:
        from attention_kv_caceh.model_executor import warmup

        for counts, says in (
            ([(4, 1), (7, 3)], "3 kernel signatures compiled, 2 loaded from Numba's disk cache"),
            ([(4, 1), (4, 6)], "0 kernel signatures compiled, 5 loaded from Numba's disk cache"),
            ([(4, 1), (4, 1)], "every kernel already compiled in this process"),
        ):
            with (
                self.subTest(says=says),
                unittest.mock.patch.object(warmup, "numba_compile_counts", side_effect=counts),
            ):
                code, out, err = self.generate("--prompt", "a", "--max-tokens", "2")
                self.assertEqual(code, 0, err)
                self.assertIn(says, out.splitlines()[0])
                self.assertNotIn("compile included", out)


class KVPoolLineTest(EngineCommandCase):
    """The default pool holds max_num_seqs requests of max_model_len; the first line gives its blocks and bytes."""

    def test_the_default_pool_is_what_the_batch_needs_and_a_count_given_is_kept(self) -> None:
        from attention_kv_caceh.engine.model_runner import ModelRunner
        from attention_kv_caceh.memory import format_bytes
        from attention_kv_caceh.model_executor.model_source import load_model_config

        _, model_config = load_model_config(self.model)
        per_block = ModelRunner.bytes_per_block(model_config, 16, "float32")
        longest = model_config.max_position_embeddings
        for flags, blocks in (
            ((), 8 * -(-longest // 16)),
            (("--max-num-seqs", "2", "--max-model-len", "100"), 2 * 7),
            (("--num-kv-blocks", "5000"), 5000),
        ):
            with self.subTest(flags=flags):
                code, out, err = self.generate("--prompt", "a", "--max-tokens", "2", *flags)
                self.assertEqual(code, 0, err)
                self.assertIn(
                    f"{blocks} KV blocks of 16 tokens ({blocks * 16} positions, "
                    f"{format_bytes(blocks * per_block)})",
                    out.splitlines()[0],
                )

    def test_an_engine_built_without_the_cli_caps_its_default_pool_the_same_way(self) -> None:
        engine = LLMEngine.from_pretrained(str(self.model), EngineConfig(max_num_seqs=2, max_model_len=64))
        self.assertEqual(engine.scheduler.kv_cache_manager.num_blocks, 2 * 4)

    def test_a_sliding_window_model_counts_each_groups_peak(self) -> None:
        from attention_kv_caceh.cli.engine_args import plan_engine
        from attention_kv_caceh.engine.kv_cache_manager import full_batch_blocks

        folder = str(Path(__file__).parent / "data" / "gemma3")
        plan = plan_engine(folder, {"max_num_seqs": 2, "block_size": 4, "max_num_batched_tokens": 16})
        groups = plan.kv_cache_config.kv_cache_groups
        self.assertGreater(len(groups), 1)
        needed = full_batch_blocks(2, 4, plan.max_model_len, groups, 16)
        self.assertEqual(plan.num_blocks, needed)
        self.assertLess(needed, 2 * len(groups) * -(-plan.max_model_len // 4))  # the windows hold fewer


class ExplicitThreadsWarningTest(EngineCommandCase):
    """--threads N beside other processes' load: one warning, the count kept; the default measures nothing."""

    def setUp(self) -> None:
        super().setUp()
        from attention_kv_caceh.cpus import numba_pool_size, usable_cpus

        if usable_cpus().count < 2 or numba_pool_size() < 2:
            self.skipTest("needs two usable CPUs and a Numba pool of two")

    def test_two_threads_beside_a_busy_cpu_warn_once_and_run_on_two(self) -> None:
        from attention_kv_caceh import cpu_load

        with unittest.mock.patch.object(cpu_load, "measure_others_busy", return_value=1.0) as measure:
            code, out, err = self.generate("--prompt", "a", "--max-tokens", "2", "--threads", "2")
        self.assertEqual(code, 0, err)
        measure.assert_called_once()
        warnings = [line for line in err.splitlines() if "warning" in line and "--threads" in line]
        self.assertEqual(len(warnings), 1, err)
        self.assertIn("generate: warning: --threads 2 on", warnings[0])
        self.assertIn("keep 1.0 of them busy", warnings[0])
        self.assertIn("the default (no --threads) follows the load", warnings[0])
        self.assertIn("engine core: 2 threads", out)

    def test_no_warning_on_free_cpus_and_no_measurement_at_the_default(self) -> None:
        from attention_kv_caceh import cpu_load

        for flags, calls in ((("--threads", "2"), 1), ((), 0), (("--threads", "1"), 0)):
            with (
                self.subTest(flags=flags),
                unittest.mock.patch.object(cpu_load, "measure_others_busy", return_value=0.0) as measure,
            ):
                code, _, err = self.generate("--prompt", "a", "--max-tokens", "2", *flags)
                self.assertEqual(code, 0, err)
                self.assertEqual(measure.call_count, calls)
                self.assertNotIn("--threads 2 on", err)


class ReportOfGenerateFilesTest(EngineCommandCase):
    def test_report_lists_generate_output_and_trace_once_with_no_problem(self) -> None:
        from attention_kv_caceh.report.build import build_report

        results = self.out / "results"
        code, _, err = self.generate(
            *("--prompt", "a", "--prompt", "b c", "--max-tokens", "3"),
            *("--output", str(results / "generate.jsonl"), "--trace", str(results / "steps.jsonl")),
        )
        self.assertEqual(code, 0, err)
        report = build_report(results, self.out / "report.md", plot=False)
        self.assertEqual(report.problems, [])
        self.assertEqual(report.sources, [])
        for name in ("generate.jsonl", "steps.jsonl"):
            self.assertEqual(report.markdown.count(f"`{name}`"), 1, report.markdown)
        code, _, err = quietly(["report", "--results", str(results), "--out", str(self.out / "r.md")])
        self.assertEqual((code, err.count("problem:")), (0, 0), err)


class UsageErrorTest(EngineCommandCase):
    def assert_usage_error(self, argv: list[str], names: str) -> None:
        with self.subTest(argv=argv):
            before = sorted(self.out.iterdir())
            code, out, err = quietly(argv)
            self.assertEqual(code, 2, err)
            self.assertEqual(out, "")
            self.assertEqual(len(err.splitlines()), 1, err)
            self.assertIn(names, err)
            self.assertEqual(sorted(self.out.iterdir()), before, "a usage error created a file")

    def test_every_usage_error_exits_2_with_one_line_and_creates_no_file(self) -> None:
        m, o = str(self.model), str(self.out)
        outputs = ["--output", f"{o}/out.jsonl", "--trace", f"{o}/steps.jsonl"]
        gen = ["generate", "--max-tokens", "4", *outputs]
        empty = self.out / "empty.txt"
        empty.write_text("\n  \n", encoding="utf-8")
        cases = [
            ([*gen, "--model", f"{o}/missing", "--prompt", "a"], "no such file or folder"),
            ([*gen, "--model", o, "--prompt", "a"], "neither config.json"),
            ([*gen, "--model", "", "--prompt", "a"], "--model '': an empty name"),
            (["bench-engine", "--model", " "], "--model ' ': an empty name"),
            (["serve", "--model", "", "--port", "0"], "--model '': an empty name"),
            (["serve", "--model", m, "--port", "0", "--served-model-name", ""], "--served-model-name"),
            (["serve", "--model", m, "--port", "0", "--served-model-name", " \t"], "--served-model-name"),
            ([*gen, "--model", m], "one of the arguments --prompt --prompts-file is required"),
            ([*gen, "--model", m, "--prompt", "a", "--prompts-file", str(self.prompts_file)], "not allowed"),
            ([*gen, "--model", m, "--prompts-file", str(empty)], "holds no prompt"),
            ([*gen, "--model", m, "--prompts-file", f"{o}/none.txt"], "cannot read it"),
            ([*gen, "--model", m, "--prompt", ""], "prompt 0 (--prompt, counted from 0) is empty"),
            ([*gen, "--model", m, "--prompt", "a", "--prompt", "caf\udce9"], "prompt 1 (--prompt"),
            ([*gen, "--model", m, "--prompt", "a", "--max-tokens", "0"], "--max-tokens"),
            ([*gen, "--model", m, "--prompt", "a", "--top-p", "1.5"], "--top-p"),
            ([*gen, "--model", m, "--prompt", "a", "--temperature", "nan"], "--temperature"),
            ([*gen, "--model", m, "--prompt", "a", "--num-kv-blocks", "4", "--kv-cache-memory", "9"], "not allowed"),
            ([*gen, "--model", m, "--prompt", "a", "--kv-cache-memory", "100"], "holds no block"),
            ([*gen, "--model", m, "--prompt", "a", "--max-num-seqs", "9", "--max-num-batched-tokens", "4"], "--max-num-seqs"),
            ([*gen, "--model", m, "--prompt", "a", "--max-model-len", "100000"], "--max-model-len"),
            ([*gen, "--model", m, "--prompt", "a", "--kv-cache-memory", str(10**15)], "--kv-cache-memory 1000000000000000"),
            ([*gen, "--model", m, "--prompt", "a", "--num-kv-blocks", str(10**12)], "--num-kv-blocks 1000000000000"),
            ([*gen, "--model", m, "--prompt", PROMPTS[1], "--max-model-len", "4"], "more than max_model_len 4"),
            ([*gen, "--model", m, "--prompt", "a", "--max-model-len", "16", "--max-tokens", "17"], "--max-tokens 17"),
            (["generate", "--model", m, "--prompt", "a", "--max-tokens", "4", "--output", f"{o}/x.txt"], ".jsonl"),
            (["generate", "--model", m, "--prompt", "a", "--max-tokens", "4", "--output", f"{o}/a.jsonl", "--trace", f"{o}/a.jsonl"], "same file"),
            (["make-model", "--out", m], "non-empty folder"),
            (["make-model", "--out", str(self.prompts_file)], "not a folder"),
            (["make-model", "--out", f"{self.prompts_file}/sub"], "cannot create"),
            (["make-model", "--out", f"{o}/new", "--arch", "gpt2"], "--arch"),
            (["make-model", "--out", "/proc/m"], "--out '/proc/m'"),
            (["make-model", "--out", "/proc/self/m"], "--out '/proc/self/m'"),
        ]  # fmt: skip
        for argv, names in cases:
            self.assert_usage_error(argv, names)


class CheckpointAndPoolErrorTest(EngineCommandCase):
    def test_a_missing_tensor_exits_1_naming_the_file_and_key(self) -> None:
        from safetensors.numpy import load_file, save_file

        broken = self.out / "broken"
        shutil.copytree(self.model, broken)
        tensors = load_file(broken / "model.safetensors")
        key = "model.layers.1.mlp.down_proj.weight"
        del tensors[key]
        save_file(tensors, broken / "model.safetensors")
        output = self.out / "out.jsonl"
        code, _, err = quietly(
            [
                "generate",
                "--model",
                str(broken),
                "--prompt",
                "a",
                "--max-tokens",
                "2",
                "--output",
                str(output),
            ]
        )
        self.assertEqual(code, 1)
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn(key, err)
        self.assertIn("model.safetensors", err)
        self.assertFalse(output.exists())

    def test_a_prompt_that_cannot_fit_the_pool_exits_2_before_loading_weights(self) -> None:
        # the weights are unreadable, so reaching the loader would exit 1: the refusal comes before it
        folder = self.out / "no-weights"
        shutil.copytree(self.model, folder)
        (folder / "model.safetensors").write_bytes(b"\0" * 4)
        for flags in (("--num-kv-blocks", "2"), ("--block-size", "4", "--num-kv-blocks", "1")):
            with self.subTest(flags=flags):
                code, _, err = quietly(
                    ["generate", "--model", str(folder), "--prompt", PROMPTS[1], "--max-tokens", "4", *flags]
                )
                self.assertEqual(code, 2, err)
                self.assertEqual(len(err.splitlines()), 1, err)
                self.assertIn(f"the pool has {flags[-1]}", err)

    def test_a_truncated_safetensors_file_exits_1_with_one_line_naming_it(self) -> None:
        for size in (4, 1_000_000 // 16):
            with self.subTest(size=size):
                broken = self.out / f"cut{size}"
                shutil.copytree(self.model, broken)
                os.truncate(broken / "model.safetensors", size)
                code, _, err = quietly(
                    ["generate", "--model", str(broken), "--prompt", "a", "--max-tokens", "2"]
                )
                self.assertEqual(code, 1, err)
                self.assertEqual(len(err.splitlines()), 1, err)
                self.assertIn("model.safetensors", err)
                self.assertNotIn("internal error", err)


def decode_stats(index: int, running: int = 2, preemptions: int = 0) -> StepStats:
    return StepStats(
        step_index=index,
        num_scheduled_tokens={"0": 1, "1": 1},
        num_prefill_tokens=0,
        num_decode_tokens=2,
        num_running=running,
        num_waiting=0,
        num_free_blocks=3,
        kv_cache_usage=0.5,
        num_preemptions=preemptions,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        step_time_ms=1.0,
    )


class StepTableRowsTest(unittest.TestCase):
    def test_all_early_steps_then_changes_every_25th_and_the_last(self) -> None:
        stream = io.StringIO()
        table = StepTable(stream)
        printed = [
            i
            for i in range(130)
            if table.row(decode_stats(i, preemptions=int(i == 61)), ["1"] if i == 90 else [], last=i == 129)
        ]
        table.footer()
        self.assertEqual(printed, [*range(ALWAYS_ROWS), 50, 61, 75, 90, 100, 125, 129])
        text = stream.getvalue()
        self.assertIn("... 10 decode steps without change not shown", text)  # 51 .. 60
        self.assertIn("... 3 decode steps without change not shown", text)  # 126 .. 128
        self.assertIn("0:1 1:1*", text)  # request 1 finished at step 90


class MakeModelTest(EngineCommandCase):
    def test_force_deletes_the_weights_of_the_checkpoint_that_was_there(self) -> None:
        target = self.out / "ckpt"
        shutil.copytree(self.model, target)
        stale = [target / "model-00001-of-00002.safetensors", target / "model.safetensors.index.json"]
        for p in stale:
            p.write_text("{}", encoding="utf-8")
        (target / "README.md").write_text("kept", encoding="utf-8")
        code, out, err = quietly(["make-model", "--out", str(target), "--force", "--arch", "qwen3"])
        self.assertEqual(code, 0, err)
        for p in stale:
            self.assertFalse(p.exists())
            self.assertIn(f"removed {p}", out)
        self.assertEqual((target / "README.md").read_text(encoding="utf-8"), "kept")
        self.assertEqual(
            json.loads((target / "config.json").read_text())["architectures"], ["Qwen3ForCausalLM"]
        )
        code, _, err = quietly(["generate", "--model", str(target), "--prompt", "a", "--max-tokens", "2"])
        self.assertEqual(code, 0, err)

    def test_a_gemma3_checkpoint_has_sliding_layers_and_batches_as_it_runs_alone(self) -> None:
        # a prompt longer than the 64-token window, prefilled in chunks beside a short one: every
        # request's tokens equal its solo run (float64), so the window's blocks were freed and read right
        target = self.out / "gemma3"
        code, _, err = quietly(["make-model", "--out", str(target), "--arch", "gemma3"])
        self.assertEqual(code, 0, err)
        config = json.loads((target / "config.json").read_text())
        self.assertEqual(config["architectures"], ["Gemma3ForCausalLM"])
        self.assertEqual(config["layer_types"], ["sliding_attention", "full_attention"])
        self.assertEqual(config["sliding_window"], 64)
        from attention_kv_caceh.toy_model.make_model import gemma3_layer_types

        small = gemma3_layer_types(12)  # the small preset: Gemma 3's 5:1
        self.assertEqual([i for i, t in enumerate(small) if t == "full_attention"], [5, 11])
        prompts = [" ".join(["the key and the value of a long sequence"] * 12), "Attention"]
        output = self.out / "gemma3.jsonl"
        flags = ("--max-tokens", "6", "--ignore-eos", "--dtype", "float64", "--block-size", "4")
        code, _, err = quietly(
            ["generate", "--model", str(target), "--prompt", *prompts, *flags,
             "--max-num-batched-tokens", "32", "--output", str(output)]
        )  # fmt: skip
        self.assertEqual(code, 0, err)
        records = read_jsonl(output)
        self.assertGreater(len(records[0]["prompt_token_ids"]), 64)
        engine_config = EngineConfig(dtype="float64", block_size=4, max_num_seqs=1, max_model_len=512)
        engine = LLMEngine.from_pretrained(str(target), engine_config)
        self.assertEqual(len(engine.model_runner.kv_cache_groups), 2)  # pyright: ignore[reportAttributeAccessIssue]
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        for r in records:
            self.assertEqual(r["token_ids"], engine.generate([r["prompt_token_ids"]], params)[0])

    def test_a_full_disk_exits_1_with_one_line_naming_out_not_the_staging_folder(self) -> None:
        from safetensors import SafetensorError

        failures: list[BaseException] = [
            SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
            OSError(28, "No space left on device", str(self.out / ".full.x1y2" / "model.safetensors")),
        ]
        for failure in failures:
            with self.subTest(failure=type(failure).__name__):
                target = self.out / "full"
                writer = unittest.mock.Mock(side_effect=failure)
                with unittest.mock.patch("attention_kv_caceh.toy_model.make_model.serialize_file", writer):
                    code, _, err = quietly(["make-model", "--out", str(target)])
                writer.assert_called()
                self.assertEqual(code, 1, err)
                self.assertEqual(len(err.splitlines()), 1, err)
                self.assertIn(f"--out {str(target)!r}", err)
                self.assertIn("No space left on device", err)
                self.assertNotIn(".full.", err)  # the hidden staging folder's name
                self.assertNotIn("internal error", err)
                self.assertFalse(target.exists())
                self.assertEqual([p for p in self.out.iterdir() if p.name.startswith(".full")], [])

    def test_the_same_flags_write_the_same_bytes(self) -> None:
        again = self.out / "again"
        code, _, err = quietly(["make-model", "--out", str(again), "--preset", "tiny"])
        self.assertEqual(code, 0, err)
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            self.assertEqual((again / name).read_bytes(), (self.model / name).read_bytes(), name)
        self.assertEqual(sorted(p.name for p in self.out.iterdir()), ["again", "prompts.txt"])


if __name__ == "__main__":
    unittest.main()
