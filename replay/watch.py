"""The watch: the state a region reaches through its globals, closures and objects, as it was
when its graphs were recorded, checked on every call that may replay one.

Why: a graph bakes what the region read while it was recorded. The tensors it reads where they
lie (a module's weights) are baked at their addresses, with their dtype, sizes and strides; the
Python values it read (``self.scale``, ``self.training``, a config's field) are baked as the
kernels and shapes they chose. The globals snapshot (:class:`jitcore.GlobalsSnapshot`) sees a
global or closure value replaced, but not what happens behind it: a parameter replaced by
``model.load_state_dict(sd, assign=True)``, a tensor given new memory by ``W.data = ...``,
``module.half()`` or ``module.to(...)``, a ``resize_``, an attribute set, a submodule replaced,
a hook registered. Each of those here makes the region record again (the drift of its globals:
:meth:`replay.region.Region.rekey`), never a stale graph.

What is watched (:func:`build`, from the region's roots: its globals, closure values and module
attributes, and the object its call runs on: a module region, a callable object, a bound
method's ``self``), and what is reached through them, walked by the rules of
:mod:`replay.objects`:

- a dict (an object's ``__dict__``, a module's parameters, buffers, submodules and forward and
  backward hooks, a plain dict): its size and each key and value, the same objects in the
  same order, where a scalar (int, float by its bits, bool, str, bytes, None, a device) may be
  set again to an equal value;
- a list the same way; a set by a frozen copy (:func:`jitcore.drift.freeze`) and its items; a
  tuple's items; a list, dict or set subclass's class and ``__dict__`` too (not an
  ``OrderedDict``'s or a ``defaultdict``'s own attributes);
- a root function's defaults (the region's function, a function read as its global): the tuple
  and dict it holds, and what they reach;
- an optimizer's parameters' gradients: the tensor each holds (or None), and its state;
- an object of a Python class: its class (``__class__`` assigned) and its ``__dict__`` (the
  same dict), its slots; an ``nn.Module`` is such an object, walked without its state-dict
  hooks;
- a tensor (a parameter, a buffer, a tensor attribute): its Python type, data pointer, dispatch
  keys (its device type, conjugate and negative bits among them), dtype, device, sizes and
  strides (a sparse or nested tensor by its members: :func:`watched_tensor_state`), and its
  class and ``__dict__`` (``w.scale = ...``). Not its storage's size (torch resizes a storage
  into new memory, which the pointer shows), nor whether it requires grad (see
  docs/replay.md, Autograd).

Not walked (compared by identity by whatever holds them): functions, classes, modules, enums,
dtypes, objects of C extension types (a generator, a lock, a numpy array), and objects of the
packages the globals snapshot does not follow (:data:`jitcore.drift.SKIP_PACKAGES`: jitcore's
launchers, replay's regions, triton's kernels keep caches that fill as they compile) other than
``nn.Module``s and optimizers (whose learning rates a step bakes). A tensor's values are
not watched: graphs read them live. An ``OrderedDict`` reordered alone (``move_to_end``) is not
seen. Bounds: :data:`MAX_DEPTH` levels below a root (a module's parameters, buffers and
submodules are one level below it) and :data:`MAX_VALUES` values in all (each dict entry, list
item, set, slot and tensor); what lies past them is not watched, and a ReplayWarning says so.

The check (:func:`watch_check`) runs one :class:`WatchProgram` two ways: csrc/replay_checks.c's
``WatchCheck`` where that file was built (the tensors compared by the torch-side helper in one
call; dicts skipped while the interpreter's dict watchers or version tags say none changed),
else the program's own :meth:`WatchProgram.first_change`, in Python. Both say "changed" for the same states: the C
check leaves every case it does not decide by identity to :meth:`WatchProgram.same`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import operator
import types
from collections.abc import Callable

import attrs
import torch

import jitcore
from jitcore import GlobalDriftError
from jitcore.for_replay import SKIP_PACKAGES, compiled_helpers_enabled, exact, freeze, generated, torch_native_module
from replay import objects
from replay.warn import warn

try:  # the check in C (csrc/replay_checks.c; optional, built by setup.py)
    from replay._checks import WatchCheck as _WatchCheck
except ImportError:
    _WatchCheck = None

#: Containers whose own attributes are not watched, only what they hold: the built-in ones
#: (they have none), and the standard library's ordered and default dicts, which hold a module's
#: hooks by the dozen and whose instances' own attributes no region reads.
_PLAIN_CONTAINERS = frozenset({dict, list, set, frozenset, collections.OrderedDict, collections.defaultdict})
#: Levels of objects and containers a walk follows below a root.
MAX_DEPTH = 32
#: Values watched in all for one region: each dict entry, list item, set, slot and tensor.
MAX_VALUES = 65536

#: Classes whose values are compared by their holder and never walked (scalars by value,
#: the others by identity).
_SCALARS = frozenset({int, float, complex, bool, str, bytes, type(None)})
_VALUE_CLASSES = _SCALARS | {torch.device}
_NOT_WALKED = (
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.ModuleType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    enum.Enum,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    range,
    slice,
)
#: An nn.Module's entries a call never reads, or that change only with another one (a hook's
#: keyword and always-called flags go with the hook): held by identity in its __dict__, not walked.
_MODULE_NOT_WALKED = frozenset(
    {
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_non_persistent_buffers_set",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks_with_kwargs",
    }
)
#: An nn.Module's registries: their entries are its attributes, one level below it.
_MODULE_REGISTRIES = frozenset({"_parameters", "_buffers", "_modules"})

#: Classes of the packages not followed whose objects are walked all the same.
_WALKED_LIBRARY_CLASSES = (torch.nn.Module, torch.optim.Optimizer)


def _walked_class(cls: type) -> bool:
    """Whether objects of ``cls`` are walked: user code and the packages followed, modules and
    optimizers anywhere (not jitcore's, replay's or triton's objects, whose caches fill as they
    compile: they would re-key a region at every new shape)."""
    if issubclass(cls, _WALKED_LIBRARY_CLASSES):
        return True
    module = getattr(cls, "__module__", None)
    return not isinstance(module, str) or module.partition(".")[0] not in SKIP_PACKAGES


#: What a dict holds, for messages and measurements.
ATTRIBUTES, REGISTRY, ITEMS = "attributes", "registry", "items"
_UNSET = object()  # an unset slot
_UNREADABLE = ("unreadable",)  # a tensor's field torch does not give
_dispatch_keys = torch._C._dispatch_keys


def same_value(now: object, then: object) -> bool:
    """Whether a holder still holds what it held: the same object, or a scalar of the same
    class and value (floats and complex numbers by their bits: -0.0 is not 0.0)."""
    if now is then:
        return True
    kind = type(then)
    return type(now) is kind and kind in _VALUE_CLASSES and exact(now) == exact(then)


def python_tensor_state(tensor: torch.Tensor) -> tuple | None:
    """What the Python check compares of a tensor: what the torch-side helper's tensor_state
    reads, through torch's Python API (None where it cannot be read: no storage, nested)."""
    try:
        return (
            type(tensor),
            tensor.data_ptr(),
            _dispatch_keys(tensor).raw_repr(),
            tensor.dtype,
            tensor.device,
            tuple(tensor.shape),
            tensor.stride(),
        )
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def watched_tensor_state(tensor: torch.Tensor) -> tuple:
    """What the watch compares of a tensor: :func:`python_tensor_state`, else (sparse, nested:
    no one pointer) what can be read of it."""
    state = python_tensor_state(tensor)
    return _partial_tensor_state(tensor) if state is None else state


