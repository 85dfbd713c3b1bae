"""Globals drift: what a function read from its globals and closure must not change behind
the cache's back.

A launcher runs once per call state (at trace time); every value it read from a global or a
closure cell is baked into that call state (a replay region's graph bakes them in the same way).
:class:`GlobalsSnapshot` records those values at first compile and checks them on every call:

- identity-stable values (modules, functions, classes, kernels, any other object) are compared
  with ``is``; the snapshot holds them alive, so an ``id`` can never be reused under it;
- scalars (int, float, str, ...) are compared by type and value, so rebinding to an equal
  value is not drift; floats (and complex numbers) by their bits, as Constexpr keys are
  (:func:`jitcore.keys.exact`): ``0.0`` rebound to ``-0.0`` is drift, a NaN rebound to a NaN
  of the same bits is not;
- containers (list, tuple, dict, set) are compared by a frozen deep copy, so in-place mutation
  is caught; one of up to :data:`MAX_UNROLLED` values without sets is compared by generated
  straight-line tests that mean the same (its class, its length, each element by identity or,
  for a scalar, by type and value), so a closure over a list of weights costs a few
  comparisons per call instead of a deep copy.

What is followed beyond the function's own bytecode:

- **helpers**: a global or closure value that is a plain Python function (or a
  ``functools.partial`` of one, a bound method's, a ``staticmethod``'s or ``classmethod``'s
  function) is followed: the globals and closure cells *it* reads are snapshotted too,
  recursively (each function once; at most :data:`MAX_DEPTH` calls deep, and at most
  :data:`MAX_ENTRIES` values, beyond which a ``RuntimeWarning`` says what is not checked);
- **module attributes**: ``LOAD_ATTR`` chains on a module read as a global or closure value
  (``cfg.BLOCK``, ``helpers.EPS``, ``pkg.sub.VALUE`` where each intermediate is a module) are
  snapshotted by the same rules; a function reached that way (``helpers.scale``) is followed;
- a region over a callable object follows its class's ``forward`` (``torch.nn.Module``) or
  ``__call__``.

Only user code is followed: functions and modules of torch, numpy, jitcore, replay and the other
packages in :data:`SKIP_PACKAGES`, the standard library, anything installed under
``site-packages``/``dist-packages`` (unless named in :data:`FOLLOW_PACKAGES`), builtins and C
functions are compared by identity and not looked into, so calling them costs no check and
cannot drift.

State is not input: a global that one of the followed functions assigns (``global x; x = ...``)
or visibly mutates (``X[k] = v``, ``X[k] += v``, ``del X[k]``, ``X.append(...)``,
``X.update(...)``, ...), and a module attribute one of them assigns (``cfg.x = v``,
``cfg.x += v``), is that code's own state (a cache, a lazy initialisation, a counter). It is not
checked where a helper or a module attribute read reaches it, so filling a cache while tracing
is not drift. (The function's own globals are all checked, as before: if it reads a global it
also mutates, the next call reports drift.) A value that is a module or a function
is never state. A region directly over a ``@jit`` launcher snapshots the launcher, not its
generated dispatcher.

What cannot be followed (a change there is not seen by the check; ``verify_every`` in replay
catches what it changes in a graph's results, and the remedy is to pass the value as an
argument):

- attributes of objects that are not modules: ``self.eps``, ``obj.attr`` on instances, class
  attributes (``Cfg.BLOCK``), and anything reached through them (``cfg.settings.block``, where
  ``cfg.settings`` is an object, is checked up to ``cfg.settings`` by identity);
- values read through computed names (``getattr(mod, name)``, ``globals()[name]``,
  ``vars(mod)``), ``importlib``/``sys.modules`` look-ups, modules imported inside the function
  body (``import cfg`` in a function: a local, not a global) and module-level ``__getattr__``;
- methods of objects called by the function (``obj.method()``, ``Class(...)`` and its
  ``__init__``), functions held in containers (``HANDLERS["relu"](x)``), functions passed as
  arguments or returned by other calls, and decorators implemented in C (``functools.lru_cache``
  wrappers are compared by identity; what they cache is not checked);
- state of C extensions, of torch (global modes, which replay keys separately), of the standard
  library and of installed third-party packages, file and environment contents;
- a helper's own state (see above) and code beyond :data:`MAX_DEPTH` calls.

The check is generated Python that callers inline (:attr:`GlobalsSnapshot.check_lines`, whose
names all start with ``prefix`` and resolve in :attr:`GlobalsSnapshot.namespace`): one ``is``
(plus an ``==`` for a scalar rebound to a new object) per snapshotted value, the unrolled tests
or a frozen-copy comparison per container. Like all generated code it names no user's global,
attribute or builtin: each such name is a string in the namespace (``_n0``), so the check
reads ``_g.get(_n0, _MISSING)``; :meth:`GlobalsSnapshot.check` runs the lines on their own
(compiled through :func:`jitcore.generated.define`, so tracebacks and pdb show them).
"""

