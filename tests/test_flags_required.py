"""The additive parts of the flag builder: required flags and groups, extend, and the default shown for
a flag whose own default is "not given"."""

from __future__ import annotations

import unittest
from dataclasses import dataclass

from attention_kv_caceh.cli.common import HelpFormatter, OneLineParser, UsageError
from attention_kv_caceh.cli.flags import add_options
from attention_kv_caceh.options import ConfigError, check_field, option


@dataclass(frozen=True)
class _Config:
    model: str | None = option(None, help="the model", required=True)
    prompt: tuple[str, ...] | None = option(
        None, help="texts", nargs="+", extend=True, exclusive="src", required=True
    )
    prompts_file: str | None = option(None, help="a file", exclusive="src")
    seqs: int = option(8, help="most requests", minimum=1)


def _parser(**kwargs: object) -> OneLineParser:
    parser = OneLineParser(prog="t", formatter_class=HelpFormatter)
    add_options(parser, _Config, **kwargs)  # pyright: ignore[reportArgumentType]
    return parser


class RequiredAndExtendTest(unittest.TestCase):
    def test_a_required_flag_and_a_required_group_must_be_given(self) -> None:
        for argv, names in ((["--prompt", "a"], "--model"), (["--model", "m"], "--prompt --prompts-file")):
            with self.subTest(argv=argv), self.assertRaises(UsageError) as ctx:
                _parser().parse_args(argv)
            self.assertIn(names, str(ctx.exception))
        with self.assertRaises(UsageError):
            _parser().parse_args(["--model", "m", "--prompt", "a", "--prompts-file", "f"])

    def test_extend_adds_the_values_of_every_occurrence(self) -> None:
        args = _parser().parse_args(["--model", "m", "--prompt", "a", "b", "--prompt", "c"])
        self.assertEqual(args.prompt, ["a", "b", "c"])

    def test_a_default_left_unset_shows_the_fields_own(self) -> None:
        self.assertIn("(default: 8)", _parser(defaults={"seqs": None}).format_help())
        self.assertIsNone(_parser(defaults={"seqs": None}).parse_args(["--model", "m", "--prompt", "a"]).seqs)

    def test_check_field_checks_one_value_without_the_config(self) -> None:
        check_field(_Config, "seqs", 3)
        check_field(_Config, "seqs", None)
        with self.assertRaises(ConfigError) as ctx:
            check_field(_Config, "seqs", 0)
        self.assertEqual(ctx.exception.field, "seqs")


if __name__ == "__main__":
    unittest.main()