def _partial_tensor_state(tensor: torch.Tensor) -> tuple:
    """What can be read of a tensor whose memory torch does not expose as one pointer (sparse,
    nested): each field where it reads (a sparse tensor's by its indices and values), else a
    marker, so that a change of its layout, dtype or sizes is still seen."""
    parts: list = []
    readers = (type, _dispatch_keys_bits, operator.attrgetter("layout", "dtype", "device"), _sizes, _members)
    for read in readers:
        try:
            parts.append(read(tensor))
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            parts.append(_UNREADABLE)
    return tuple(parts)


def _dispatch_keys_bits(tensor: torch.Tensor) -> object:
    return _dispatch_keys(tensor).raw_repr()


def _sizes(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape)


def _members(tensor: torch.Tensor) -> tuple:
    """A sparse tensor's indices and values, a nested tensor's buffer and its tensors' sizes,
    strides and offsets (their states and the layout's numbers)."""
    if tensor.is_nested:
        layout = (
            tensor._nested_tensor_size(),
            tensor._nested_tensor_strides(),
            tensor._nested_tensor_storage_offsets(),
        )
        return (
            python_tensor_state(tensor.values()),
            *((tuple(part.shape), tuple(part.flatten().tolist())) for part in layout),
        )
    if tensor.layout is torch.sparse_coo:
        members = (tensor._indices(), tensor._values())
    elif tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        members = (tensor.crow_indices(), tensor.col_indices(), tensor.values())
    elif tensor.layout in (torch.sparse_csc, torch.sparse_bsc):
        members = (tensor.ccol_indices(), tensor.row_indices(), tensor.values())
    else:
        return _UNREADABLE
    return tuple(python_tensor_state(member) for member in members)


