"""Dynamic scalars: runtime values a replayed graph takes fresh on every call.

A region argument wrapped in :func:`dynamic` is keyed by its type only. While the region is
recorded it receives a :class:`DynamicScalar` instead of the number: arithmetic on it builds an
expression, passing it to a ``@jit`` launcher records which kernel parameters it reaches (the
jit core reads its value through ``__jit_scalar__``), and at replay those parameters are
recomputed from the new value and patched. Anything that would bake the value into the graph
(a torch op, ``int()``, ``if``, a comparison) raises :class:`DynamicScalarError` during
recording; the key then runs eagerly, with a warning that names the use.
"""

from __future__ import annotations

import ast
import itertools
from typing import NoReturn

from jitcore.for_replay import NUMBERS, DeferredScalar, generated
from replay.errors import DynamicScalarError


class Dynamic:
    """A runtime scalar argument of a region (see :func:`dynamic`)."""

    __slots__ = ("value",)

    def __init__(self, value: object):
        if isinstance(value, Dynamic):
            value = value.value
        if not isinstance(value, NUMBERS):
            raise TypeError(
                f"replay.dynamic() takes an int, float or bool (or numpy scalar), got {type(value).__qualname__}"
            )
        self.value = value

    def __repr__(self) -> str:
        return f"dynamic({self.value!r})"


def dynamic(value: object) -> Dynamic:
    """Mark a scalar region argument as runtime: graphs are keyed by its type, not its value,
    and kernel parameters computed from it are patched on every replay."""
    return Dynamic(value)


_ADVICE = (
    "a recorded graph would bake its value in. Pass it only to @jit launchers (and arithmetic "
    "on it), or do not mark it dynamic (then each value gets its own graph)"
)


_constant_names = itertools.count()


class DynamicScalar(DeferredScalar):
    """What a region sees in place of a dynamic argument while it is being recorded.

    ``source`` is Python source over the dynamic leaves (``_d2``) and named constants
    (``_k7``): a constant never enters the source by its repr (``inf``, ``nan``, numpy
    scalars and enum members have none that evaluates back to them); it is bound under its
    name in ``constants``, which whoever evaluates the source puts in the namespace."""

    __slots__ = ("constants", "name", "source", "value", "_expression")

    def __init__(self, source: str, value: object, name: str, constants: dict | None = None):
        self.source = source  # e.g. "(_d2 + _k0)"
        self.value = value
        self.name = name  # for messages: the argument path, or the expression
        self.constants: dict[str, object] = constants or {}
        self._expression: generated.Expression | None = None

    def evaluate(self, dynamic_values: dict[str, object]) -> object:
        """This expression for other values of the dynamic leaves (``{"_d2": 5}``; other
        entries are ignored). Compiled on first use, through :mod:`jitcore.generated` like all
        generated code, into a function of the leaves (a traceback shows its line; evaluating
        again costs a call, not a compile); its constants are bound as they are then, and it
        has no builtins, so the source computes nothing but what it names."""
        if self._expression is None:
            self._expression = self._compile()
        return self._expression(dynamic_values)

    def _compile(self) -> generated.Expression:
        # names that are not constants are leaves; the generated function takes them as parameters
        tree = ast.parse(self.source.strip(), mode="eval")
        if any(isinstance(node, (ast.Yield, ast.YieldFrom, ast.Await)) for node in ast.walk(tree)):
            raise SyntaxError(f"not an expression over dynamic scalars: {self.source!r}")
        names = [node.id for node in ast.walk(tree) if isinstance(node, ast.Name)]
        leaves = [name for name in dict.fromkeys(names) if name not in self.constants]
        namespace: dict[str, object] = {"__builtins__": {}, **self.constants}
        text = self.source.strip() if len(self.source.strip().splitlines()) == 1 else ast.unparse(tree)
        return generated.Expression(text, leaves, namespace, f"dynamic scalar {self.name}")

    def __jit_scalar__(self) -> object:
        return self.value

    def __repr__(self) -> str:
        return f"DynamicScalar({self.name} = {self.value!r})"

    # --- DeferredScalar: refusing to become a constant, arithmetic building expressions ----
    def _refuse(self, what: str) -> NoReturn:
        raise DynamicScalarError(f"{what} of dynamic scalar {self.name} inside a recorded region: {_ADVICE}")

    __complex__ = DeferredScalar.refusal("complex()")
    __hash__ = DeferredScalar.refusal("hash()")
    __format__ = DeferredScalar.refusal("formatting")
    __str__ = DeferredScalar.refusal("str()")  # (repr, a debugging aid, names it as what it is)

    def _arithmetic(self, op: str, other: object, reflected: bool) -> DynamicScalar:
        constants = dict(self.constants)
        if isinstance(other, DynamicScalar):
            other_source, other_value = other.source, other.value
            constants.update(other.constants)
        elif isinstance(other, NUMBERS):
            other_source, other_value = f"_k{next(_constant_names)}", other
            constants[other_source] = other
        else:
            return NotImplemented
        left, right = (other_source, self.source) if reflected else (self.source, other_source)
        lv, rv = (other_value, self.value) if reflected else (self.value, other_value)
        value = _OPS[op](lv, rv)
        return DynamicScalar(f"({left} {op} {right})", value, f"({self.name} {op} ...)", constants)

    def __neg__(self) -> DynamicScalar:
        return DynamicScalar(f"(-{self.source})", -self.value, f"(-{self.name})", self.constants)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        found = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, DynamicScalar)]
        name = found[0].name if found else "?"
        raise DynamicScalarError(
            f"passing dynamic scalar {name} to torch.{getattr(func, '__name__', func)} inside a recorded region: "
            f"{_ADVICE}"
        )


_OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "//": lambda a, b: a // b,
    "%": lambda a, b: a % b,
}
