"""Generated source: how every generated function of jitcore and replay is named, compiled
and shown. One module for it, below both the call states (:mod:`jitcore.codegen`) and the
symbolic expressions (:mod:`jitcore.symbolic`) that compile through it.

Rules every generated function follows (see :func:`define`):

- arguments and everything derived from them are mangled locals (``_a0``, ``_a0_size1``,
  ``_a0_ptr``); a user's parameter name is never an identifier in generated source (the
  dispatcher, which Python must bind by the user's names, gets them by renaming the compiled
  code's parameters, :func:`rename_parameters`);
- values reach generated code through its namespace under mangled names (``_k0``, ...; see
  :class:`~jitcore.symbolic.Binder`), never by their ``repr``; only exact ``int`` constants
  are written as literals;
- each source is registered with :mod:`linecache` under a descriptive filename, so tracebacks
  show the generated line and pdb can list and step through it;
- an expression evaluated from Python (a symbolic size, a dynamic scalar) is compiled once into
  a generated function of the names it reads (:class:`Expression`), never ``eval``-ed;
- a text compiled before is not compiled again (:func:`compile_source`): the replays of a
  region's shapes, written this way, are one text.
"""

from __future__ import annotations

import builtins
import keyword
import linecache
import os
import re
import threading
import types
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

_filenames: dict[str, int] = {}
_filenames_lock = threading.Lock()


def python_name(text: str) -> str:
    """An identifier made from ``text`` (for ``def`` lines: tracebacks show it)."""
    name = re.sub(r"\W", "_", str(text)) or "_"
    if name[0].isdigit() or keyword.iskeyword(name):
        name = "_" + name
    return name


def comment(text: object) -> str:
    """``text`` made safe for a ``#`` comment: one line, nothing that ends the comment."""
    return repr(str(text))[1:-1]


def source_filename(description: str) -> str:
    """A descriptive filename for generated source, ``<jitcore {description}>``, unique in
    this process (a second use of one description gets `` #2``, ...)."""
    text = comment(description).replace(">", ")").replace("<", "(")
    with _filenames_lock:
        count = _filenames[text] = _filenames.get(text, 0) + 1
    return f"<jitcore {text}>" if count == 1 else f"<jitcore {text} #{count}>"


def register_source(filename: str, source: str) -> None:
    """Make ``source`` what tracebacks and pdb show for ``filename`` (an mtime of None tells
    linecache.checkcache to leave the entry alone)."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)


def forget_source(filename: str) -> None:
    linecache.cache.pop(filename, None)


#: Compiled generated sources, by their text: the most recently compiled ``COMPILED_SOURCES``.
#: Generated code names every value through its namespace, so the code of a replay for one
#: shape of a region is, as text, the code of the next shape's: compiling it again cost about
#: half a millisecond of each recording.
COMPILED_SOURCES = 256
_compiled: dict[str, types.CodeType] = {}
_compiled_lock = threading.Lock()


def _with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` (and the functions it defines) as if compiled from ``filename``."""
    consts = tuple(_with_filename(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def compile_source(source: str, filename: str) -> types.CodeType:
    """``builtins.compile(source, filename, "exec")``, reusing the code of the same text
    compiled before under another filename (tracebacks then show ``filename``'s lines)."""
    with _compiled_lock:
        code = _compiled.pop(source, None)
        if code is not None:
            _compiled[source] = code  # the most recent last
    if code is not None:
        return _with_filename(code, filename)
    code = builtins.compile(source, filename, "exec")
    with _compiled_lock:
        _compiled[source] = code
        while len(_compiled) > COMPILED_SOURCES:
            del _compiled[next(iter(_compiled))]
    return code


def define(source: str, filename: str, namespace: dict[str, object]) -> dict[str, Any]:
    """Compile generated ``source`` (registered under ``filename``) with ``namespace`` as its
    globals and return what it defines. Definitions go into a separate dict, so a generated
    function's name can never replace a value in its namespace."""
    register_source(filename, source)
    defined: dict[str, Any] = {}  # whatever the source defines: functions the caller gives attributes
    exec(compile_source(source, filename), namespace, defined)
    return defined


class Expression:
    """An expression compiled once into a generated function whose parameters are the names it
    reads (``def evaluate(_a0, _a0_size1): return ...``), so evaluating it again costs a call,
    not a parse and a compile. Constants it names live in ``namespace`` (under mangled names:
    ``_k0``), which is also where its builtins come from (``{"__builtins__": {...}}`` restricts
    them). ``expression(values)`` reads ``values[name]`` for each parameter and ignores other
    entries; a missing one is the ``NameError`` that ``eval`` would raise."""

    __slots__ = ("function", "parameters", "source", "filename", "__weakref__")

    def __init__(self, expression: str, parameters: Sequence[str], namespace: dict[str, object], description: str):
        if "\n" in expression or "\r" in expression:
            raise ValueError(f"a generated expression is one line: {expression!r}")
        for name in parameters:
            if not name.isidentifier() or keyword.iskeyword(name):
                raise ValueError(f"not a parameter name: {name!r}")
        self.parameters = tuple(parameters)
        self.source = f"def evaluate({', '.join(self.parameters)}):\n    return {expression}\n"
        self.filename = source_filename(description)
        self.function = define(self.source, self.filename, namespace)["evaluate"]
        weakref.finalize(self, forget_source, self.filename)

    def __call__(self, values: Mapping[str, object]) -> object:
        try:
            arguments = [values[name] for name in self.parameters]
        except KeyError as missing:
            raise NameError(f"name {missing.args[0]!r} is not defined") from None
        return self.function(*arguments)


def rename_parameters(code: types.CodeType, names: Sequence[str]) -> types.CodeType:
    """``code`` with its first ``len(names)`` parameters renamed to ``names``.

    Generated functions are written with mangled parameters (``_a0``, ...); Python binds
    keyword arguments by the names in the code object, while the body refers to locals by
    slot, so renaming the slots lets a dispatcher accept the user's names without any of
    them ever being an identifier of the generated source (no user name can shadow a
    generated one). Other locals that happen to share a user's name get a suffix."""
    taken = set(names)
    varnames = list(names)
    for name in code.co_varnames[len(names) :]:
        while name in taken:
            name += "_"
        taken.add(name)
        varnames.append(name)
    return code.replace(co_varnames=tuple(varnames))


def dump_enabled(variable: str = "JITCORE_DUMP") -> bool:
    """Whether the environment asks for generated source to be printed: ``variable`` set to
    anything but empty or 0 (jitcore reads ``JITCORE_DUMP``, replay ``REPLAY_DUMP``)."""
    return os.environ.get(variable, "").strip() not in ("", "0")
