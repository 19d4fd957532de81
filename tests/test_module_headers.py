"""Every engine, model_executor and entrypoints module's header names its vLLM counterpart and says what it leaves out (or
that vLLM has none).

A reader who knows vLLM's source should learn from the first lines of each module which vLLM file it mirrors
and what of that file is missing here. Private modules (`_name.py`, the place for compiled kernels) are skipped;
package `__init__.py` files are checked.
"""

from __future__ import annotations

import ast
import re
import unittest
from pathlib import Path

import attention_kv_caceh.engine
import attention_kv_caceh.entrypoints
import attention_kv_caceh.model_executor

ENGINE = Path(attention_kv_caceh.engine.__file__).parent
ENTRYPOINTS = Path(attention_kv_caceh.entrypoints.__file__).parent
MODEL_EXECUTOR = Path(attention_kv_caceh.model_executor.__file__).parent
# "Left out: ...", "... leaves out ...", or "vLLM has no counterpart: ..."; wrapped lines are joined first.
_OMISSIONS = re.compile(r"\b(left out|leaves out|no counterpart)\b", re.IGNORECASE)


def engine_modules(root: Path = ENGINE) -> list[Path]:
    """Every module under `root` (engine/ by default) a header is required of, sorted."""
    return sorted(
        path for path in root.rglob("*.py") if path.name == "__init__.py" or not path.name.startswith("_")
    )


def header_problem(docstring: str | None) -> str | None:
    """What a module header lacks, in words, or None when it names vLLM and what it leaves out."""
    if not docstring:
        return "has no module docstring"
    text = " ".join(docstring.split())
    if "vllm" not in text.lower():
        return "does not name its vLLM counterpart"
    if _OMISSIONS.search(text) is None:
        return 'does not say what it leaves out ("Left out: ..." or "vLLM has no counterpart: ...")'
    return None


class ModuleHeaderTest(unittest.TestCase):
    def test_the_check_refuses_a_header_without_the_parts(self) -> None:
        self.assertIsNotNone(header_problem(None))
        self.assertIsNotNone(header_problem("Corresponds to vLLM's `vllm/v1/core/sched/scheduler.py`."))
        self.assertIsNotNone(header_problem("A scheduler. Left out: preemption by swapping."))
        self.assertIsNone(header_problem("Corresponds to vLLM's scheduler.py. Left\nout: swapping."))
        self.assertIsNone(header_problem("vLLM has no counterpart: it never trains a tokenizer."))

    def test_every_engine_module_names_vllm_and_what_it_leaves_out(self) -> None:
        self.check_headers(ENGINE, at_least=20)

    def test_every_entrypoints_module_names_vllm_and_what_it_leaves_out(self) -> None:
        self.check_headers(ENTRYPOINTS, at_least=10)

    def test_every_model_executor_module_names_vllm_and_what_it_leaves_out(self) -> None:
        self.check_headers(MODEL_EXECUTOR, at_least=10)

    def check_headers(self, root: Path, at_least: int) -> None:
        modules = engine_modules(root)
        self.assertGreaterEqual(len(modules), at_least)  # the walk found the package
        for path in modules:
            name = path.relative_to(root.parent).as_posix()
            with self.subTest(module=name):
                problem = header_problem(ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))))
                self.assertIsNone(problem, f"{name}: its header {problem}")


if __name__ == "__main__":
    unittest.main()
