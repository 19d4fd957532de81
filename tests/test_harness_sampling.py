"""Sampling flags of the harness and sweep: sent in the body exactly as given (nothing when none is given),
refused for the simulated backend and for values the server would refuse, recorded in the run's config."""

from __future__ import annotations

import argparse
import contextlib
import io
import unittest
from typing import Any

from attention_kv_caceh import cli
from attention_kv_caceh.cli.common import UsageError
from attention_kv_caceh.cli.harness import add_arguments, config_from_args, warn_server_temperature
from attention_kv_caceh.harness.load import LengthRange
from attention_kv_caceh.harness.run import BackendName, HarnessConfig, run_harness
from attention_kv_caceh.harness.sampling import SamplingOptions
from attention_kv_caceh.harness.scripted_server import ScriptedServer, timed_token_script
from attention_kv_caceh.options import ConfigError, flag_of
from attention_kv_caceh.report.serving import serving_section
from tests.test_harness_prompts import word_count

SAMPLING_KEYS = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "seed",
}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def quietly(command: str, argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([command, *argv])
    return code, out.getvalue(), err.getvalue()


class SamplingOptionsTest(unittest.TestCase):
    def test_only_the_given_fields_are_body_fields(self) -> None:
        self.assertEqual(SamplingOptions().body_fields(), {})
        given = SamplingOptions(temperature=0.0, top_k=-1, repetition_penalty=1.1)
        self.assertEqual(given.body_fields(), {"temperature": 0.0, "top_k": -1, "repetition_penalty": 1.1})
        self.assertEqual([flag_of(SamplingOptions, name) for name in given.body_fields()],
                         ["--temperature", "--top-k", "--repetition-penalty"])  # fmt: skip

    def test_a_response_format_that_is_not_one_is_refused(self) -> None:
        from attention_kv_caceh.harness.sampling import (
            _response_format,  # pyright: ignore[reportPrivateUsage]
        )

        self.assertEqual(_response_format('{"type": "json_object"}'), {"type": "json_object"})
        for bad in ("{", '{"type": "yaml"}', '{"type": "json_schema"}', "[]"):
            with self.subTest(text=bad), self.assertRaises(ValueError):
                _response_format(bad)

    def test_values_the_server_refuses_raise_naming_the_field(self) -> None:
        cases: dict[str, dict[str, Any]] = {
            "--temperature": {"temperature": -0.5},
            "--top-p": {"top_p": 0.0},
            "--top-k": {"top_k": -2},
            "--frequency-penalty": {"frequency_penalty": 2.5},
            "--presence-penalty": {"presence_penalty": float("nan")},
            "--repetition-penalty": {"repetition_penalty": 0.0},
        }
        for flag, kwargs in cases.items():
            with self.subTest(flag=flag), self.assertRaises(ConfigError) as caught:
                SamplingOptions(**kwargs)
            self.assertEqual(flag_of(SamplingOptions, caught.exception.field), flag)  # the CLI names it
            self.assertIn(str(next(iter(kwargs.values()))), str(caught.exception))
        for ok in ({"temperature": 0.0}, {"top_p": 1.0}, {"top_k": 0}, {"presence_penalty": -2.0}):
            SamplingOptions(**ok)  # the edges the server accepts


class SamplingBodyTest(unittest.IsolatedAsyncioTestCase):
    async def payloads(self, backend: BackendName, sampling: SamplingOptions) -> list[dict[str, Any]]:
        script = lambda p, path: timed_token_script(0, 0, 2, prompt_tokens=word_count(p))  # noqa: E731
        async with ScriptedServer(script) as server:
            config = HarnessConfig(
                backend=backend,
                base_url=server.base_url,
                num_requests=3,
                warmup_requests=1,
                prompt_len=LengthRange(4, 4),
                output_len=LengthRange(2, 2),
                server_metrics_interval_s=0,
                sampling=sampling,
            )
            result = await run_harness(config)
            self.assertEqual(result.summary["failed"], 0, result.summary["failures"])
            return list(server.counters.payloads)

    async def test_every_body_holds_exactly_the_given_sampling_fields(self) -> None:
        given = SamplingOptions(temperature=0.7, top_p=0.9, top_k=20, presence_penalty=0.5)
        for backend in ("openai-completions", "openai-chat"):
            with self.subTest(backend=backend):
                payloads = await self.payloads(backend, given)
                self.assertEqual(len(payloads), 5)  # smoke test, warm-up, 3 measured
                for body in payloads:
                    sent = {k: body[k] for k in SAMPLING_KEYS if k in body}
                    self.assertEqual(
                        sent, {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "presence_penalty": 0.5}
                    )

    async def test_a_response_format_reaches_every_body(self) -> None:
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
        payloads = await self.payloads("openai-chat", SamplingOptions(response_format=fmt))
        self.assertEqual(len(payloads), 5)
        self.assertTrue(all(body["response_format"] == fmt for body in payloads))

    async def test_no_sampling_field_is_sent_when_none_is_given(self) -> None:
        for backend in ("openai-completions", "openai-chat"):
            with self.subTest(backend=backend):
                payloads = await self.payloads(backend, SamplingOptions())
                self.assertEqual(len(payloads), 5)
                for body in payloads:
                    self.assertEqual(SAMPLING_KEYS & set(body), set())


class SamplingFlagsTest(unittest.TestCase):
    def test_flags_reach_the_config_and_its_description(self) -> None:
        args = parse(["--backend", "openai-chat", "--temperature", "0", "--top-k", "5"])
        config = config_from_args(args)
        self.assertEqual(config.sampling, SamplingOptions(temperature=0.0, top_k=5))
        self.assertEqual(config.describe()["sampling"], {"temperature": 0.0, "top_k": 5})
        none = config_from_args(parse(["--backend", "openai-completions"]))
        self.assertEqual(none.describe()["sampling"], {})
        self.assertNotIn("sampling", config_from_args(parse([])).describe())  # simulated: nothing sent

    def test_simulated_backend_refuses_a_sampling_flag_with_exit_2(self) -> None:
        for command in ("harness", "sweep"):
            for flag, value in (("--temperature", "0"), ("--top-p", "0.5"), ("--repetition-penalty", "1.2")):
                with self.subTest(command=command, flag=flag):
                    extra = ["--out-dir", "unused-dir"] if command == "sweep" else []
                    code, out, err = quietly(command, [flag, value, *extra])
                    self.assertEqual((code, out), (2, ""))
                    self.assertEqual(len(err.splitlines()), 1, err)
                    self.assertIn(flag, err)

    def test_a_bad_value_exits_2_naming_the_flag_and_value(self) -> None:
        http = ["--backend", "openai-completions", "--base-url", "http://127.0.0.1:9"]
        for flag, value in (
            ("--temperature", "-1"),
            ("--top-p", "1.5"),
            ("--top-k", "-3"),
            ("--temperature", "inf"),
        ):
            with self.subTest(flag=flag, value=value):
                code, out, err = quietly("harness", [*http, flag, value])
                self.assertEqual((code, out), (2, ""))
                self.assertEqual(len(err.splitlines()), 1, err)
                self.assertIn(flag, err)
                self.assertIn(value, err)
        with self.assertRaises(UsageError):
            config_from_args(parse([*http, "--frequency-penalty", "3"]))

    def test_an_http_run_without_temperature_warns_once_on_stderr(self) -> None:
        cases = {
            ("--backend", "openai-completions"): 1,
            ("--backend", "openai-chat", "--temperature", "0"): 0,
            (): 0,  # simulated: there is no server default to speak of
        }
        for argv, lines in cases.items():
            with self.subTest(argv=argv):
                err = io.StringIO()
                with contextlib.redirect_stderr(err):
                    warn_server_temperature(config_from_args(parse(list(argv))))
                self.assertEqual(len(err.getvalue().splitlines()), lines)
                if lines:
                    self.assertIn("--temperature 0", err.getvalue())


class ReportShowsSamplingTest(unittest.TestCase):
    def test_the_report_states_the_fields_sent(self) -> None:
        from attention_kv_caceh.harness.records import RequestRecord

        record = RequestRecord(
            request_id=0, arrival_ns=0, requested_prompt_tokens=4, requested_output_tokens=2
        )
        record.dispatch_ns = 0
        record.add_token_event(1_000_000, 1)
        record.add_token_event(2_000_000, 1)
        record.stream_end_ns = 2_000_000
        record.output_tokens = 2
        record.status = "ok"
        given = serving_section("r", [record], {"config": {"sampling": {"temperature": 0.0, "top_k": 5}}})
        self.assertIn("`temperature` 0.0, `top_k` 5", given)
        none = serving_section("r", [record], {"config": {"sampling": {}}})
        self.assertIn("no field sent", none)
        problems: list[str] = []
        serving_section("r", [record], {"config": {"sampling": 3}}, problems)
        self.assertEqual(len(problems), 1)


if __name__ == "__main__":
    unittest.main()
