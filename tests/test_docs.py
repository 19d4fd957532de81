"""The README and docs/: every bash block marked, every link and named path there, every `path:function` of
docs/engine.md importable. (scripts/check_docs.py runs the marked commands; this only reads files.)"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
import sys
import unittest
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "attention_kv_caceh"


def _check_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_docs", ROOT / "scripts" / "check_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_docs"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


check_docs = _check_docs()
DOCS = [ROOT / name for name in check_docs.DOC_FILES]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def prose(path: Path) -> str:
    """The text outside fenced blocks."""
    return re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)


class MarkersTest(unittest.TestCase):
    def test_parser_reads_markers_and_timeouts(self) -> None:
        text = "<!-- runnable timeout=7 -->\n```bash\necho a\n```\n\n<!-- not-run: why -->\n```bash\nx\n```\n```bash\ny\n```\n"
        blocks = check_docs.parse_blocks("t.md", text)
        self.assertEqual(
            [(b.runnable, b.not_run, b.timeout_s) for b in blocks],
            [(True, False, 7), (False, True, 300), (False, False, 300)],
        )
        self.assertEqual([b.line for b in blocks], [2, 7, 10])
        self.assertEqual(blocks[0].text, "echo a")

    def test_every_bash_block_has_exactly_one_marker(self) -> None:
        for path in DOCS:
            for block in check_docs.parse_blocks(path.name, path.read_text(encoding="utf-8")):
                if block.lang == "bash":
                    with self.subTest(file=path.name, line=block.line):
                        self.assertTrue(block.runnable != block.not_run)
                else:
                    self.assertFalse(block.runnable, f"{path.name}:{block.line} runnable but not bash")

    def test_runnable_blocks_call_the_package_through_uv(self) -> None:
        blocks = check_docs.runnable_blocks()
        self.assertGreaterEqual(len(blocks), 10)
        for block in blocks:
            for line in block.text.splitlines():
                if line.strip() and not line.startswith(" "):  # a command's first line, not a continuation
                    with self.subTest(block=f"{block.path}:{block.line}"):
                        self.assertIn("uv run", line)

    def test_the_model_is_written_before_a_block_uses_it(self) -> None:
        blocks = check_docs.runnable_blocks()
        writes = [i for i, b in enumerate(blocks) if "make-model --out models/tiny-llama" in b.text]
        uses = [i for i, b in enumerate(blocks) if "--model models/tiny-llama" in b.text]
        self.assertEqual(len(writes), 1)  # a second make-model into the same folder would fail
        self.assertTrue(uses)
        self.assertLessEqual(writes[0], min(uses))


class LinksAndPathsTest(unittest.TestCase):
    def test_readme_is_short(self) -> None:
        self.assertLessEqual(len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()), 300)

    def test_every_relative_link_and_anchor_exists(self) -> None:
        for path in DOCS:
            for target in re.findall(r"\]\(([^)\s]+)\)", prose(path)):
                if re.match(r"^[a-z]+://", target):
                    continue
                file_part, _, anchor = target.partition("#")
                linked = (path.parent / file_part).resolve() if file_part else path
                with self.subTest(file=path.name, link=target):
                    self.assertTrue(linked.exists())
                    if anchor:
                        self.assertIn(anchor, anchors(linked))

    def test_every_named_repository_path_exists(self) -> None:
        for path in DOCS:
            for name in re.findall(r"`([\w./-]+\.(?:py|sh|png|md))`", path.read_text(encoding="utf-8")):
                if name.startswith(("results/", "models/", "/", "vllm/")) or "/" not in name:
                    continue  # outputs, vLLM's files, bare module names (checked through their folder below)
                candidates = [ROOT / name, PACKAGE / name, ROOT / "docs" / name]
                with self.subTest(file=path.name, path=name):
                    self.assertTrue(any(c.exists() for c in candidates))

    def test_no_planning_words(self) -> None:
        pattern = re.compile(
            r"previous round|this round|the issue|target|notes' ?§|exercise 9|user's notes|original brief",
            re.I,
        )
        for path in DOCS:
            with self.subTest(file=path.name):
                self.assertEqual(pattern.findall(path.read_text(encoding="utf-8")), [])

    def test_no_path_of_one_machine_outside_the_repository(self) -> None:
        for path in DOCS:  # a /tmp path is one any reader can make; a home or workspace folder is not
            with self.subTest(file=path.name):
                self.assertEqual(
                    re.findall(r"(?<![\w.])/(?:work|home|Users|root)/\S*", path.read_text(encoding="utf-8")),
                    [],
                )


class ReadmeFiguresTest(unittest.TestCase):
    def test_the_throughput_section_quotes_the_scan_table_above_it(self) -> None:
        text = (ROOT / "README.md").read_text(encoding="utf-8")
        table = text[text.index("B  P50 ms") : text.index("Saturation:")]
        rows = {r.split()[0]: r.split() for r in table.splitlines()[2:] if r.strip()}
        first, last = rows["1"], rows[max(rows, key=int)]  # columns: B, P50, P95, min, max, ms/seq, ...
        section = text[text.index("## Throughput is not latency") : text.index("## Layout")]
        quoted = re.findall(r"\d+\.\d+", section.split("\n\n")[1])
        self.assertEqual(quoted[:4], [last[1], first[1], first[5], last[5]])
        self.assertEqual(quoted[4] + "x", last[7])  # positions/s rise by the speedup column


class RequestWalkTest(unittest.TestCase):
    def test_every_path_function_of_the_request_walk_resolves(self) -> None:
        text = (ROOT / "docs" / "engine.md").read_text(encoding="utf-8")
        walk = text[text.index("## Follow one request") : text.index("## The step table")]
        refs = re.findall(r"`([\w/]+\.py):([\w.]+)`", walk)
        self.assertGreaterEqual(len(refs), 12)
        for file, attribute in refs:
            with self.subTest(ref=f"{file}:{attribute}"):
                self.assertTrue((PACKAGE / file).is_file())
                module = importlib.import_module(
                    "attention_kv_caceh." + file[: -len(".py")].replace("/", ".")
                )
                obj: object = module
                for part in attribute.split("."):
                    self.assertTrue(hasattr(obj, part), f"{file} has no {attribute}")
                    obj = getattr(obj, part)
                self.assertTrue(callable(obj))


class ReadmeTourTest(unittest.TestCase):
    def test_every_tour_command_parses_and_the_trace_row_reads_its_trace(self) -> None:
        """Each command of the README's tour is one a reader can paste: its flags parse (a required one
        is given), and the trace row's file is read with the block size it states."""
        from attention_kv_caceh.cli import SUBCOMMANDS, build_parser
        from attention_kv_caceh.cli import harness as harness_cli

        text = (ROOT / "README.md").read_text(encoding="utf-8")
        tour = text[text.index("## A tour") :].split("\n\n")[2]
        commands = [re.findall(r"`([^`]+)`", row.split("|")[1])[0] for row in tour.splitlines()[2:]]
        self.assertGreaterEqual(len(commands), 10)
        for command in commands:
            argv = shlex.split(command)
            if "..." in argv:  # a row that names a flag's value for the reader to choose
                continue
            with self.subTest(command=command):
                name = argv[0] if argv[0] in SUBCOMMANDS else ""
                args = build_parser(name).parse_args(argv[1:] if name else argv)
                if name == "harness":
                    self.assertGreater(harness_cli.config_from_args(args).num_requests, 0)


if __name__ == "__main__":
    unittest.main()