from __future__ import annotations

import builtins
import dis
import enum
import functools
import os
import reprlib
import sys
import types
import typing
import warnings
import weakref
from collections.abc import Callable

import attrs
import torch

from jitcore import generated
from jitcore.errors import GlobalDriftError
from jitcore.keys import exact

_MISSING = object()
_SCALAR_TYPES = (bool, int, float, complex, str, bytes, type(None))
_CONTAINER_TYPES = (list, tuple, dict, set, frozenset)

#: Helpers are followed at most this many calls deep from the function itself.
MAX_DEPTH = 8
#: At most this many values are snapshotted for one function (a bound on the check's cost).
MAX_ENTRIES = 256
#: Top-level packages whose functions and module attributes are never looked into (besides the
#: standard library and whatever is installed under site-packages). Add to it to stop following
#: a package of your own.
SKIP_PACKAGES: set[str] = {
    "torch",
    "torchvision",
    "torchaudio",
    "functorch",
    "numpy",
    "jitcore",
    "replay",
    "triton",
    "cuda",
    "hip",
    "cupy",
    "jax",
    "attr",
    "attrs",
    "sympy",
    "typing_extensions",
    "pytest",
    "_pytest",
    "hypothesis",
}
#: Installed (site-packages) top-level packages that are followed all the same.
FOLLOW_PACKAGES: set[str] = set()

# Names of methods that mutate the builtin containers (and deques, OrderedDicts) in place.
_MUTATORS = frozenset(
    "append extend insert pop popitem remove clear update setdefault add discard sort reverse "
    "appendleft extendleft popleft rotate move_to_end difference_update intersection_update "
    "symmetric_difference_update __setitem__ __delitem__ __iadd__ __ior__".split()
)
_ROOT_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF"})
_ATTR_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_SKIPPED_OPS = frozenset({"EXTENDED_ARG", "CACHE"})
_GENERATED = ("<jitcore", "<replay")
_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60
_short.maxlist = _short.maxtuple = _short.maxdict = _short.maxset = 8


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


class _Bits:
    """A frozen float or complex number: equal to another only for the same bits (the rule of
    :func:`jitcore.keys.exact`, where ``==`` makes ``-0.0`` equal ``0.0`` and a NaN unequal to
    itself); it keeps the value for :func:`thaw`."""

    __slots__ = ("value", "bits")

    def __init__(self, value: float | complex):
        self.value = value
        self.bits = exact(value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Bits) and other.bits == self.bits

    def __hash__(self) -> int:
        return hash(self.bits)

    def __repr__(self) -> str:
        return repr(self.value)


