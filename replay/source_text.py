"""The text of a generated replay function as it is written, and its compiling.

The emitters of a replay's lines (replay.graph_source, replay.graph_checks, replay.graph_outputs,
replay.graph_step's argument maker) all write into a :class:`Source`: lines at their depth and
values bound into the function's namespace under generated names, never a user's name or a
value's repr. It sits below all of them, so each imports it and none imports another for it.
"""

from __future__ import annotations

import itertools
import re
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

from jitcore.for_replay import generated

_sources = itertools.count()

#: A named constant in a dynamic scalar's source (replay.dynamic ``_k``, replay.recording ``_lit``).
_CONSTANT_NAME = re.compile(r"\b(?:_k|_lit)\d+\b")


class SourcedFunction(Protocol):
    """A generated function that carries its own source (what tests and ``full_source`` read)."""

    source: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def compile_function(source: str, name: str, description: str, namespace: dict) -> SourcedFunction:
    """Compile generated source with ``namespace`` as its globals, through jitcore's one
    generated-source helper (registered with ``linecache``, so tracebacks and pdb show its lines)."""
    filename = f"<{generated.comment(description)} #{next(_sources)}>"
    function = generated.define(source, filename, namespace)[name]
    function.source = source
    weakref.finalize(function, generated.forget_source, filename)  # rebuilt often: linecache stays bounded
    return function


#: The indentation of a generated line at each depth.
_INDENTS = tuple("    " * depth for depth in range(8))


class Source:
    """Lines of generated Python with their indentation, and values bound by name."""

    def __init__(self, namespace: dict) -> None:
        self.lines: list[str] = []
        self.namespace = namespace
        self._names = itertools.count()
        self._bound: dict[int, str] = {}

    def line(self, text: str, depth: int = 1) -> None:
        try:
            indent = _INDENTS[depth]
        except IndexError:
            indent = "    " * depth
        self.lines.append(indent + text)

    def bind(self, value: object, prefix: str = "_v") -> str:
        """A name for ``value`` in the generated function's namespace (one per object)."""
        name = self._bound.get(id(value))
        if name is None or self.namespace.get(name) is not value:
            name = self._bound[id(value)] = f"{prefix}{next(self._names)}"
            self.namespace[name] = value
        return name

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    def with_constants(self, source: str, constants: Mapping[str, object]) -> str:
        """``source`` (an expression over dynamic leaves and named constants, see
        replay.dynamic) with each constant renamed to this function's own name for its value.
        The names a recording gives constants (``_k7``, ``_lit3``) come from process-wide
        counters, so every recording of a region would generate a text of its own; renamed,
        the same region recorded at another shape generates the same text, and its compiled
        code is reused (jitcore.generated.compile_source)."""
        return _CONSTANT_NAME.sub(
            lambda found: self.bind(constants[found[0]], "_k") if found[0] in constants else found[0], source
        )
