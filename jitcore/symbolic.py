"""Symbolic values for tracing: dynamic sizes, strides and runtime scalars.

While a launcher is traced, every value that may change between calls sharing one call state
(a dynamic size or stride, a runtime scalar argument) is a :class:`Sym`. Arithmetic on it
builds an expression; the call state later evaluates that expression as generated Python, so
it must never be turned into a concrete value during tracing. Asking for one (``bool()``,
``int()``, a comparison, use as an index) raises :class:`~jitcore.errors.SymbolicValueError`
naming the expression and how to make it static.

Those refusing and arithmetic dunders belong to :class:`DeferredScalar`, the public base that
replay's dynamic scalars (``replay.dynamic.DynamicScalar``) share with :class:`Sym`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import NoReturn

import numpy as np

from jitcore.errors import SymbolicValueError
from jitcore.generated import Expression

_ADVICE = (
    "it is only known when the call state runs. To branch on it, make it static: wrap the "
    "tensor with jitcore.from_dlpack(t) (static shape and strides) or declare the parameter "
    "jitcore.Constexpr[...] (its value becomes part of the cache key)"
)


def _refusal(what: str) -> Callable[..., NoReturn]:
    def refuse(self: DeferredScalar, *args: object) -> NoReturn:
        self._refuse(what)

    return refuse


def _operation(op: str, reflected: bool) -> Callable[[DeferredScalar, object], object]:
    def apply(self: DeferredScalar, other: object) -> object:
        return self._arithmetic(op, other, reflected)

    return apply


class DeferredScalar:
    """The dunders of a number whose value must not be used while it is traced or recorded:
    :class:`Sym` here, and replay's ``DynamicScalar`` (public for it, so both refuse and
    compute alike without replay reaching into this module's internals).

    Turning it into a Python value (``bool()``, ``int()``, ``float()``, use as an index, a
    comparison) would bake one call's value into code that must work for every call, so those
    raise ``self._refuse(what)``; a subclass decides the error and the advice. Arithmetic
    (``+ - * / // %``, reflected too) builds another deferred value through
    ``self._arithmetic(op, other, reflected)`` (``other op self`` when ``reflected``). A
    subclass implements those two and ``__neg__``, and may refuse more uses with
    :meth:`refusal` (hashing, iteration, formatting). Defining ``__eq__`` here leaves
    ``__hash__`` to each subclass.
    """

    __slots__ = ()

    #: ``refusal(what)``: a dunder (any arguments) that raises ``self._refuse(what)``.
    refusal = staticmethod(_refusal)

    def _refuse(self, what: str) -> NoReturn:
        raise NotImplementedError

    def _arithmetic(self, op: str, other: object, reflected: bool) -> object:
        raise NotImplementedError

    __bool__ = _refusal("bool()")
    __int__ = _refusal("int()")
    __float__ = _refusal("float()")
    __index__ = _refusal("use as an index")
    __eq__ = _refusal("comparison (==)")
    __ne__ = _refusal("comparison (!=)")
    __lt__ = _refusal("comparison (<)")
    __le__ = _refusal("comparison (<=)")
    __gt__ = _refusal("comparison (>)")
    __ge__ = _refusal("comparison (>=)")

    __add__, __radd__ = _operation("+", False), _operation("+", True)
    __sub__, __rsub__ = _operation("-", False), _operation("-", True)
    __mul__, __rmul__ = _operation("*", False), _operation("*", True)
    __floordiv__, __rfloordiv__ = _operation("//", False), _operation("//", True)
    __mod__, __rmod__ = _operation("%", False), _operation("%", True)
    __truediv__, __rtruediv__ = _operation("/", False), _operation("/", True)

    def __pos__(self) -> DeferredScalar:
        return self


class Sym(DeferredScalar):
    """An expression over call-time values. ``op`` is "leaf" or an operator name.

    ``is_float``: the value may be a float (it is one when any operand is, or after ``/``).
    ``is_int``: the value is known to be an integer that is not a bool (a Python int or a
    numpy integer) on every call; only such values take the arithmetic identities of
    :func:`_binary`, since ``x // 1``, ``x + 0`` and ``x * 1`` change floats (floor, the sign
    of zero, a signalling NaN's bits) and bools (``True * 1`` is the int 1). ``is_pyint``: it
    is moreover a Python int (unbounded), never a numpy integer, which computes in its own
    width (see :func:`as_index`). A leaf is neither unless its maker says so (:meth:`leaf`),
    so an unknown value never simplifies and is converted where exactness needs an int.
    """

    __slots__ = ("op", "args", "is_float", "is_int", "is_pyint", "_source", "label", "_expression")

    def __init__(
        self,
        op: str,
        args: tuple,
        is_float: bool = False,
        label: str | None = None,
        *,
        is_int: bool = False,
        is_pyint: bool = False,
    ):
        self.op = op
        self.args = args
        self.is_float = is_float
        self.is_int = (is_int or is_pyint) and not is_float
        self.is_pyint = is_pyint and not is_float
        self._source: str | None = None
        self._expression: Expression | None = None  # made by the first evaluate()
        self.label = label  # human name of a leaf, e.g. "x.shape[0]"

    # --- leaves --------------------------------------------------------------------------
    @classmethod
    def leaf(
        cls, variable: str, label: str, *, is_float: bool = False, is_int: bool = False, is_pyint: bool = False
    ) -> Sym:
        """A value the generated code reads into ``variable``. ``is_int``: the caller knows it
        is an integer and never a bool on every call (an int or numpy integer argument);
        ``is_pyint``: a Python int on every call (a size, a stride, an int argument)."""
        return cls("leaf", (variable,), is_float, label, is_int=is_int, is_pyint=is_pyint)

    # --- rendering -----------------------------------------------------------------------
    def source(self, bind: Callable[[object], str] | None = None) -> str:
        """Python source computing this value from the generated code's local variables.

        Constants other than plain ``int`` (floats, numpy scalars, ``IntEnum`` members, ...)
        are never written by their ``repr``: ``bind(value)`` returns the name under which the
        caller's namespace holds the value. Without ``bind`` such a constant is an error."""
        if bind is not None:
            return _render(self, label=False, bind=bind)
        if self._source is None:
            self._source = _render(self, label=False, bind=_no_binding)
        return self._source

    def describe(self) -> str:
        """The expression in the user's terms, e.g. ``cdiv(x.shape[0] * x.shape[1], 256)``."""
        return _render(self, label=True)

    def leaves(self) -> list[Sym]:
        found: dict[int, Sym] = {}
        stack = [self]
        while stack:
            node = stack.pop()
            if node.op == "leaf":
                found.setdefault(id(node), node)
            else:
                stack.extend(a for a in node.args if isinstance(a, Sym))
        return list(found.values())

    def render_with(self, substitutions: dict[str, str], bind: Callable[[object], str] | None = None) -> str:
        """Source with each leaf variable replaced by the given text (all leaves must be given).
        With ``bind``, constants are bound as in :meth:`source`; without it they are shown by
        their ``repr`` (text for messages, not for code)."""
        if bind is None:
            return _render(self, label=True, substitutions=substitutions)
        return _render(self, label=False, substitutions=substitutions, bind=bind)

    def evaluate(self, values: dict[str, object]) -> object:
        """Evaluate with ``values`` mapping leaf variables to concrete values (other entries are
        ignored). Compiled on first use, like all generated code, through :mod:`jitcore.generated`
        into a function of the leaves (:class:`~jitcore.generated.Expression`): a traceback shows
        its line, and the slow paths that evaluate one expression call after call (a packing
        error, an index check) pay for a call, not for a parse and a compile."""
        if self._expression is None:
            self._expression = self._compile()
        return self._expression(values)

    def _compile(self) -> Expression:
        leaves = list(dict.fromkeys(leaf.args[0] for leaf in self.leaves()))
        # min/max are what the rendered source calls; nothing else is reachable from it
        namespace: dict[str, object] = {"__builtins__": {"min": min, "max": max}}
        namespace.update(dict.fromkeys(leaves))  # held while binding: no constant takes a leaf's name
        body = self.source(Binder(namespace).bind)
        for leaf in leaves:
            del namespace[leaf]
        shown = self.describe()
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return Expression(body, leaves, namespace, f"evaluation of {shown}")

    def __repr__(self) -> str:
        return f"Sym({self.describe()})"

    # --- DeferredScalar ------------------------------------------------------------------
    __index__ = _refusal("use as an index (int)")
    __iter__ = _refusal("iteration")

    def _refuse(self, what: str) -> NoReturn:
        raise SymbolicValueError(f"{what} of the symbolic value {self.describe()}: {_ADVICE}")

    def _arithmetic(self, op: str, other: object, reflected: bool) -> Sym | int | float:
        return _binary(op, other, self) if reflected else _binary(op, self, other)

    def __hash__(self) -> int:
        return id(self)

    def __neg__(self) -> Sym:
        return Sym("neg", (self,), self.is_float, is_int=self.is_int, is_pyint=self.is_pyint)

    def __pos__(self) -> Sym:
        """``+x`` is ``x`` for ints and floats (their bits included); a value that may be a bool
        keeps the ``+``, which makes ``True`` the int 1 as Python does."""
        return self if self.is_int or self.is_float else Sym("pos", (self,))


def _check_operand(value: object, op: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (Sym, int, float)):
        raise TypeError(f"unsupported operand for symbolic {op}: {type(value).__qualname__}")


def _is_int(value: object, constant: int) -> bool:
    return type(value) is int and value == constant


def _integer(value: object) -> bool:
    """Whether ``value`` is an integer and not a bool on every call (see :attr:`Sym.is_int`):
    a plain ``int`` constant (not a bool, not an ``IntEnum`` member), or an integer Sym."""
    return value.is_int if isinstance(value, Sym) else type(value) is int


def _floating(value: object) -> bool:
    return value.is_float if isinstance(value, Sym) else isinstance(value, float)


def _integers(*values: object) -> dict[str, bool]:
    """``is_int`` and ``is_pyint`` of a result computed from ``values`` by an integer
    operation: an int of either kind when all are, a Python int when all are Python ints."""
    return {
        "is_int": all(map(_integer, values)),
        "is_pyint": all(v.is_pyint if isinstance(v, Sym) else type(v) is int for v in values),
    }


def _binary(op: str, left: object, right: object) -> Sym | int | float:
    _check_operand(left, op)
    _check_operand(right, op)
    integers = _integer(left) and _integer(right)
    # Identities keep generated code readable, and apply only where they are exact: for two
    # integers. For a float, x // 1 floors, x + 0 makes -0.0 into 0.0 and x * 1 or x - 0 quiet
    # a signalling NaN (other bits); for a bool, each gives the int 0 or 1 (a numpy bool's is
    # numpy.int64), which a bool parameter refuses and a numpy bool is not.
    if integers:
        if (op == "*" and _is_int(left, 1)) or (op == "+" and _is_int(left, 0)):
            return right
        if (op in ("*", "//") and _is_int(right, 1)) or (op in ("+", "-") and _is_int(right, 0)):
            return left
    if op == "/":
        return Sym(op, (left, right), True)
    return Sym(op, (left, right), _floating(left) or _floating(right), **_integers(left, right))


def cdiv(a, b):
    """Ceiling division, for ints and symbolic values alike: for integers the exact ceiling of
    ``a / b``, computed on Python ints (``-(-a // b)`` in a numpy integer's own width is wrong:
    ``-numpy.uint8(3)`` wraps to 253), so a numpy integer operand gives a Python int; with a
    float operand Python's ``-(-a // b)``, a float."""
    if not isinstance(a, Sym) and not isinstance(b, Sym):
        if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
            return -(-operator.index(a) // operator.index(b))
        return -(-a // b)
    _check_operand(a, "cdiv")
    _check_operand(b, "cdiv")
    if _floating(a) or _floating(b):
        return Sym("cdiv", (a, b), True)
    # a numpy integer is made a Python int first; a bool or int subclass computes as an int
    a, b = (as_index(v) if isinstance(v, Sym) and v.is_int and not v.is_pyint else v for v in (a, b))
    return Sym("cdiv", (a, b), **_integers(a, b))


def as_index(value: Sym) -> Sym:
    """``operator.index(value)`` on every call: the plain Python int that address, size and
    launch arithmetic must use. A numpy integer there would compute in its own width (NEP 50:
    ``data_ptr + numpy.int32(1)`` is an int32, which overflows), where torch and Python use
    the index's value; the caller refuses floats and bools first."""
    if value.op == "index":
        return value
    return Sym("index", (value,), is_pyint=True)


def minimum(*values):
    """``min`` that also works on symbolic values (Python's builtin compares, which a symbolic
    value refuses)."""
    if not any(isinstance(v, Sym) for v in values):
        return min(values)
    for v in values:
        _check_operand(v, "min")
    return Sym("min", tuple(values), any(map(_floating, values)), **_integers(*values))


def maximum(*values):
    """``max`` that also works on symbolic values."""
    if not any(isinstance(v, Sym) for v in values):
        return max(values)
    for v in values:
        _check_operand(v, "max")
    return Sym("max", tuple(values), any(map(_floating, values)), **_integers(*values))


class Binder:
    """Binds values into a generated function's namespace under fresh names (``_k0``, ...),
    so that generated source refers to them by name, never by their ``repr``."""

    def __init__(self, namespace: dict[str, object], prefix: str = "_k"):
        self.namespace = namespace
        self.prefix = prefix
        self._count = 0
        self._names: dict[int, str] = {}  # id -> name (the namespace keeps the value, so the id stays its)

    def bind(self, value: object) -> str:
        name = self._names.get(id(value))
        if name is not None and self.namespace.get(name) is value:
            return name
        name = self._new_name(value)
        self._names[id(value)] = name
        return name

    def _new_name(self, value: object) -> str:
        while True:
            name = f"{self.prefix}{self._count}"
            self._count += 1
            if name not in self.namespace:
                self.namespace[name] = value
                return name


def _no_binding(value: object) -> str:
    raise ValueError(f"the constant {value!r} ({type(value).__qualname__}) needs a namespace to be bound into")


def _constant(node: object, bind: Callable[[object], str] | None) -> str:
    """A constant in source: exact ints as literals (their repr is Python source), anything
    else (bool, IntEnum, float, numpy scalars) through ``bind``; ``repr`` only for messages."""
    if type(node) is int or bind is None:
        return repr(node)
    return bind(node)


def _render(
    node: object,
    *,
    label: bool,
    substitutions: dict[str, str] | None = None,
    bind: Callable[[object], str] | None = None,
) -> str:
    if not isinstance(node, Sym):
        return _constant(node, None if label else bind)
    if node.op == "leaf":
        if substitutions is not None:
            return substitutions[node.args[0]]
        return (node.label or node.args[0]) if label else node.args[0]
    parts = [_render(a, label=label, substitutions=substitutions, bind=bind) for a in node.args]
    if node.op == "neg":
        return f"(-{parts[0]})"
    if node.op == "pos":
        return f"(+{parts[0]})"
    if node.op == "index":  # see as_index(): the user wrote the value, the conversion is ours
        return parts[0] if label else f"{(bind or _no_binding)(operator.index)}({parts[0]})"
    if node.op == "cdiv":
        return f"cdiv({parts[0]}, {parts[1]})" if label else f"(-(-{parts[0]} // {parts[1]}))"
    if node.op in ("min", "max"):
        return f"{node.op}({', '.join(parts)})"
    if node.op in ("slice_index", "wrap_index"):  # see slice_index() and wrap_index() below
        value, size = parts
        if label:
            return f"{node.op}({value}, {size})"
        if node.op == "slice_index":
            return f"(min({value}, {size}) if {value} >= 0 else max({value} + {size}, 0))"
        return f"({value} + {size} if {value} < 0 else {value})"
    return f"({parts[0]} {node.op} {parts[1]})"


def is_static(value: object) -> bool:
    return not isinstance(value, Sym)


def render(value: object, bind: Callable[[object], str] | None = None) -> str:
    """Source of a value that may be symbolic or a constant (bound as in :meth:`Sym.source`)."""
    if isinstance(value, Sym):
        return value.source(bind)
    return _constant(value, bind or _no_binding)


def slice_index(value, size):
    """A slice bound normalized the way Python's ``slice.indices`` (and torch) does for a
    positive step: a negative bound counts from the end, then the result is clamped to
    ``[0, size]``. Symbolic when either is (the call state computes it on every call, since a
    runtime bound's sign is only known then); ``size`` must be >= 0."""
    if not isinstance(value, Sym):  # the sign is known: plain min/max read better
        return minimum(value, size) if value >= 0 else maximum(size - -value, 0)
    _check_operand(value, "slice_index")
    _check_operand(size, "slice_index")
    return Sym("slice_index", (value, size), **_integers(value, size))


def wrap_index(value, size):
    """An integer index with a negative value counted from the end (``value + size`` if
    ``value < 0``), as torch's select does after its bounds check; the caller checks
    ``-size <= value < size`` separately (see jitcore.tracing.IndexCheck)."""
    if not isinstance(value, Sym):
        return size - -value if value < 0 else value
    _check_operand(value, "wrap_index")
    _check_operand(size, "wrap_index")
    return Sym("wrap_index", (value, size), **_integers(value, size))
