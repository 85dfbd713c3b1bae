"""Globals drift: what a function read from its globals and closure must not change behind
the cache's back.

A launcher runs once per call state (at trace time); every value it read from a global or a
closure cell is baked into that call state. :class:`GlobalsSnapshot` records those values at
first compile and checks them on every call:

- identity-stable values (modules, functions, classes, kernels, any other object) are compared
  with ``is``; the snapshot holds them alive, so an ``id`` can never be reused under it;
- scalars (int, float, str, ...) are compared by type and value, so rebinding to an equal
  value is not drift;
- containers (list, tuple, dict, set) are compared by a frozen deep copy, so in-place mutation
  is caught.

The check is generated Python (one ``is`` per identity value) that callers can inline.
"""

from __future__ import annotations

import builtins
import dis
import enum
import types
from collections.abc import Callable

import torch

from jitcore.errors import GlobalDriftError

_MISSING = object()
_SCALAR_TYPES = (bool, int, float, complex, str, bytes, type(None))
_CONTAINER_TYPES = (list, tuple, dict, set, frozenset)


class _Identity:
    """A frozen leaf that compares by identity and keeps its object alive."""

    __slots__ = ("obj",)

    def __init__(self, obj: object):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"<{type(self.obj).__qualname__} at {id(self.obj):#x}>"


def freeze(value: object) -> object:
    """A comparable deep snapshot of a container: scalars by value, others by identity."""
    if isinstance(value, _SCALAR_TYPES):
        return (type(value), value)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(freeze(item) for item in value))
    if isinstance(value, dict):
        return (type(value), tuple((freeze(k), freeze(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(freeze(item) for item in value))
    return _Identity(value)


def _same_scalar(current: object, snapshot: object) -> bool:
    return type(current) is type(snapshot) and current == snapshot


def global_names(code: types.CodeType) -> list[str]:
    """Names a code object (and the code objects nested in it) loads as globals, in order."""
    seen: dict[str, None] = {}
    stack = [code]
    while stack:
        current = stack.pop()
        for instruction in dis.get_instructions(current):
            if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                seen.setdefault(instruction.argval, None)
        stack.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    return list(seen)


def _compare_mode(value: object) -> str:
    if isinstance(value, (enum.Enum, torch.dtype)):
        return "identity"
    if isinstance(value, _SCALAR_TYPES):
        return "scalar"
    if isinstance(value, _CONTAINER_TYPES):
        return "container"
    return "identity"


class GlobalsSnapshot:
    """The globals and closure values ``fn`` reads, as they were when the snapshot was taken."""

    def __init__(self, fn: Callable, *, owner: str | None = None, prefix: str = "_"):
        """``prefix`` starts every name the check lines use, so callers can inline them into
        generated code of their own without clashes."""
        self.fn = fn
        self.owner = owner or getattr(fn, "__qualname__", repr(fn))
        self.prefix = p = prefix
        code = fn.__code__
        fn_globals = fn.__globals__
        self.namespace: dict[str, object] = {
            f"{p}g": fn_globals,
            f"{p}MISSING": _MISSING,
            f"{p}same_scalar": _same_scalar,
            f"{p}freeze": freeze,
            f"{p}drift": self._raise_drift,
        }
        self.entries: list[tuple[str, str, str, object]] = []  # (name, where, mode, snapshot)
        lines: list[str] = []
        for name in global_names(code):
            if name in fn_globals:
                value = fn_globals[name]
                self._add(lines, name, "global", value, f"{p}g.get({name!r}, {p}MISSING)")
            elif hasattr(builtins, name):
                # A builtin: drift is a new global shadowing it.
                self.entries.append((name, "builtin", "absent", None))
                lines.append(f"if {name!r} in {p}g: {p}drift({name!r})")
        for index, (name, cell) in enumerate(zip(code.co_freevars, fn.__closure__ or ())):
            try:
                value = cell.cell_contents
            except ValueError:
                continue  # an unfilled cell (a name assigned later in the enclosing scope)
            self.namespace[f"{p}cell{index}"] = cell
            self._add(lines, name, "closure", value, f"{p}cell{index}.cell_contents")
        self.check_lines = lines
        body = "\n".join("    " + line for line in lines) or "    pass"
        self.source = f"def check():\n{body}\n"
        exec(compile(self.source, f"<jitcore drift check of {self.owner}>", "exec"), self.namespace)
        self.check: Callable[[], None] = self.namespace["check"]  # type: ignore[assignment]

    def _add(self, lines: list[str], name: str, where: str, value: object, read: str) -> None:
        p = self.prefix
        slot = f"{p}s{len(self.entries)}"
        mode = _compare_mode(value)
        if mode == "container":
            self.namespace[slot] = freeze(value)
            lines.append(f"if {p}freeze({read}) != {slot}: {p}drift({name!r})")
        else:
            self.namespace[slot] = value
            if mode == "scalar":
                lines.append(f"{p}v = {read}")
                lines.append(f"if {p}v is not {slot} and not {p}same_scalar({p}v, {slot}): {p}drift({name!r})")
            else:
                lines.append(f"if {read} is not {slot}: {p}drift({name!r})")
        self.entries.append((name, where, mode, value))

    def _raise_drift(self, name: str) -> None:
        for entry_name, where, _mode, old in self.entries:
            if entry_name != name:
                continue
            if where == "builtin":
                detail = "a new global now shadows the builtin it read"
            else:
                detail = f"it was {old!r} when first compiled"
            raise GlobalDriftError(
                f"{where} {name!r} read by {self.owner} has changed since it was first compiled "
                f"({detail}); pass it as an argument (a Constexpr if it selects code) instead of "
                "reading it from a global"
            )
        raise GlobalDriftError(f"{name!r} read by {self.owner} has changed")