def freeze(value: object) -> object:
    """A comparable deep snapshot of a container: scalars by value (floats and complex numbers
    by their bits), others by identity."""
    if isinstance(value, _SCALAR_TYPES):
        return (type(value), _Bits(value) if isinstance(value, (float, complex)) else value)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(freeze(item) for item in value))
    if isinstance(value, dict):
        return (type(value), tuple((freeze(k), freeze(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(freeze(item) for item in value))
    return _Identity(value)


def thaw(frozen: object) -> object:
    """The value a :func:`freeze` snapshot was taken of, rebuilt (for messages: the original
    may have been mutated since)."""
    if isinstance(frozen, _Identity):
        return frozen.obj
    kind, payload = frozen  # type: ignore[misc]
    if issubclass(kind, _SCALAR_TYPES):
        return payload.value if isinstance(payload, _Bits) else payload
    if issubclass(kind, dict):
        items = {thaw(k): thaw(v) for k, v in payload}
        return items if kind is dict else _rebuild(kind, items, items)
    items = [thaw(item) for item in payload]
    if issubclass(kind, (set, frozenset)):
        return set(items) if kind is set else _rebuild(kind, items, frozenset(items))
    if issubclass(kind, tuple):
        if kind is tuple:
            return tuple(items)
        return _rebuild(kind, items, tuple(items), star=hasattr(kind, "_fields"))
    return items if kind is list else _rebuild(kind, items, items)


def _rebuild(kind: type, items: object, fallback: object, star: bool = False) -> object:
    try:
        return kind(*items) if star else kind(items)  # type: ignore[operator]
    except Exception:
        return fallback


def _same_scalar(current: object, snapshot: object) -> bool:
    """The same type and value; floats and complex numbers the same bits (see :class:`_Bits`)."""
    return type(current) is type(snapshot) and exact(current) == exact(snapshot)


#: A container of at most this many values in all (elements, dict keys, nested containers) is
#: checked by straight-line generated tests; a larger one (or one holding a set) by comparing
#: frozen copies, which costs a deep copy on every call.
MAX_UNROLLED = 64
# builtin classes the generated tests name as they are (any other class is bound)
_BUILTIN_CLASSES = {kind: kind.__name__ for kind in (list, tuple, dict, int, float, complex, str, bytes)}
# what freeze() reads of a list or tuple by iterating, and the unrolled tests read by indexing
_SEQUENCE_PROTOCOL = ("__iter__", "__len__", "__getitem__")


class _NotUnrolled(Exception):
    pass


class _Unrolled:
    """The straight-line form of ``freeze(current) == freeze(value)`` for a container ``value``:
    the class by identity and the length before any element is read (so a value that became
    another type or a shorter list fails a test instead of raising), then each element in the
    order freeze() compares them: a scalar by identity, else by exact type and ``==`` (a float
    or complex number by its bits, as freeze() holds it: -0.0 is not 0.0, a NaN equals a NaN
    of the same bits), anything else by identity, a nested list, tuple or dict the same way
    through a local, a dict by its items in order.

    Passing the tests implies that the frozen copies compare equal; failing them need not imply
    the converse (a metaclass could make two classes compare equal), so callers confirm a
    failure with the frozen comparison. Values that freeze() reads in ways indexing could miss
    (sets, a list or tuple subclass with its own iteration) and containers over
    :data:`MAX_UNROLLED` values are not unrolled."""

    def __init__(self, namespace: dict[str, object], slot: str, prefix: str):
        self.namespace = namespace
        self.slot = slot
        self.prefix = prefix
        self.bound: dict[str, object] = {}
        self.values = 0
        self.locals = 0

    def tests(self, subject: str, value: object) -> list[str] | None:
        """Tests (to be joined with ``and``) of the local ``subject``, or None when ``value``
        is not unrolled; the values they name are bound into the namespace."""
        try:
            tests = self._tests(subject, subject, value)
        except _NotUnrolled:
            return None
        self.namespace.update(self.bound)
        return tests

    def _tests(self, subject: str, first: str, value: object) -> list[str]:
        """``first`` is ``subject`` or, for a nested container, ``local := expression``."""
        self.values += 1
        if self.values > MAX_UNROLLED:
            raise _NotUnrolled
        if isinstance(value, _SCALAR_TYPES):
            name = self._bind(value)
            if value is None or type(value) is bool:
                return [f"{subject} is {name}"]  # the only value of its type equal to it
            kind = self._class(type(value))
            if isinstance(value, (float, complex)):  # by bits, as freeze() compares them
                same = f"{self.prefix}same_scalar({subject}, {name})"
                return [f"({subject} is {name} or type({subject}) is {kind} and {same})"]
            return [f"({subject} is {name} or type({subject}) is {kind} and {subject} == {name})"]
        if isinstance(value, (list, tuple)):
            kind, base = type(value), list if isinstance(value, list) else tuple
            if any(getattr(kind, method) is not getattr(base, method) for method in _SEQUENCE_PROTOCOL):
                raise _NotUnrolled
            tests = [f"type({first}) is {self._class(kind)}", f"len({subject}) == {len(value)}"]
            for index, item in enumerate(value):
                tests += self._item(f"{subject}[{index}]", item)
            return tests
        if isinstance(value, dict):
            items, pairs = self._local(), tuple(value.items())
            tests = [
                f"type({first}) is {self._class(type(value))}",
                f"len({items} := tuple({subject}.items())) == {len(pairs)}",
            ]
            for index, (key, item) in enumerate(pairs):
                tests += self._item(f"{items}[{index}][0]", key)
                tests += self._item(f"{items}[{index}][1]", item)
            return tests
        if isinstance(value, (set, frozenset)):
            raise _NotUnrolled
        return [f"{subject} is {self._bind(value)}"]

    def _item(self, expression: str, value: object) -> list[str]:
        if isinstance(value, (list, tuple, dict)):
            local = self._local()  # read once: its class, length and elements are all tested
            return self._tests(local, f"{local} := {expression}", value)
        return self._tests(expression, expression, value)

    def _bind(self, value: object) -> str:
        name = f"{self.slot}_{len(self.bound)}"
        self.bound[name] = value
        return name

    def _class(self, kind: type) -> str:
        return _BUILTIN_CLASSES.get(kind) or self._bind(kind)

    def _local(self) -> str:
        self.locals += 1
        return f"{self.prefix}v{self.locals}"


def _nested_codes(code: types.CodeType) -> list[types.CodeType]:
    """``code`` and the code objects nested in it (comprehensions, lambdas, inner functions)."""
    codes, stack = [], [code]
    while stack:
        current = stack.pop()
        codes.append(current)
        stack.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    return codes


def global_names(code: types.CodeType) -> list[str]:
    """Names a code object (and the code objects nested in it) loads as globals, in order."""
    seen: dict[str, None] = {}
    for current in _nested_codes(code):
        for instruction in dis.get_instructions(current):
            if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                seen.setdefault(instruction.argval, None)
    return list(seen)


@attrs.frozen
class CodeReads:
    """What a code object (with its nested code) reads, from its bytecode."""

    globals: tuple[str, ...]  # names loaded as globals, in order
    chains: dict[str, tuple[tuple[str, ...], ...]]  # global/free-variable name -> attribute chains read on it
    state: frozenset[str]  # globals it assigns or visibly mutates in place
    # attributes it assigns on a global/free variable's chain: ("cfg", ("sub",), "x") for cfg.sub.x = v
    attribute_state: frozenset[tuple[str, tuple[str, ...], str]]


_READS: weakref.WeakKeyDictionary[types.CodeType, CodeReads] = weakref.WeakKeyDictionary()


def code_reads(code: types.CodeType) -> CodeReads:
    """:func:`analyse_code`, cached per code object."""
    reads = _READS.get(code)
    if reads is None:
        reads = _READS[code] = analyse_code(code)
    return reads


def analyse_code(code: types.CodeType) -> CodeReads:
    """Analyse ``code``: its global loads, the ``LOAD_ATTR`` chains following a
    ``LOAD_GLOBAL``/``LOAD_DEREF`` (``cfg.BLOCK`` -> ``{"cfg": (("BLOCK",),)}``), and the
    globals it assigns (``STORE_GLOBAL``) or mutates (``X[k] = v``, ``X.append(...)``), and the
    attributes it assigns on them (``cfg.x = v``, ``cfg.x += v``, ``del cfg.x``)."""
    names: dict[str, None] = {}
    chains: dict[str, dict[tuple[str, ...], None]] = {}
    state: set[str] = set()
    attribute_state: set[tuple[str, tuple[str, ...], str]] = set()
    for current in _nested_codes(code):
        ops = [i for i in dis.get_instructions(current) if i.opname not in _SKIPPED_OPS]
        for index, instruction in enumerate(ops):
            op = instruction.opname
            if op in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                state.add(instruction.argval)
                continue
            if op not in _ROOT_OPS:
                continue
            root = instruction.argval
            if op != "LOAD_DEREF":
                names.setdefault(root, None)
            attributes: list[str] = []
            for following in ops[index + 1 :]:
                if following.opname not in _ATTR_OPS:
                    break
                attributes.append(following.argval)
            if attributes:
                chains.setdefault(root, {})[tuple(attributes)] = None
            after_chain = ops[index + 1 + len(attributes)] if index + 1 + len(attributes) < len(ops) else None
            if after_chain is not None and after_chain.opname in ("STORE_ATTR", "DELETE_ATTR"):
                attribute_state.add((root, tuple(attributes), after_chain.argval))  # cfg.x = v
            elif (
                not attributes
                and index + 2 < len(ops)
                and ops[index + 1].opname in ("COPY", "DUP_TOP")
                and ops[index + 2].opname == "LOAD_ATTR"
            ):
                attribute_state.add((root, (), ops[index + 2].argval))  # cfg.x += v
            if op == "LOAD_DEREF":
                continue
            if attributes and attributes[0] in _MUTATORS:
                state.add(root)  # X.append(...), X.update(...)
            elif index + 2 < len(ops) and ops[index + 1].opname.startswith("LOAD_") and not attributes:
                after = ops[index + 2].opname
                if after in ("STORE_SUBSCR", "DELETE_SUBSCR", "STORE_SLICE", "COPY", "DUP_TOP_TWO"):
                    state.add(root)  # X[k] = v, del X[k], X[a:b] = v, X[k] += v
    found = {root: tuple(found) for root, found in chains.items()}
    return CodeReads(tuple(names), found, frozenset(state), frozenset(attribute_state))


def _compare_mode(value: object) -> str:
    if isinstance(value, (enum.Enum, torch.dtype)):
        return "identity"
    if isinstance(value, _SCALAR_TYPES):
        return "scalar"
    if isinstance(value, _CONTAINER_TYPES):
        return "container"
    return "identity"


def _python_function(value: object) -> types.FunctionType | None:
    """The pure-Python function behind ``value`` (itself, a partial's, a method's), or None."""
    for _ in range(8):
        if isinstance(value, types.FunctionType):
            return value
        if isinstance(value, functools.partial):
            value = value.func
        elif isinstance(value, (staticmethod, classmethod, types.MethodType)):
            value = value.__func__
        else:
            return None
    return None


def _user_module(name: object) -> bool:
    """Whether the module named ``name`` is user code (followed): not in :data:`SKIP_PACKAGES`,
    not the standard library, not installed under site-packages. A function whose globals
    name no module (``exec`` into a plain dict) counts as user code."""
    if not isinstance(name, str) or not name:
        return True
    top = name.partition(".")[0]
    if top in FOLLOW_PACKAGES:
        return True
    if top in SKIP_PACKAGES or top in getattr(sys, "stdlib_module_names", ()) or top in sys.builtin_module_names:
        return False
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if isinstance(path, str):
        parts = os.path.normpath(path).split(os.sep)
        if "site-packages" in parts or "dist-packages" in parts:
            return False
    return True


def _followed_function(value: object) -> types.FunctionType | None:
    """The function to follow for ``value``, or None when it is not user Python code."""
    fn = _python_function(value)
    if fn is None:
        return None
    if _generated(fn):
        return None  # generated by jitcore/replay (a launcher's dispatcher checks its own globals)
    if not _user_module(fn.__globals__.get("__name__")) or not _user_module(getattr(fn, "__module__", None)):
        return None
    return fn


def _generated(fn: types.FunctionType) -> bool:
    """Whether ``fn`` is code jitcore or replay generated (a @jit dispatcher, a guard)."""
    return fn.__code__.co_filename.startswith(_GENERATED) or type(getattr(fn, "jit", None)).__module__.startswith(
        "jitcore"
    )


def _followed_module(value: object) -> bool:
    return isinstance(value, types.ModuleType) and _user_module(value.__name__)


def _own_state(state: frozenset, mapping: dict, name: str, value: object) -> bool:
    """Whether ``mapping[name]`` is some followed helper's own state (it assigns or mutates
    it). Modules and functions never are (``ops.add(x)`` is a call, not a mutation)."""
    return (id(mapping), name) in state and not isinstance(value, (types.ModuleType, types.FunctionType))


def _state_of(fn: types.FunctionType) -> set[tuple[int, str]]:
    """(id(mapping), name) of the globals and module attributes ``fn`` assigns or mutates."""
    reads = code_reads(fn.__code__)
    state = {(id(fn.__globals__), name) for name in reads.state}
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    for root, attributes, name in reads.attribute_state:
        if root in cells:
            try:
                value = cells[root].cell_contents
            except ValueError:
                continue
        else:
            value = fn.__globals__.get(root, _MISSING)
        for attribute in attributes:
            value = value.__dict__.get(attribute, _MISSING) if isinstance(value, types.ModuleType) else _MISSING
        if isinstance(value, types.ModuleType):
            state.add((id(value.__dict__), name))
    return state


@attrs.define
class Entry:
    """One snapshotted value: where it is read from, who reads it, what it was."""

    where: str  # "global", "closure", "module attribute", "builtin"
    path: str  # 'BLOCK', 'helpers.EPS', 'cfg.BLOCK', the closure variable's name
    reader: str  # "@jit launch" or "scale() (called from @jit launch)"
    mode: str  # "identity", "scalar", "container", "absent" (builtins: drift is a global shadowing one)
    value: object  # the value read (held alive); for builtins, {name: reader} of those read from one module
    snapshot: object  # what the check compares with (the frozen copy for a container)
    source: tuple  # ("dict", mapping, key) or ("cell", cell): where the check reads the value now

    def old(self) -> object:
        return thaw(self.snapshot) if self.mode == "container" else self.value

    def now(self) -> object:
        if self.source[0] == "cell":
            try:
                return self.source[1].cell_contents
            except ValueError:
                return _MISSING
        return self.source[1].get(self.source[2], _MISSING)


class _Budget(Exception):
    pass


#: How many values GlobalsSnapshot.tensors_by_name looks at, containers' items included (a
#: region that reads a large dict, a vocabulary, pays for this many at each recording at most;
#: past it the search says it is incomplete).
_TENSOR_SEARCH_LIMIT = 4096


@attrs.frozen
class TensorsByName:
    """The tensors among the values a snapshot holds; ``complete`` False where the search
    stopped at its bound (:data:`_TENSOR_SEARCH_LIMIT` values) with values left unread, so
    that any tensor may be among them."""

    tensors: list
    complete: bool


class GlobalsSnapshot:
    """The globals and closure values ``fn`` reads (and those its helpers read, and the module
    attributes they read), as they were when the snapshot was taken."""

    def __init__(self, fn: Callable, *, owner: str | None = None, prefix: str = "_"):
        """``prefix`` starts every name the check lines use, so callers can inline them into
        generated code of their own without clashes. A statement may continue over several
        lines (inside parentheses): callers indent every line alike."""
        self.fn = fn
        self.owner = owner or getattr(fn, "__qualname__", repr(fn))
        self.prefix = prefix
        self.unchecked: list[str] = []  # what the bounds left out (also warned about)
        root = _python_function(fn)
        if root is not None and _generated(root):
            # a @jit dispatcher: what it runs is the launcher (its generated globals are the
            # jit's own bookkeeping, which changes on every new key)
            root = _python_function(getattr(root, "__wrapped__", None))
            root = None if root is None or _generated(root) else root
        # A callable object: follow what calling it runs (its class's forward or __call__).
        target = None
        if root is None and not isinstance(fn, type):
            if isinstance(fn, torch.nn.Module):
                target = _followed_function(type(fn).forward)
            elif callable(fn):
                target = _followed_function(type(fn).__call__)
        self._build(root, target, frozenset())
        state = set()
        for function in self._functions.values():
            state |= _state_of(function)
        if state:  # again, now knowing which globals are some helper's own state
            self._build(root, target, frozenset(state))
        if self.unchecked:
            warnings.warn(
                f"the drift check of {self.owner} does not cover {'; '.join(self.unchecked)}: "
                "a change there is not detected",
                RuntimeWarning,
                stacklevel=3,
            )
        body = "\n".join("    " + line for line in self.check_lines) or "    pass"
        self.source = f"def check():\n{body}\n"
        self.filename = generated.source_filename(f"drift check of {self.owner}")
        defined = generated.define(self.source, self.filename, self.namespace)
        self.check: Callable[[], None] = defined["check"]  # type: ignore[assignment]
        weakref.finalize(self, generated.forget_source, self.filename)

    def tensors_by_name(self) -> TensorsByName:
        """The tensors among the values the snapshot holds (a global, a closure value or a
        module attribute the code reads, and those inside the lists, tuples, sets and dicts
        it reads): memory the code reaches by name, which replay compares its arguments with.
        Bounded (:data:`_TENSOR_SEARCH_LIMIT` values); a search cut short says so, since a
        tensor it did not reach may be an argument (replay then doubts every argument)."""
        found: list[torch.Tensor] = []
        pending = [entry.value for entry in self.entries if entry.where != "builtin"]
        seen = 0
        while pending and seen < _TENSOR_SEARCH_LIMIT:
            value = pending.pop()
            seen += 1
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, dict):
                pending.extend(value.values())
            elif isinstance(value, (list, tuple, set, frozenset)):
                pending.extend(value)
        return TensorsByName(found, complete=not pending)

    # --- building ------------------------------------------------------------------------
    def _build(self, root: types.FunctionType | None, target: types.FunctionType | None, state: frozenset) -> None:
        p = self.prefix
        self.namespace: dict[str, object] = {
            f"{p}MISSING": _MISSING,
            f"{p}same_scalar": _same_scalar,
            f"{p}freeze": freeze,
            f"{p}drift": self._raise_drift,
        }
        self.entries: list[Entry] = []
        self.check_lines: list[str] = []
        self.unchecked = []
        self._state = state
        self._sources: dict[int, str] = {}  # id(dict or cell) -> its name in the namespace
        self._names: dict[str, str] = {}  # a global's or attribute's name -> where the namespace holds it
        self._keys: set[tuple[int, object]] = set()  # (id(dict or cell), key) already checked
        self._functions: dict[int, types.FunctionType] = {}
        self._builtins: dict[int, tuple[dict, dict[str, str]]] = {}  # id(globals) -> (globals, {name: reader})
        try:
            if root is not None:
                self._walk(root, (), 0)
            elif target is not None:
                self._walk(target, (self.owner,), 1)
            for mapping, readers in self._builtins.values():
                self._add_builtins(mapping, readers)
        except _Budget:
            self.unchecked.append(f"values beyond the first {MAX_ENTRIES}")

    def _add_builtins(self, mapping: dict, readers: dict[str, str]) -> None:
        """Builtins read through one globals dict: a global of the same name must not appear.
        Up to two names cost one ``in`` each; more cost one ``isdisjoint`` of the dict's keys
        with their set (it iterates over the set)."""
        p, table = self.prefix, self._name(mapping)
        groups = [{name: reader} for name, reader in readers.items()] if len(readers) <= 2 else [readers]
        for group in groups:
            index = len(self.entries)
            self._append(Entry("builtin", ", ".join(group), "", "absent", group, None, ("dict", mapping, None)))
            if len(group) == 1:
                self.check_lines.append(f"if {self._key(next(iter(group)))} in {table}: {p}drift({index})")
            else:
                names = f"{p}s{index}"
                self.namespace[names] = frozenset(group)
                self.namespace[f"{names}k"] = mapping.keys()
                self.check_lines.append(f"if not {names}k.isdisjoint({names}): {p}drift({index})")

    def _key(self, name: str) -> str:
        """Where the namespace holds the string ``name`` (``_n0``): a user's name never enters
        the generated source, so no name can break it or show up as code in a traceback."""
        bound = self._names.get(name)
        if bound is None:
            bound = self._names[name] = f"{self.prefix}n{len(self._names)}"
            self.namespace[bound] = name
        return bound

    def _name(self, source: object, root: bool = False) -> str:
        name = self._sources.get(id(source))
        if name is None:
            p = self.prefix
            if isinstance(source, dict):
                name = f"{p}g" if root else f"{p}g{len(self._sources)}"
            else:
                name = f"{p}cell{len(self._sources)}"
            self._sources[id(source)] = name
            self.namespace[name] = source
        return name

    def _walk(self, fn: types.FunctionType, callers: tuple[str, ...], depth: int) -> None:
        """Snapshot what ``fn`` reads; ``callers`` are the functions that led to it (empty
        for the function itself)."""
        if id(fn) in self._functions:
            return
        self._functions[id(fn)] = fn
        root = not callers
        label = f"{fn.__qualname__}()"
        reader = self.owner if root else f"{label} (called from {', called from '.join(reversed(callers))})"
        inner = (*callers, self.owner if root else label)
        code = fn.__code__
        reads = code_reads(code)
        fn_globals = fn.__globals__
        module = fn_globals.get("__name__")
        table = self._name(fn_globals, root=root)
        for name in reads.globals:
            if name in fn_globals:
                value = fn_globals[name]
                if not root and _own_state(self._state, fn_globals, name, value):
                    continue
                path = name if root or not isinstance(module, str) else f"{module}.{name}"
                self._add(
                    "global", path, reader, value, ("dict", fn_globals, name), f"{table}.get({self._key(name)}, {{m}})"
                )
                self._descend(value, path, reads.chains.get(name, ()), reader, inner, depth)
            elif hasattr(builtins, name):
                # A builtin: drift is a new global shadowing it (checked per module, at the end).
                self._builtins.setdefault(id(fn_globals), (fn_globals, {}))[1].setdefault(name, reader)
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue  # an unfilled cell (a name assigned later in the enclosing scope)
            self._add("closure", name, reader, value, ("cell", cell), f"{self._name(cell)}.cell_contents")
            self._descend(value, name, reads.chains.get(name, ()), reader, inner, depth)

    def _descend(
        self,
        value: object,
        path: str,
        chains: tuple[tuple[str, ...], ...],
        reader: str,
        callers: tuple[str, ...],
        depth: int,
    ) -> None:
        """Follow a value read: a helper function's own reads, a module's attributes read."""
        if _followed_module(value):
            for chain in chains:
                current, current_path = value, path
                for attribute in chain:
                    mapping = current.__dict__
                    if attribute not in mapping:
                        break  # a module __getattr__ (or a missing name): not followed
                    if _own_state(self._state, mapping, attribute, mapping[attribute]):
                        break
                    current, current_path = mapping[attribute], f"{current_path}.{attribute}"
                    read = f"{self._name(mapping)}.get({self._key(attribute)}, {{m}})"
                    self._add("module attribute", current_path, reader, current, ("dict", mapping, attribute), read)
                    if not _followed_module(current):
                        self._follow(current, callers, depth)
                        break
            return
        self._follow(value, callers, depth)

    def _follow(self, value: object, callers: tuple[str, ...], depth: int) -> None:
        fn = _followed_function(value)
        if fn is None or id(fn) in self._functions:
            return
        if depth >= MAX_DEPTH:
            self.unchecked.append(f"{fn.__qualname__}() ({MAX_DEPTH} calls deep)")
            return
        self._walk(fn, callers, depth + 1)

    def _add(self, where: str, path: str, reader: str, value: object, source: tuple, read: str) -> None:
        key = (id(source[1]), source[2] if source[0] == "dict" else None)
        if key in self._keys:
            return
        self._keys.add(key)
        p = self.prefix
        read = read.format(m=f"{p}MISSING")
        index = len(self.entries)
        slot = f"{p}s{index}"
        mode = _compare_mode(value)
        snapshot = freeze(value) if mode == "container" else value
        self._append(Entry(where, path, reader, mode, value, snapshot, source))
        self.namespace[slot] = snapshot
        unrolled = _Unrolled(self.namespace, slot, p).tests(f"{p}v", value) if mode == "container" else None
        if unrolled is not None:
            # the frozen comparison stays, behind the unrolled one: it decides whenever that
            # one fails, so the check means exactly what freeze() comparison means
            self.check_lines.append(f"{p}v = {read}")
            self.check_lines.append("if not (")
            self.check_lines += [f"    {test}" if i == 0 else f"    and {test}" for i, test in enumerate(unrolled)]
            self.check_lines.append(f") and {p}freeze({p}v) != {slot}: {p}drift({index})")
        elif mode == "container":
            self.check_lines.append(f"if {p}freeze({read}) != {slot}: {p}drift({index})")
        elif mode == "scalar":
            self.check_lines.append(f"{p}v = {read}")
            self.check_lines.append(f"if {p}v is not {slot} and not {p}same_scalar({p}v, {slot}): {p}drift({index})")
        else:
            self.check_lines.append(f"if {read} is not {slot}: {p}drift({index})")

    def _append(self, entry: Entry) -> None:
        if len(self.entries) >= MAX_ENTRIES:
            raise _Budget
        self.entries.append(entry)

    # --- the error -----------------------------------------------------------------------
    def describe(self, index: int) -> str:
        """The message for entry ``index`` having drifted."""
        entry = self.entries[index]
        if entry.where == "builtin":
            mapping, readers = entry.source[1], typing.cast(dict, entry.value)  # readers by name
            name = next((n for n in readers if n in mapping), next(iter(readers)))
            return (
                f"builtin {name!r} read by {readers[name]} changed: a new global now shadows the builtin "
                "it read; rename the global"
            )
        now = entry.now()
        shown = "gone" if now is _MISSING else _short.repr(now)
        return (
            f"{entry.where} {entry.path!r} read by {entry.reader} changed: it was {_short.repr(entry.old())} "
            f"when first compiled, now {shown}; pass it as an argument (a Constexpr if it selects code) "
            f"instead of reading it from a {'closure' if entry.where == 'closure' else 'global'}"
        )

    def _raise_drift(self, index: object) -> None:
        if isinstance(index, int) and 0 <= index < len(self.entries):
            raise GlobalDriftError(self.describe(index))
        raise GlobalDriftError(f"{index!r} read by {self.owner} has changed")
