"""Symbolic values for tracing: dynamic sizes, strides and runtime scalars.

While a launcher is traced, every value that may change between calls sharing one call state
(a dynamic size or stride, a runtime scalar argument) is a :class:`Sym`. Arithmetic on it
builds an expression; the call state later evaluates that expression as generated Python, so
it must never be turned into a concrete value during tracing. Asking for one (``bool()``,
``int()``, a comparison, use as an index) raises :class:`~jitcore.errors.SymbolicValueError`
naming the expression and how to make it static.
"""

from __future__ import annotations

from jitcore.errors import SymbolicValueError

_ADVICE = (
    "it is only known when the call state runs. To branch on it, make it static: wrap the "
    "tensor with jitcore.from_dlpack(t) (static shape and strides) or declare the parameter "
    "jitcore.Constexpr[...] (its value becomes part of the cache key)"
)


class Sym:
    """An expression over call-time values. ``op`` is "leaf" or an operator name."""

    __slots__ = ("op", "args", "is_float", "_source", "label")

    def __init__(self, op: str, args: tuple, is_float: bool = False, label: str | None = None):
        self.op = op
        self.args = args
        self.is_float = is_float
        self._source: str | None = None
        self.label = label  # human name of a leaf, e.g. "x.shape[0]"

    # --- leaves --------------------------------------------------------------------------
    @classmethod
    def leaf(cls, variable: str, label: str, *, is_float: bool = False) -> Sym:
        """A value the generated code reads into ``variable``."""
        return cls("leaf", (variable,), is_float, label)

    # --- rendering -----------------------------------------------------------------------
    def source(self) -> str:
        """Python source computing this value from the generated code's local variables."""
        if self._source is None:
            self._source = _render(self, label=False)
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

    def render_with(self, substitutions: dict[str, str]) -> str:
        """Source with each leaf variable replaced by the given text (all leaves must be given)."""
        return _render(self, label=False, substitutions=substitutions)

    def evaluate(self, values: dict[str, object]) -> object:
        """Evaluate with ``values`` mapping leaf variables to concrete values."""
        return eval(self.source(), {"__builtins__": {"min": min, "max": max}}, dict(values))

    def __repr__(self) -> str:
        return f"Sym({self.describe()})"

    # --- refusing to be concrete ---------------------------------------------------------
    def _refuse(self, what: str):
        raise SymbolicValueError(f"{what} of the symbolic value {self.describe()}: {_ADVICE}")

    def __bool__(self):
        self._refuse("bool()")

    def __int__(self):
        self._refuse("int()")

    def __float__(self):
        self._refuse("float()")

    def __index__(self):
        self._refuse("use as an index (int)")

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other):
        self._refuse("comparison (==)")

    def __ne__(self, other):
        self._refuse("comparison (!=)")

    def __lt__(self, other):
        self._refuse("comparison (<)")

    def __le__(self, other):
        self._refuse("comparison (<=)")

    def __gt__(self, other):
        self._refuse("comparison (>)")

    def __ge__(self, other):
        self._refuse("comparison (>=)")

    def __iter__(self):
        self._refuse("iteration")

    # --- arithmetic ----------------------------------------------------------------------
    def __add__(self, other):
        return _binary("+", self, other)

    def __radd__(self, other):
        return _binary("+", other, self)

    def __sub__(self, other):
        return _binary("-", self, other)

    def __rsub__(self, other):
        return _binary("-", other, self)

    def __mul__(self, other):
        return _binary("*", self, other)

    def __rmul__(self, other):
        return _binary("*", other, self)

    def __floordiv__(self, other):
        return _binary("//", self, other)

    def __rfloordiv__(self, other):
        return _binary("//", other, self)

    def __mod__(self, other):
        return _binary("%", self, other)

    def __rmod__(self, other):
        return _binary("%", other, self)

    def __truediv__(self, other):
        return _binary("/", self, other)

    def __rtruediv__(self, other):
        return _binary("/", other, self)

    def __neg__(self):
        return Sym("neg", (self,), self.is_float)

    def __pos__(self):
        return self


def _check_operand(value: object, op: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (Sym, int, float)):
        raise TypeError(f"unsupported operand for symbolic {op}: {type(value).__qualname__}")


def _is_int(value: object, constant: int) -> bool:
    return type(value) is int and value == constant


def _binary(op: str, left: object, right: object) -> Sym | int | float:
    _check_operand(left, op)
    _check_operand(right, op)
    left_float = left.is_float if isinstance(left, Sym) else isinstance(left, float)
    right_float = right.is_float if isinstance(right, Sym) else isinstance(right, float)
    # Cheap simplifications (int identities only) keep generated code readable.
    if (op == "*" and _is_int(left, 1)) or (op == "+" and _is_int(left, 0)):
        return right
    if (op in ("*", "//") and _is_int(right, 1)) or (op in ("+", "-") and _is_int(right, 0)):
        return left
    return Sym(op, (left, right), left_float or right_float or op == "/")


def _is_symbolic(value: object) -> bool:
    return isinstance(value, Sym)


def cdiv(a, b):
    """Ceiling division, for ints and symbolic values alike."""
    if not _is_symbolic(a) and not _is_symbolic(b):
        return -(-a // b)
    _check_operand(a, "cdiv")
    _check_operand(b, "cdiv")
    return Sym("cdiv", (a, b))


def minimum(*values):
    """``min`` that also works on symbolic values (Python's builtin compares, which a symbolic
    value refuses)."""
    if not any(_is_symbolic(v) for v in values):
        return min(values)
    for v in values:
        _check_operand(v, "min")
    return Sym("min", tuple(values), any(getattr(v, "is_float", isinstance(v, float)) for v in values))


def maximum(*values):
    """``max`` that also works on symbolic values."""
    if not any(_is_symbolic(v) for v in values):
        return max(values)
    for v in values:
        _check_operand(v, "max")
    return Sym("max", tuple(values), any(getattr(v, "is_float", isinstance(v, float)) for v in values))


def _render(node: object, *, label: bool, substitutions: dict[str, str] | None = None) -> str:
    if not isinstance(node, Sym):
        return repr(node)
    if node.op == "leaf":
        if substitutions is not None:
            return substitutions[node.args[0]]
        return (node.label or node.args[0]) if label else node.args[0]
    parts = [_render(a, label=label, substitutions=substitutions) for a in node.args]
    if node.op == "neg":
        return f"(-{parts[0]})"
    if node.op == "cdiv":
        return f"cdiv({parts[0]}, {parts[1]})" if label else f"(-(-{parts[0]} // {parts[1]}))"
    if node.op in ("min", "max"):
        return f"{node.op}({', '.join(parts)})"
    return f"({parts[0]} {node.op} {parts[1]})"


def is_static(value: object) -> bool:
    return not isinstance(value, Sym)


def render(value: object) -> str:
    """Source of a value that may be symbolic or a plain Python number."""
    return value.source() if isinstance(value, Sym) else repr(value)