@attrs.frozen(eq=False)
class Other:
    """A holder the check compares in Python alone: a set (its frozen copy) or a slot."""

    holder: object
    slot: str | None  # None: a set
    recorded: object
    path: str

    def now(self) -> object:
        return freeze(self.holder) if self.slot is None else slot_value(self.holder, self.slot)

    def same(self) -> bool:
        now = self.now()
        return now == self.recorded if self.slot is None else same_value(now, self.recorded)


@attrs.frozen(eq=False)
class WatchProgram:
    """What a region's watch checks, read by name by csrc/replay_checks.c's WatchCheck and run
    by :meth:`first_change` in Python: the holders (dicts, lists, objects, others) with what
    each held, and the tensors with their states (``words``: as the torch-side helper's
    ``tensor_state`` read them, None each where it does not or is not loaded; ``states``: as
    :func:`python_tensor_state` reads them)."""

    dicts: tuple = ()
    dict_keys: tuple = ()
    dict_values: tuple = ()
    dict_paths: tuple = ()  # (path, ATTRIBUTES / REGISTRY / ITEMS) per dict
    lists: tuple = ()
    list_items: tuple = ()
    list_paths: tuple = ()
    objects: tuple = ()
    types: tuple = ()
    object_dicts: tuple = ()  # the object's __dict__, or None
    object_paths: tuple = ()
    tensors: tuple = ()
    states: tuple = ()
    words: tuple = ()
    tensor_paths: tuple = ()
    other_holders: tuple = ()
    reader: object | None = None  # the helper's replay_support capsule (csrc/replay_support.h)
    unwatched: tuple = ()  # paths the bounds left out

    @property
    def others(self) -> int:
        return len(self.other_holders)

    @property
    def values(self) -> int:
        """How many values are watched (each dict entry, list item, other holder and tensor)."""
        return sum(map(len, self.dict_keys)) + sum(map(len, self.list_items)) + self.others + len(self.tensors)

    def __bool__(self) -> bool:
        return bool(self.dicts or self.lists or self.objects or self.tensors or self.other_holders)

    # --- the exact comparisons ----------------------------------------------------------------
    def same(self, kind: str, index: int) -> bool:
        """Whether holder ``index`` of ``kind`` ('d' a dict, 'l' a list, 't' a tensor, 'o'
        another holder) holds what it held: the check's rule, where identity alone cannot say."""
        if kind == "d":
            items = tuple(dict.items(self.dicts[index]))
            keys, values = self.dict_keys[index], self.dict_values[index]
            return len(items) == len(keys) and all(
                same_value(k, k0) and same_value(v, v0) for (k, v), k0, v0 in zip(items, keys, values)
            )
        if kind == "l":
            items, recorded = list.copy(self.lists[index]), self.list_items[index]
            return len(items) == len(recorded) and all(map(same_value, items, recorded))
        if kind == "t":
            return watched_tensor_state(self.tensors[index]) == self.states[index]
        if kind == "o":
            return self.other_holders[index].same()
        raise ValueError(f"a watch holder's kind is 'd', 'l', 't' or 'o', not {kind!r}")

    def first_change(self) -> str | None:
        """The path of the first thing watched that changed, or None: the check in Python."""
        is_ = operator.is_
        for i, d in enumerate(self.dicts):
            keys, values = self.dict_keys[i], self.dict_values[i]
            if dict.__len__(d) != len(keys) or not (
                all(map(is_, dict.values(d), values)) and all(map(is_, dict.keys(d), keys))
            ):
                if not self.same("d", i):
                    return self._dict_change(i)
        for i, items in enumerate(self.list_items):
            current = self.lists[i]
            if (list.__len__(current) != len(items) or not all(map(is_, current, items))) and not self.same("l", i):
                return self.list_paths[i]
        for i, tensor in enumerate(self.tensors):
            if watched_tensor_state(tensor) != self.states[i]:
                return self.tensor_paths[i]
        for i, holder in enumerate(self.objects):
            if type(holder) is not self.types[i]:
                return f"{self.object_paths[i]} (its class)"
            recorded = self.object_dicts[i]
            if recorded is not None and _instance_dict(holder) is not recorded:
                return f"{self.object_paths[i]}.__dict__"
        for other in self.other_holders:
            if not other.same():
                return other.path
        return None

    def _dict_change(self, index: int) -> str:
        """The path of the first entry of dict ``index`` that differs."""
        path, role = self.dict_paths[index]
        items = tuple(dict.items(self.dicts[index]))
        recorded = tuple(zip(self.dict_keys[index], self.dict_values[index]))
        for position in range(max(len(items), len(recorded))):
            now = items[position] if position < len(items) else (None, _UNSET)
            then = recorded[position] if position < len(recorded) else (None, _UNSET)
            if not (same_value(now[0], then[0]) and same_value(now[1], then[1])):
                key = now[0] if position < len(items) else then[0]
                return _entry_path(path, role, key)
        return path


