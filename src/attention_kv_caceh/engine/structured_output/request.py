"""StructuredOutputRequest: a request's constraint and the grammar compiled for it.

Corresponds to vLLM's `vllm/v1/structured_output/request.py` (StructuredOutputRequest: the params, the
grammar future, `is_grammar_ready`). Left out: the reasoning-end flag (no reasoning parsers) and the
structured-output key cache (each request compiles its own grammar; llguidance compiles lazily, so
building a matcher costs about a millisecond for the schemas here, see docs/results.md).
"""

from __future__ import annotations

from concurrent.futures import Future

from .backend_guidance import GuidanceGrammar
from .params import StructuredOutputsParams

__all__ = ["StructuredOutputRequest"]


class StructuredOutputRequest:
    """The constraint of one request and, once compiled, its GuidanceGrammar.

    Attributes:
        params: the StructuredOutputsParams.
        future: the compile job (StructuredOutputManager.grammar_init), None before it is submitted.
    """

    def __init__(self, params: StructuredOutputsParams) -> None:
        self.params = params
        self.future: Future[GuidanceGrammar] | None = None
        self._grammar: GuidanceGrammar | None = None

    @property
    def is_grammar_ready(self) -> bool:
        """The compile job finished (with a grammar or an error)."""
        return self._grammar is not None or (self.future is not None and self.future.done())

    @property
    def compile_error(self) -> str | None:
        """Why the grammar could not be compiled, None while compiling or when it compiled."""
        if self.future is None or not self.future.done():
            return None
        exc = self.future.exception()
        return None if exc is None else f"structured outputs ({self.params.kind}): {exc}"

    @property
    def grammar(self) -> GuidanceGrammar | None:
        """The compiled grammar; None while compiling or after a compile error."""
        future = self.future
        if self._grammar is None and future is not None and future.done() and future.exception() is None:
            self._grammar = future.result()
        return self._grammar
