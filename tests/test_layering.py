"""The import rule, edge by edge: imports go one way down the layers, and no module takes part in a circle.

    benchmark.py (the console entry) -> cli -> report -> experiments, harness, benchmarks, toy_model
      -> entrypoints -> engine -> model_executor -> kernels | the root's modules (the ground)

A module may import its own folder and any folder of a lower layer; within a layer only the edges of
SIBLING_EDGES. The bottom layer is two worlds: `kernels/` imports nothing of the package outside
`kernels/`, and the root's modules (files, options, timing, attention, cache, ...) import no package
folder. Outside `kernels/`, nothing imports a `kernels._*` module (the compiled loops behind an op's
module). engine/ imports no HTTP framework (the HTTP server is entrypoints/, as vLLM's
`vllm/entrypoints/`), and `kernels/__init__.py` imports nothing (so no Numba).

Every module of the package is parsed with `ast` and every import in it is read: the ones inside
functions and `if TYPE_CHECKING:` blocks too (a circle through a type-only import is still a circle
of the design), relative ones resolved against the module's package, and `importlib.import_module(...)`
/ `__import__(...)` with a literal name. The tests of this module plant a violation of each rule and
check that it is found.
"""

from __future__ import annotations

import ast
import unittest
from pathlib import Path

import attention_kv_caceh

PACKAGE_DIR = Path(attention_kv_caceh.__file__).parent
PACKAGE = "attention_kv_caceh"
ENTRY = f"{PACKAGE}.benchmark"
ROOT = "<root>"  # the group of the root's modules
LAYERS: tuple[tuple[str, ...], ...] = (
    ("benchmark",),
    ("cli",),
    ("report",),
    ("experiments", "harness", "benchmarks", "toy_model"),
    ("entrypoints",),
    ("engine",),
    ("model_executor",),
    ("kernels", ROOT),
)
SIBLING_EDGES = {("benchmarks", "harness")}  # the engine benchmarks' copy workload is the harness's
HTTP_FRAMEWORKS = ("fastapi", "starlette", "uvicorn")
RANK = {group: rank for rank, groups in enumerate(LAYERS) for group in groups}


def module_name(path: Path) -> str:
    """The dotted name of a module file under the package (`attention_kv_caceh.engine.core`)."""
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package."""
    return {module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def group_of(module: str) -> str:
    """The folder a package module belongs to ("engine", ...), ROOT for the root's modules, "benchmark"
    for the console entry."""
    if module == ENTRY:
        return "benchmark"
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (PACKAGE_DIR / parts[1]).is_dir()):
        return parts[1]
    return ROOT


def imported_names(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, which is module `module`; a
    `from X import y` gives both X and X.y (y may be a module)."""
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


def package_imports(
    source: str, module: str, known: set[str], is_package: bool = False
) -> list[tuple[int, str]]:
    """(line, module) of every package module `source` imports, each name cut to the longest known
    module it starts with (`from x.y import f` -> x.y); the module itself and its ancestors left out."""
    found: list[tuple[int, str]] = []
    for line, name in imported_names(source, module, is_package):
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module and not module.startswith(name + ".") and (line, name) not in found:
            found.append((line, name))
    return found


def rule_violations(module: str, imports: list[tuple[int, str]]) -> list[str]:
    """`line: name (why)` for each import of `module` the rule forbids (module docstring). `imports`:
    absolute names, package modules and third-party ones alike."""
    group = group_of(module)
    found: list[str] = []
    for line, name in imports:
        if group == "engine" and any(name == f or name.startswith(f + ".") for f in HTTP_FRAMEWORKS):
            found.append(f"{line}: {name} (engine/ imports no HTTP framework)")
        if module == f"{PACKAGE}.kernels" and name.split(".")[0] in ("numba", "llvmlite"):
            found.append(f"{line}: {name} (kernels/__init__ imports no Numba)")
        if name != PACKAGE and not name.startswith(PACKAGE + "."):
            continue
        target = group_of(name)
        if name.startswith(f"{PACKAGE}.kernels._") and group != "kernels":
            found.append(f"{line}: {name} (a kernels._* module outside kernels/)")
        if target == group or name == PACKAGE:
            continue
        if RANK[target] <= RANK[group] and (group, target) not in SIBLING_EDGES:
            found.append(f"{line}: {name} ({group} -> {target} goes up or sideways)")
    return found


def import_graph() -> dict[str, set[str]]:
    """Package module -> the package modules it imports (every import, module docstring)."""
    modules = package_modules()
    known = set(modules)
    return {
        name: {
            m
            for _, m in package_imports(
                path.read_text(encoding="utf-8"), name, known, path.name == "__init__.py"
            )
        }
        for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, set())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def planted(source: str, module: str, is_package: bool = False) -> list[str]:
    """The rule's verdict on `source` planted as module `module` of the package."""
    known = set(package_modules())
    names = imported_names(source, module, is_package)
    ours = package_imports(source, module, known, is_package)
    others = [(line, name) for line, name in names if not name.startswith(PACKAGE)]
    return rule_violations(module, ours + others)