def slot_value(holder: object, slot: str) -> object:
    """What a slot holds, as stored (no ``__getattribute__`` of the class runs), or _UNSET."""
    try:
        return object.__getattribute__(holder, slot)
    except AttributeError:
        return _UNSET


def _instance_dict(holder: object) -> object:
    try:
        return object.__getattribute__(holder, "__dict__")
    except AttributeError:
        return None


def _entry_path(path: str, role: str, key: object) -> str:
    """An entry's path: an attribute (a submodule of a Sequential by its number), or an item."""
    if role != ITEMS and isinstance(key, str):
        return objects.member_path(path, key)
    return f"{path}[{key!r}]"


# --- the walk ----------------------------------------------------------------------------------
class _Walk:
    """Builds a WatchProgram from roots: each holder met once (tied weights, shared modules and
    cycles are watched once), within the bounds."""

    def __init__(self, reader: object | None, words: Callable | None) -> None:
        self.reader, self.read_words = reader, words
        self.seen: set[int] = set()
        self.grads: set[int] = set()  # the parameters whose gradient is watched
        self.kept: list = []  # what `seen` names, alive while the walk lasts
        self.budget = MAX_VALUES
        self.fields: dict[str, list] = {field.name: [] for field in attrs.fields(WatchProgram)}

    def program(self) -> WatchProgram:
        return WatchProgram(
            **{name: tuple(values) for name, values in self.fields.items() if name != "reader"}, reader=self.reader
        )

    def _spend(self, count: int, path: str) -> bool:
        """Whether ``count`` more values fit the bound (else the path is noted as unwatched)."""
        if count > self.budget:
            self.fields["unwatched"].append(path)
            self.budget = 0
            return False
        self.budget -= count
        return True

    def value(self, value: object, path: str, depth: int) -> None:
        cls = type(value)
        if cls in _SCALARS or id(value) in self.seen:
            return
        if isinstance(value, torch.Tensor):
            self._first(value)
            self._tensor(value, path)
            self._attributes(value, path, depth)  # a tensor's Python attributes (w.scale = ...)
            return
        if isinstance(value, types.FunctionType) and depth == 0:
            self._first(value)
            self._defaults(value, path)  # a root function's defaults are read by its calls
            return
        if isinstance(value, _NOT_WALKED):
            return
        if depth > MAX_DEPTH:
            self.fields["unwatched"].append(path)
            return
        self._first(value)
        if isinstance(value, (dict, list, set, frozenset)) and cls not in _PLAIN_CONTAINERS:
            self._attributes(value, path, depth)  # a subclass's own attributes and class
        if isinstance(value, dict):
            self._dict(value, path, ITEMS, depth)
        elif isinstance(value, list):
            self._list(value, path, depth)
        elif isinstance(value, tuple):
            for i, item in enumerate(value):
                self.value(item, f"{path}[{i}]", depth + 1)
        elif isinstance(value, (set, frozenset)):
            if self._spend(1, path):
                self.fields["other_holders"].append(Other(value, None, freeze(value), path))
                for i, item in enumerate(value):  # the objects and tensors it holds
                    self.value(item, f"{path}{{{i}}}", depth + 1)
        elif isinstance(value, types.MethodType):
            self.value(value.__self__, f"{path}.__self__", depth + 1)
        elif (objects.is_object(value) or dataclasses.is_dataclass(cls)) and _walked_class(cls):
            self._object(value, cls, path, depth)

    def _first(self, value: object) -> None:
        self.seen.add(id(value))
        self.kept.append(value)

    def _tensor(self, tensor: torch.Tensor, path: str) -> None:
        if not self._spend(1, path):
            return
        fields = self.fields
        fields["tensors"].append(tensor)
        fields["states"].append(watched_tensor_state(tensor))
        fields["words"].append(self.read_words(tensor) if self.read_words is not None else None)
        fields["tensor_paths"].append(path)

    def _attributes(self, value: object, path: str, depth: int) -> None:
        """A tensor's or a container subclass's class and ``__dict__`` (where it has one)."""
        state = _instance_dict(value)
        if type(state) is not dict or id(state) in self.seen:
            return
        fields = self.fields
        fields["objects"].append(value)
        fields["types"].append(type(value))
        fields["object_dicts"].append(state)
        fields["object_paths"].append(path)
        self._first(state)
        self._dict(state, path, ATTRIBUTES, depth)

    def _defaults(self, function: types.FunctionType, path: str) -> None:
        """A function's defaults (the tuple and dict, as held, and what they reach)."""
        for name in ("__defaults__", "__kwdefaults__"):
            held = getattr(function, name)
            if held is not None and self._spend(1, f"{path}.{name}"):
                self.fields["other_holders"].append(Other(function, name, held, f"{path}.{name}"))
                self.value(held, f"{path}.{name}", 1)

    def _grads(self, optimizer: torch.optim.Optimizer, path: str) -> None:
        """The gradient each parameter of an optimizer holds (a step reads it where it lies):
        the same tensor, or None, and its state."""
        for g, group in enumerate(getattr(optimizer, "param_groups", ())):
            for i, parameter in enumerate(group.get("params", ()) if isinstance(group, dict) else ()):
                if not isinstance(parameter, torch.Tensor) or id(parameter) in self.grads:
                    continue
                self.grads.add(id(parameter))
                grad_path = f"{path}.param_groups[{g}]['params'][{i}].grad"
                if self._spend(1, grad_path):
                    self.fields["other_holders"].append(Other(parameter, "grad", parameter.grad, grad_path))
                    if parameter.grad is not None:
                        self.value(parameter.grad, grad_path, 1)

    def _dict(self, value: dict, path: str, role: str, depth: int, module: bool = False) -> None:
        items = tuple(dict.items(value))
        if not self._spend(len(items), path):
            return
        fields = self.fields
        fields["dicts"].append(value)
        fields["dict_keys"].append(tuple(k for k, _ in items))
        fields["dict_values"].append(tuple(v for _, v in items))
        fields["dict_paths"].append((path, role))
        for key, item in items:
            if module and key in _MODULE_REGISTRIES and type(item) is dict and id(item) not in self.seen:
                self._first(item)
                self._dict(item, path, REGISTRY, depth)  # its entries are the module's attributes
            elif not (module and key in _MODULE_NOT_WALKED):
                self.value(item, _entry_path(path, role, key), depth + 1)

    def _list(self, value: list, path: str, depth: int) -> None:
        items = tuple(list.copy(value))
        if not self._spend(len(items), path):
            return
        self.fields["lists"].append(value)
        self.fields["list_items"].append(items)
        self.fields["list_paths"].append(path)
        for i, item in enumerate(items):
            self.value(item, f"{path}[{i}]", depth + 1)

    def _object(self, value: object, cls: type, path: str, depth: int) -> None:
        walk = objects.class_walk(cls)
        if walk.refusal:
            return  # state Python cannot read (a C extension type): its identity, held by its holder
        state = _instance_dict(value)
        state = state if type(state) is dict else None
        fields = self.fields
        fields["objects"].append(value)
        fields["types"].append(cls)
        fields["object_dicts"].append(state)
        fields["object_paths"].append(path)
        if state is not None:
            self._first(state)
            self._dict(state, path, ATTRIBUTES, depth, module=walk.module)
        if isinstance(value, torch.optim.Optimizer):
            self._grads(value, path)
        for name in walk.slots:
            slot_path = _entry_path(path, ATTRIBUTES, name)
            recorded = slot_value(value, name)
            if self._spend(1, slot_path):
                fields["other_holders"].append(Other(value, name, recorded, slot_path))
                if recorded is not _UNSET:
                    self.value(recorded, slot_path, depth + 1)


