"""The package's layout: every module imports on its own, no import circle, and only `cli/` prints or
parses flags (the scripted server's child-process entry, which reports its port on stdout, is
`cli/scripted_server.py`)."""

from __future__ import annotations

import ast
import subprocess
import sys
import unittest
from pathlib import Path

import attention_kv_caceh
from tests.test_layering import find_cycle

PACKAGE = Path(attention_kv_caceh.__file__).parent
ROOT = "attention_kv_caceh"


def module_names() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


def source_of(name: str) -> Path:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _is_guard(node: ast.If) -> bool:
    """`if TYPE_CHECKING:` or `if __name__ == "__main__":`: imports there do not run on import."""
    text = ast.unparse(node.test)
    return "TYPE_CHECKING" in text or "__name__" in text


def top_level_imports(name: str, known: set[str]) -> set[str]:
    """Package modules `name` imports when it is imported (module level, outside the two guards)."""
    tree = ast.parse(source_of(name).read_text(encoding="utf-8"))
    found: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.If) and not _is_guard(node):
            body += node.body + node.orelse
        elif isinstance(node, (ast.Try,)):
            body += node.body + node.orelse + node.finalbody
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {m for m in found if m in known and m != name}


class LayoutTest(unittest.TestCase):
    def test_every_module_imports_alone(self) -> None:
        script = (
            "import importlib, sys, traceback\n"
            f"failed = []\nfor name in {module_names()!r}:\n"
            f"    for loaded in [m for m in sys.modules if m == {ROOT!r} or m.startswith({ROOT + '.'!r})]:\n"
            "        del sys.modules[loaded]\n"
            "    try:\n        importlib.import_module(name)\n"
            "    except Exception:\n        failed.append(name + ': ' + traceback.format_exc(limit=1))\n"
            "print('\\n'.join(failed))\n"
        )
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.strip(), "")

    def test_no_import_circle(self) -> None:
        names = set(module_names())
        graph = {name: top_level_imports(name, names) for name in names}
        self.assertIsNone(find_cycle(graph))

    def test_the_cycle_check_finds_a_circle(self) -> None:
        graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set[str]()}
        self.assertEqual(find_cycle(graph), ["a", "b", "c", "a"])
        self.assertIsNone(find_cycle({"a": {"b"}, "b": set[str]()}))

    def test_only_cli_prints_or_parses_flags(self) -> None:
        for name in module_names():
            if name.startswith(f"{ROOT}.cli"):
                continue
            tree = ast.parse(source_of(name).read_text(encoding="utf-8"))
            with self.subTest(module=name):
                for node in ast.walk(tree):
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                        self.assertNotEqual(node.func.id, "print", f"line {node.lineno}")
                    if isinstance(node, ast.Import):
                        self.assertNotIn("argparse", [a.name for a in node.names], f"line {node.lineno}")

    def test_nothing_imports_the_command_layer_or_the_report_upward(self) -> None:
        names = set(module_names())
        for name in names:
            imports = top_level_imports(name, names)
            with self.subTest(module=name):
                if not name.startswith(f"{ROOT}.cli") and name != f"{ROOT}.benchmark":
                    self.assertFalse([m for m in imports if m.startswith(f"{ROOT}.cli")])
                if name.startswith((f"{ROOT}.experiments", f"{ROOT}.harness")):
                    self.assertFalse([m for m in imports if m.startswith(f"{ROOT}.report")])

    def test_one_markdown_table_writer(self) -> None:
        """Every Markdown table goes through `tables.markdown_table`: no other module writes a rule row."""
        writers = [name for name in module_names() if "--- |" in source_of(name).read_text(encoding="utf-8")]
        self.assertEqual(writers, [f"{ROOT}.tables"])


if __name__ == "__main__":
    unittest.main()
