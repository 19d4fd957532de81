"""The layers' one rule: entrypoints -> engine, never back, and engine/ holds no HTTP code.

Every module under `attention_kv_caceh/engine/` is parsed with `ast`, and every import in it is read,
the ones inside functions and `if TYPE_CHECKING:` blocks included, relative ones resolved against the
module's package, and `importlib.import_module("...")` / `__import__("...")` with a literal name too.
None may name `attention_kv_caceh.entrypoints` (the HTTP server, as vLLM's `vllm/entrypoints/`) or an HTTP
framework (FastAPI, Starlette, uvicorn).
"""

from __future__ import annotations

import ast
import unittest
from pathlib import Path

import attention_kv_caceh.engine

ENGINE = Path(attention_kv_caceh.engine.__file__).parent
PACKAGE = "attention_kv_caceh"
FORBIDDEN = (f"{PACKAGE}.entrypoints", "fastapi", "starlette", "uvicorn")


def module_name(path: Path) -> str:
    """The dotted name of a module file under the package (`attention_kv_caceh.engine.core`)."""
    parts = list(path.relative_to(ENGINE.parent.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, which is module `module`."""
    package = module if is_package else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((node.lineno, base))
            out.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value))
    return out


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """`line: name` for each import of `source` that the rule forbids."""
    found: list[str] = []
    for line, name in imported_names(source, module, is_package):
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN):
            found.append(f"{line}: {name}")
    return found


class LayeringTest(unittest.TestCase):
    def test_the_check_sees_every_form_of_a_forbidden_import(self) -> None:
        cases = {
            "import attention_kv_caceh.entrypoints.openai.api_server": 1,
            "from attention_kv_caceh.entrypoints.chat_utils import ChatTemplate": 1,
            "from attention_kv_caceh import entrypoints": 1,
            "from ..entrypoints.openai import protocol": 1,
            "from .. import entrypoints": 1,
            "def f():\n    from fastapi import FastAPI\n": 1,
            "if TYPE_CHECKING:\n    import starlette.types\n": 1,
            "importlib.import_module('uvicorn')": 1,
            "import attention_kv_caceh.engine.core\nfrom . import request\nimport fastapi_like": 0,
            "from .entrypoints_notes import x": 0,  # engine/entrypoints_notes.py would be inside engine/
        }
        for source, expected in cases.items():
            with self.subTest(source=source):
                found = violations(source, f"{PACKAGE}.engine.some_module")
                self.assertEqual(len(found) > 0, expected > 0, found)

    def test_a_relative_import_in_a_subpackage_resolves_from_that_subpackage(self) -> None:
        module = f"{PACKAGE}.engine.spec_decode.proposer"
        self.assertTrue(violations("from ...entrypoints import chat_utils", module))
        self.assertFalse(violations("from ..core import EngineCore", module))
        init = f"{PACKAGE}.engine.spec_decode"
        self.assertTrue(violations("from ...entrypoints import chat_utils", init, is_package=True))

    def test_no_engine_module_imports_entrypoints_or_an_http_framework(self) -> None:
        modules = sorted(ENGINE.rglob("*.py"))
        self.assertGreater(len(modules), 20)  # the walk found the package
        for path in modules:
            name = module_name(path)
            with self.subTest(module=name):
                found = violations(path.read_text(encoding="utf-8"), name, path.name == "__init__.py")
                self.assertEqual(found, [], f"{name} imports what engine/ must not: {found}")


if __name__ == "__main__":
    unittest.main()
