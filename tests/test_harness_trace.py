"""Trace replay: the file format and its refusals by line, arrivals from timestamps, prompts in which equal
hash ids are equal token blocks (checked with a real tokenizer and with a server's prefix counter), and
the ideal prefix-hit rate against a brute-force prefix cache."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import tempfile
import unittest
from pathlib import Path
from typing import Any
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from attention_kv_caceh.harness.prefix_ideal import compare_prefix_hits, ideal_prefix_hits, parse_block_size
from attention_kv_caceh.harness.run import HarnessConfig, run_harness
from attention_kv_caceh.harness.scripted_server import (
    PrefixCacheModel,
    Script,
    ScriptedServer,
    timed_token_script,
)
from attention_kv_caceh.harness.trace import TraceSettings, read_trace, trace_offsets_s, trace_specs

ROWS = [
    {"timestamp": 1000, "input_length": 40, "output_length": 3, "hash_ids": [0, 1, 2]},
    {"timestamp": 1250, "input_length": 37, "output_length": 2, "hash_ids": [0, 1, 3]},
    {"timestamp": 1250, "input_length": 16, "output_length": 2, "hash_ids": [0]},
    {"timestamp": 2000, "input_length": 48, "output_length": 4, "hash_ids": [0, 1, 2]},
]


def _write(folder: Path, rows: list[Any], name: str = "t.jsonl") -> Path:
    path = folder / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _brute_force(rows: list[tuple[list[int], int]], chunk: int, block: int) -> tuple[int, int]:
    """The prefix cache of the scripted server over token labels (hash id, offset): an oracle."""
    cache = PrefixCacheModel(block)
    labels: dict[tuple[int, int], int] = {}
    for ids, n in rows:
        tokens = [labels.setdefault((ids[p // chunk], p % chunk), len(labels)) for p in range(n)]
        cache.admit(tokens)
    return cache.hits, cache.queries


class TraceFileTest(unittest.TestCase):
    def test_rows_offsets_and_specs(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            settings_ = TraceSettings(str(_write(Path(tmp), ROWS)), "mooncake", 16, speedup=2.0)
            rows = read_trace(settings_)
            timed = TraceSettings(settings_.path, "timed-trace")
            default = TraceSettings(settings_.path)
        self.assertEqual([r.line for r in rows], [1, 2, 3, 4])
        # milliseconds, from the first row, divided by the speedup
        self.assertEqual(trace_offsets_s(rows, settings_), [0.0, 0.125, 0.125, 0.5])
        specs = trace_specs(rows, 16)
        self.assertEqual(
            [(s.prompt_tokens, s.output_tokens, s.hash_ids) for s in specs][1], (37, 2, (0, 1, 3))
        )
        self.assertEqual((timed.seconds_per_unit, timed.tokens_per_hash), (1.0, 16))
        self.assertEqual((default.seconds_per_unit, default.tokens_per_hash), (1e-3, 512))

    def test_bad_rows_are_refused_with_their_line(self) -> None:
        good = ROWS[0]
        cases: list[tuple[list[Any], str]] = [
            ([good, "{not json"], r"line 2: not JSON"),
            ([good, "", {**good, "timestamp": -1}], r"line 3: timestamp must be a finite number >= 0"),
            ([{**good, "timestamp": 5000}, good], r"line 2: timestamp 1000 is before line 1's 5000"),
            ([{k: v for k, v in good.items() if k != "hash_ids"}], r"line 1: missing hash_ids"),
            ([{**good, "input_length": 0}], r"line 1: input_length must be an integer >= 1"),
            ([{**good, "output_length": True}], r"line 1: output_length must be an integer >= 1"),
            ([{**good, "hash_ids": [0, -1, 2]}], r"line 1: hash_ids must be a list of integers >= 0"),
            ([{**good, "hash_ids": [0, 1]}], r"line 1: input_length 40 needs ceil\(40 / 16\) = 3 hash ids"),
            ([[1, 2]], r"line 1: expected a JSON object"),
            ([], r"no rows"),
        ]
        with tempfile.TemporaryDirectory() as tmp:
            for i, (rows, message) in enumerate(cases):
                with self.subTest(message=message):
                    path = _write(Path(tmp), rows, f"bad{i}.jsonl")
                    with self.assertRaisesRegex(ValueError, message):
                        read_trace(TraceSettings(str(path), "mooncake", 16))

    def test_unknown_keys_are_named_in_a_warning(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = _write(Path(tmp), [{**ROWS[0], "session": 3}])
            with self.assertLogs("attention_kv_caceh.harness.trace", "WARNING") as logs:
                read_trace(TraceSettings(str(path), "mooncake", 16))
        self.assertIn("session", logs.output[0])

    def test_settings_are_checked(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = str(_write(Path(tmp), ROWS))
            for kwargs, message in (
                ({"speedup": 0.0}, "^speedup: "),
                ({"block_size": 0}, "^block_size: "),
                ({"format": "csv"}, "^format: "),
            ):
                with self.subTest(kwargs=kwargs), self.assertRaisesRegex(ValueError, message):
                    TraceSettings(path, **kwargs)
            with self.assertRaisesRegex(ValueError, "no such file"):
                TraceSettings(tmp + "/missing.jsonl")


class IdealPrefixHitsTest(unittest.TestCase):
    def test_a_small_case_by_hand(self) -> None:
        rows = [([0, 1, 2], 40), ([0, 1, 3], 37), ([0], 16), ([0, 1, 2], 48)]
        # row 1 hits blocks 0 and 1 (32 tokens); row 2's one block is its whole prompt (capped: 0);
        # row 3 hits 0 and 1, and block 2 was never full before (row 0 had 8 of its 16 tokens)
        self.assertEqual(ideal_prefix_hits(rows, 16, 16), (64, 141))
        self.assertEqual(ideal_prefix_hits(rows, 16, 8), _brute_force(rows, 16, 8))

    @settings(max_examples=60, deadline=None)
    @given(
        st.lists(
            st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=6), st.integers(0, 15)),
            min_size=1,
            max_size=12,
        ),
        st.sampled_from([(4, 4), (4, 2), (4, 8), (6, 4), (3, 5)]),
    )
    def test_equals_a_brute_force_prefix_cache(self, raw: list[tuple[list[int], int]], sizes: Any) -> None:
        chunk, block = sizes
        rows = [(ids, max(1, len(ids) * chunk - cut % chunk)) for ids, cut in raw]
        self.assertEqual(ideal_prefix_hits(rows, chunk, block), _brute_force(rows, chunk, block))

    def test_comparison_verdicts(self) -> None:
        counters = {"prefix_cache_hits": 90, "prefix_cache_queries": 200, "prefix_cache_hit_rate": 0.45}
        kwargs: dict[str, Any] = {"num_requests": 2, "block_size": 16, "block_size_source": "x"}
        self.assertEqual(compare_prefix_hits(100, 200, counters, **kwargs)["verdict"], "equal")
        below = compare_prefix_hits(140, 200, counters, **kwargs)
        self.assertEqual((below["verdict"], below["difference_tokens"]), ("below", -50))
        self.assertAlmostEqual(below["difference_rate"], -0.25)
        self.assertEqual(compare_prefix_hits(40, 200, counters, **kwargs)["verdict"], "above")
        self.assertEqual(compare_prefix_hits(40, 200, None, **kwargs)["verdict"], "not measured")

    def test_block_size_from_an_exposition(self) -> None:
        text = '# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="32",x="y"} 1.0\n'
        self.assertEqual(parse_block_size(text), 32)
        self.assertIsNone(parse_block_size("vllm:num_requests_running 0\n"))


class TracePromptsTest(unittest.TestCase):
    def test_equal_hash_ids_are_equal_token_blocks_with_a_real_tokenizer(self) -> None:
        from attention_kv_caceh.harness.prompts import LocalTokenizer, exact_prompts
        from attention_kv_caceh.toy_model.make_model import write_random_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            rows = read_trace(TraceSettings(str(_write(Path(tmp), ROWS)), "mooncake", 16))
            tokenizer = LocalTokenizer(write_random_checkpoint(Path(tmp) / "tiny", "llama", "tiny", seed=0))
            specs = asyncio.run(exact_prompts(trace_specs(rows, 16), tokenizer, token_ids=True))
        ids = [spec.prompt_token_ids for spec in specs]
        blocks: dict[int, tuple[int, ...]] = {}
        for row, prompt in zip(rows, ids, strict=True):
            assert prompt is not None
            self.assertEqual(len(prompt), row.input_length)
            for k, h in enumerate(row.hash_ids):
                block = prompt[16 * k : 16 * (k + 1)]
                full = blocks.setdefault(h, block) if len(block) == 16 else blocks.get(h, block)
                self.assertEqual(block, full[: len(block)])  # a partial last block is its block's start
        self.assertEqual(len({blocks[h] for h in blocks}), len(blocks))  # distinct ids, distinct blocks


def _server() -> ScriptedServer:
    server: ScriptedServer | None = None

    def script_for(payload: dict[str, Any], path: str) -> Script:
        assert server is not None
        return timed_token_script(
            0.001, 0.0005, int(payload["max_tokens"]), prompt_tokens=len(server.prompt_ids(payload))
        )

    server = ScriptedServer(script_for, counters=True, tokenizer=True, prefix_block_size=16)
    return server


class TraceRunTest(unittest.IsolatedAsyncioTestCase):
    async def test_the_servers_prefix_counter_finds_exactly_the_ideal_hits(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            trace = TraceSettings(str(_write(Path(tmp), ROWS)), "mooncake", 16, speedup=10.0)
            async with _server() as server:
                config = HarnessConfig(
                    backend="openai-completions",
                    base_url=server.base_url,
                    num_requests=4,
                    concurrency=4,
                    server_metrics_interval_s=0,
                    smoke_test=False,
                    trace=trace,
                )
                result = await run_harness(config)
        summary = result.summary
        self.assertEqual(summary["completed"], 4)
        self.assertEqual(summary["prompt_lengths"], "exact")
        prefix = summary["trace_prefix"]
        self.assertEqual(prefix["ideal_hit_tokens"], 64)
        self.assertEqual(prefix["measured_hit_tokens"], 64)  # the server's counter, exactly the ideal
        self.assertEqual(prefix["verdict"], "equal")
        self.assertEqual([p["max_tokens"] for p in server.counters.payloads], [3, 2, 2, 4])
        # arrivals follow the timestamps (ms / speedup 10)
        arrivals = [(r.arrival_ns - result.records[0].arrival_ns) / 1e6 for r in result.records]
        self.assertEqual([round(a, 3) for a in arrivals], [0.0, 25.0, 25.0, 100.0])

    async def test_usage_errors_name_the_flag(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            trace = TraceSettings(str(_write(Path(tmp), ROWS)), "mooncake", 16)
            base = {"backend": "openai-completions", "num_requests": 4, "trace": trace}
            for extra, message in (
                ({"backend": "openai-chat"}, "token ids for /v1/completions"),
                ({"request_rate": 2.0}, "timestamps give the arrivals"),
                ({"num_requests": 5}, "has only 4 rows"),
                ({"dataset": str(Path(tmp) / "t.jsonl")}, "the trace gives the prompts"),
            ):
                with self.subTest(extra=extra), self.assertRaisesRegex(ValueError, message):
                    HarnessConfig(**(base | extra))


class TraceCommandTest(unittest.TestCase):
    def test_simulated_replay_prints_the_ideal_rate_and_trace_flags_need_a_trace(self) -> None:
        from attention_kv_caceh import cli

        with tempfile.TemporaryDirectory() as tmp:
            path = _write(Path(tmp), ROWS)
            summary_path = Path(tmp) / "s.json"
            argv = ["harness", "--trace", str(path), "--trace-block-size", "16", "--trace-speedup", "20",
                    "--prefill-ms", "1", "--per-token-ms", "1", "--summary-json", str(summary_path)]  # fmt: skip
            with contextlib.redirect_stdout(io.StringIO()) as out:
                self.assertEqual(cli.main(argv), 0)
            summary = json.loads(summary_path.read_text())
            self.assertEqual(summary["num_requests"], 4)  # every row without --num-requests
            self.assertEqual(summary["trace_prefix"]["verdict"], "not measured")
            self.assertIn("ideal hits 64 of 141 tokens", out.getvalue())
            self.assertNotIn("could not be read", out.getvalue())  # the simulated server has no counters
            one = _write(Path(tmp), ROWS[:1], "one.jsonl")
            with contextlib.redirect_stderr(io.StringIO()) as err:
                argv = ["harness", "--trace", str(one), "--trace-block-size", "16", "--num-requests", "2"]
                self.assertEqual(cli.main(argv), 2)
            self.assertIn("only 1 row", err.getvalue())
            self.assertNotIn("1 rows", err.getvalue())
            with contextlib.redirect_stderr(io.StringIO()) as err:
                self.assertEqual(cli.main(["harness", "--trace-speedup", "2"]), 2)
            self.assertIn("--trace-speedup needs --trace", err.getvalue())
            with contextlib.redirect_stderr(io.StringIO()) as err:
                self.assertEqual(cli.main(["harness", "--trace-format", "timed-trace"]), 2)
            self.assertIn("--trace-format needs --trace", err.getvalue())
            # the rows give the lengths: a length flag is refused, for harness and sweep alike
            for command in (["harness"], ["sweep", "--out-dir", str(Path(tmp) / "sw")]):
                for flag in ("--prompt-len", "--output-len"):
                    with self.subTest(command=command[0], flag=flag):
                        argv = [*command, "--trace", str(path), "--trace-block-size", "16", flag, "50"]
                        with contextlib.redirect_stderr(io.StringIO()) as err:
                            self.assertEqual(cli.main(argv), 2)
                        self.assertIn(flag, err.getvalue())
                        self.assertEqual(len(err.getvalue().strip().splitlines()), 1)
            self.assertFalse((Path(tmp) / "sw").exists())
            with contextlib.redirect_stderr(io.StringIO()) as err:
                argv = ["harness", "--trace", str(path), "--trace-block-size", "16", "--num-requests", "9"]
                self.assertEqual(cli.main(argv), 2)
            self.assertIn("has only 4 rows", err.getvalue())
            self.assertEqual(len(err.getvalue().strip().splitlines()), 1)
            # no output may replace the trace: --jsonl itself, or the JSONL of a repeat (x-r1.jsonl)
            repeat_trace = _write(Path(tmp), ROWS, "x-r1.jsonl")
            for trace, jsonl in ((path, path), (repeat_trace, Path(tmp) / "x.jsonl")):
                before = trace.read_bytes()
                with self.subTest(jsonl=jsonl.name), contextlib.redirect_stderr(io.StringIO()) as err:
                    argv = ["harness", "--trace", str(trace), "--trace-block-size", "16", "--repeats", "2",
                            "--jsonl", str(jsonl)]  # fmt: skip
                    self.assertEqual(cli.main(argv), 2)
                self.assertIn(f"--trace {str(trace)!r}", err.getvalue())  # the output names the input
                self.assertIn("--jsonl", err.getvalue())
                self.assertEqual(trace.read_bytes(), before)


class TraceWarningsTest(unittest.TestCase):
    def test_the_advice_names_the_flags_a_trace_run_takes(self) -> None:
        # every warning fires (thresholds below any value): lateness, and the client's own CPU; a
        # trace takes no --request-rate, the simulated backend no --workers
        with (
            tempfile.TemporaryDirectory() as tmp,
            mock.patch("attention_kv_caceh.harness.summary.LATENESS_WARN_MS", -1.0),
            mock.patch("attention_kv_caceh.harness.client_cpu.CLIENT_BUSY_WARN", -1.0),
        ):
            trace = TraceSettings(str(_write(Path(tmp), ROWS)), "mooncake", 16, 20.0)
            config = HarnessConfig(num_requests=4, prefill_ms=1, per_token_ms=1, trace=trace)
            warnings: list[str] = asyncio.run(run_harness(config)).summary["warnings"]
        lateness = [w for w in warnings if "lateness" in w]
        busy = [w for w in warnings if "bottleneck" in w]
        self.assertEqual((len(lateness), len(busy)), (1, 1), warnings)
        self.assertIn("--trace-speedup", lateness[0])
        self.assertNotIn("--request-rate", lateness[0])
        self.assertNotIn("--workers 2", busy[0])


class EngineTraceTest(unittest.TestCase):
    """Against the project's own `serve` (tiny random checkpoint, block size 16): the server's hits
    equal the trace's ideal with a large KV pool, and fall below it with a small one."""

    def test_serve_hits_the_ideal_unless_its_pool_is_small(self) -> None:
        from attention_kv_caceh import cli
        from attention_kv_caceh.toy_model.make_model import write_random_checkpoint

        rows = [
            {
                "timestamp": 20 * i,
                "input_length": 16 * (6 + i % 2) - 5,
                "output_length": 2,
                "hash_ids": [100 + i % 2, 1, 2, 3, 4, *range(1000 * i, 1000 * i + 1 + i % 2)],
            }
            for i in range(12)
        ]  # fmt: skip  (two prefixes of 5 blocks in turn; 8 blocks of 16 tokens hold one prompt, not two)
        with tempfile.TemporaryDirectory() as tmp:
            model = write_random_checkpoint(Path(tmp) / "tiny", "llama", "tiny", seed=0)
            path = _write(Path(tmp), rows)
            verdicts: list[tuple[str, str]] = []
            for blocks in ("256", "8"):
                summary_path = Path(tmp) / f"s{blocks}.json"
                argv = ["harness", "--backend", "engine", "--model", str(model), "--block-size", "16",
                        "--num-kv-blocks", blocks, "--trace", str(path), "--trace-block-size", "16",
                        "--concurrency", "1", "--ignore-eos", "--temperature", "0",
                        "--server-metrics-interval", "0", "--summary-json", str(summary_path)]  # fmt: skip
                with contextlib.redirect_stdout(io.StringIO()) as out:
                    self.assertEqual(cli.main(argv), 0, out.getvalue())
                prefix = json.loads(summary_path.read_text())["trace_prefix"]
                verdicts.append((prefix["verdict"], prefix["block_size_source"]))
                if blocks == "256":
                    self.assertEqual(prefix["measured_hit_tokens"], prefix["ideal_hit_tokens"])
                else:
                    self.assertLess(prefix["measured_hit_tokens"], prefix["ideal_hit_tokens"])
        self.assertEqual(verdicts, [("equal", "the server's /metrics"), ("below", "the server's /metrics")])


if __name__ == "__main__":
    unittest.main()