def build(roots: list[tuple[object, str]], helper: object | None = None) -> WatchProgram:
    """The watch of what ``roots`` ((value, path) pairs) reach; ``helper`` the torch-side
    helper (its replay_support capsule and tensor_state), or None: tensors compared in Python."""
    reader = getattr(helper, "replay_support", None) if helper is not None else None
    words = getattr(helper, "tensor_state", None) if reader is not None else None
    walk = _Walk(reader if words is not None else None, words)
    for value, path in roots:
        walk.value(value, path, 0)
    return walk.program()


def region_roots(fn: Callable, entries, owner: str) -> list[tuple[object, str]]:
    """A region's roots: the object its call runs on (a module or callable object region, a
    bound method's ``self``, a partial's arguments) and the values its globals snapshot holds
    (globals, closure values, module attributes)."""
    roots: list[tuple[object, str]] = []
    if isinstance(fn, types.MethodType):
        roots += [(fn.__self__, f"{owner}.__self__"), (fn.__func__, owner)]
    elif isinstance(fn, functools.partial):
        roots += [(fn.args, f"{owner}.args"), (fn.keywords, f"{owner}.keywords"), (fn.func, f"{owner}.func")]
    elif isinstance(fn, types.FunctionType):
        roots.append((fn, owner))  # its defaults
    elif not isinstance(fn, (type, types.BuiltinFunctionType)):
        roots.append((fn, owner))
    roots += [(entry.value, entry.path) for entry in entries if entry.where != "builtin"]
    return roots