class PlantedViolationTest(unittest.TestCase):
    """Each rule, shown to fire on a planted import and to pass its allowed neighbour."""

    def test_every_form_of_an_upward_import_is_seen(self) -> None:
        module = f"{PACKAGE}.engine.some_module"
        cases = {
            "import attention_kv_caceh.entrypoints.openai.api_server": True,
            "from attention_kv_caceh.entrypoints.chat_utils import ChatTemplate": True,
            "from attention_kv_caceh import entrypoints": True,
            "from ..entrypoints.openai import protocol": True,
            "from .. import entrypoints": True,
            "def f():\n    from attention_kv_caceh.cli import common\n": True,
            "if TYPE_CHECKING:\n    from attention_kv_caceh.harness import records\n": True,
            "importlib.import_module('attention_kv_caceh.report.build')": True,
            "def f():\n    from fastapi import FastAPI\n": True,
            "if TYPE_CHECKING:\n    import starlette.types\n": True,
            "importlib.import_module('uvicorn')": True,
            "import attention_kv_caceh.engine.core\nfrom . import request\nimport fastapi_like": False,
            "from attention_kv_caceh.model_executor.model import Model": False,
            "from attention_kv_caceh.kernels.dispatch import GGUF": False,
            "from attention_kv_caceh.options import option": False,
        }
        for source, bad in cases.items():
            with self.subTest(source=source):
                self.assertEqual(bool(planted(source, module)), bad, planted(source, module))

    def test_a_relative_import_in_a_subpackage_resolves_from_that_subpackage(self) -> None:
        module = f"{PACKAGE}.engine.spec_decode.proposer"
        self.assertTrue(planted("from ...entrypoints import chat_utils", module))
        self.assertFalse(planted("from ..core import EngineCore", module))
        init = f"{PACKAGE}.engine.spec_decode"
        self.assertTrue(planted("from ...entrypoints import chat_utils", init, is_package=True))

    def test_each_rule_fires_on_its_planted_violation(self) -> None:
        cases = [  # (module, source, violates)
            (f"{PACKAGE}.kernels.gemm", "from attention_kv_caceh.timing import measure", True),
            (f"{PACKAGE}.kernels.gemm", "from attention_kv_caceh.kernels import _gemm_jit", False),
            (f"{PACKAGE}.kernels", "import numba", True),
            (
                f"{PACKAGE}.model_executor.layers",
                "from attention_kv_caceh.kernels import _fused_layers_jit",
                True,
            ),
            (f"{PACKAGE}.model_executor.layers", "from attention_kv_caceh.kernels._gemm_jit import x", True),
            (
                f"{PACKAGE}.model_executor.layers",
                "from attention_kv_caceh.kernels import fused_layers",
                False,
            ),
            (
                f"{PACKAGE}.model_executor.model",
                "from attention_kv_caceh.engine.request import Request",
                True,
            ),
            (f"{PACKAGE}.timing", "from attention_kv_caceh.engine import config", True),
            (f"{PACKAGE}.timing", "from attention_kv_caceh.kernels import dispatch", True),
            (f"{PACKAGE}.timing", "from attention_kv_caceh import options", False),
            (f"{PACKAGE}.harness.sweep", "from attention_kv_caceh.experiments.scan_stats import X", True),
            (f"{PACKAGE}.experiments.overhead", "from attention_kv_caceh.harness import overhead", True),
            (
                f"{PACKAGE}.harness.scripted_server",
                "from attention_kv_caceh.cli.common import UsageError",
                True,
            ),
            (f"{PACKAGE}.harness.copy_workload", "from attention_kv_caceh.benchmarks import engine", True),
            (f"{PACKAGE}.benchmarks.engine", "from attention_kv_caceh.harness import copy_workload", False),
            (f"{PACKAGE}.entrypoints.llm", "from attention_kv_caceh.cli import common", True),
            (f"{PACKAGE}.cli.serve", "from attention_kv_caceh.entrypoints.openai import cli_args", False),
            (f"{PACKAGE}.benchmark", "from attention_kv_caceh.cli import main", False),
        ]
        for module, source, bad in cases:
            with self.subTest(module=module, source=source):
                self.assertEqual(bool(planted(source, module)), bad, planted(source, module))

    def test_the_cycle_check_finds_a_circle(self) -> None:
        graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set[str]()}
        self.assertEqual(find_cycle(graph), ["a", "b", "c", "a"])
        self.assertIsNone(find_cycle({"a": {"b"}, "b": set[str]()}))


class LayeringTest(unittest.TestCase):
    def test_every_group_has_a_layer(self) -> None:
        groups = {group_of(name) for name in package_modules()}
        self.assertIn("model_executor", groups)  # the walk found the package's folders
        self.assertEqual(groups - set(RANK), set())

    def test_every_import_of_the_package_follows_the_rule(self) -> None:
        modules = package_modules()
        known = set(modules)
        self.assertGreater(len(modules), 150)
        for name, path in modules.items():
            source = path.read_text(encoding="utf-8")
            is_package = path.name == "__init__.py"
            ours = package_imports(source, name, known, is_package)
            others = [
                (line, n) for line, n in imported_names(source, name, is_package) if not n.startswith(PACKAGE)
            ]
            with self.subTest(module=name):
                found = rule_violations(name, ours + others)
                self.assertEqual(found, [], f"{name}: {found}")

    def test_kernels_init_imports_nothing(self) -> None:
        tree = ast.parse((PACKAGE_DIR / "kernels" / "__init__.py").read_text(encoding="utf-8"))
        imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
        self.assertEqual(
            [ast.unparse(n) for n in imports if ast.unparse(n) != "from __future__ import annotations"], []
        )

    def test_no_import_circle_counting_every_import(self) -> None:
        self.assertIsNone(find_cycle(import_graph()))


if __name__ == "__main__":
    unittest.main()