# --- the check -----------------------------------------------------------------------------------
def python_check(program: WatchProgram) -> Callable[[], bool]:
    """The program's check in Python: True where something watched changed."""

    def changed() -> bool:
        return program.first_change() is not None

    return changed


def native_enabled() -> bool:
    """Whether csrc/replay_checks.c's WatchCheck was built and ``JITCORE_NATIVE`` does not turn
    compiled helpers off."""
    return _WatchCheck is not None and compiled_helpers_enabled()


def watch_check(program: WatchProgram, *, compiled: bool = True, tags: bool = True) -> Callable[[], bool]:
    """The program's check: csrc/replay_checks.c's WatchCheck where :func:`native_enabled` (and
    ``compiled``), else :func:`python_check`. ``tags`` False: the C check walks every dict on
    every call (tests and measurements)."""
    if compiled and native_enabled():
        return _WatchCheck(program, tags=tags)
    return python_check(program)


class RegionSnapshot(jitcore.GlobalsSnapshot):
    """A region's globals snapshot with the watch of what they reach: its check (and the check
    lines the region's generated globals check is made of) ends with the watch, so a change
    the watch sees is the drift of the region's globals (the region re-keys)."""

    def __init__(self, fn: Callable, *, owner: str | None = None, prefix: str = "_"):
        super().__init__(fn, owner=owner, prefix=prefix)
        helper = torch_native_module()
        self.watch = build(region_roots(fn, self.entries, self.owner), helper)
        if self.watch.unwatched:
            shown = ", ".join(self.watch.unwatched[:4]) + (", ..." if len(self.watch.unwatched) > 4 else "")
            warn(
                f"the watch of {self.owner} stops at its bounds ({MAX_VALUES} values, {MAX_DEPTH} levels): a change "
                f"at or past {shown} is not seen (replay.watch)"
            )
        if not self.watch:
            return
        p = self.prefix
        self.namespace[f"{p}watch"] = watch_check(self.watch)
        self.check_lines.append(f"if {p}watch(): {p}drift({len(self.entries)})")
        body = "\n".join("    " + line for line in self.check_lines)
        self.source = f"def check():\n{body}\n"
        self.check = generated.define(self.source, self.filename, self.namespace)["check"]

    def describe(self, index: int) -> str:
        if index != len(self.entries) or not self.watch:
            return super().describe(index)
        changed = self.watch.first_change() or "what it reaches"
        return (
            f"{changed}, reached by {self.owner} through its globals, closures or objects, changed (replaced, given "
            "other memory, dtype or shape, or set to another value) since its graphs were recorded"
        )

    def _raise_drift(self, index: object) -> None:
        if index == len(self.entries) and self.watch:
            raise GlobalDriftError(self.describe(index))
        super()._raise_drift(index)
