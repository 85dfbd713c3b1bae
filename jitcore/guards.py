"""Tensor guards: a check, in C++, that tensors still fit a compiled call state or graph.

Computing a key reads four or five attributes per tensor in Python (dtype, strides, device,
the negative bit). When the same call state serves call after call,
a guard can answer "do these tensors still satisfy everything the state assumed?" in one
C++ call: torch's own dynamo guard evaluator (``torch._C._dynamo.guards.TensorGuards``)
compares the dispatch key set (device type, conjugate/negative bits, sparse, subclasses),
dtype, device index, requires_grad, and every size and stride we mark static.

The guard is only an inline cache in front of the key path, never a replacement for it: a
guard that says no sends the call down the ordinary key path, and where torch lacks the
evaluator (or it changes shape between releases) :func:`tensor_guard` returns None and every
call takes the key path. It is stricter than a key (requires_grad and inference mode count),
never looser: each static size and stride it checks is one the state was compiled for.

:func:`make_guard` generates the one ``guard(...)`` both fast paths serve from (``@jit``'s
most recent call state, replay's recorded keys): the caller describes what each argument must
be (:class:`ArgumentCheck`), the generator writes the checks, cheapest first, and the device
check.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import attrs
import torch

from jitcore import generated

try:  # torch's C++ guard evaluator (used by torch.compile on every call)
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except Exception:  # pragma: no cover - older or stripped torch builds
    _TensorGuards = None


def tensor_guard(
    examples: Sequence[torch.Tensor],
    sizes: Sequence[Sequence[int | None]],
    strides: Sequence[Sequence[int | None]],
) -> Callable[..., bool] | None:
    """A ``check(*tensors) -> bool`` for tensors like ``examples``, checking each static size
    and stride (``None`` entries are left unchecked); None if guards are unavailable."""
    found = _raw_tensor_guard(examples, sizes, strides)
    if found is None:
        return None
    raw, safe = found
    return raw if safe else _screened(raw, len(examples))


def _raw_tensor_guard(
    examples: Sequence[torch.Tensor],
    sizes: Sequence[Sequence[int | None]],
    strides: Sequence[Sequence[int | None]],
) -> tuple[Callable[..., bool], bool] | None:
    """(check, safe): the torch-side native helper's guard where it is built (safe: it says no
    to anything it is not, nested tensors included), else torch's evaluator, unscreened (not
    safe: the caller must keep nested tensors away from it, see :func:`_screened`). None where
    neither is available or the guard refuses its own examples."""
    if not examples:
        return None
    from jitcore import torch_native  # imported on use: `python -m jitcore.torch_native` runs it as __main__

    native = torch_native.module()
    if native is not None and all(_plain_strided(t) and t.layout is torch.strided for t in examples):
        try:
            check = native.tensor_guard(
                tuple(examples), tuple(tuple(s) for s in sizes), tuple(tuple(s) for s in strides)
            )
        except (TypeError, ValueError):
            check = None
        if check is not None and check(*examples):  # self-test, as below
            return check, True
    if _TensorGuards is None:
        return None
    if not all(_plain_strided(t) for t in examples):
        return None  # the evaluator's self-test below would abort on a nested example
    try:
        guard = _TensorGuards(
            *examples,
            dynamic_dims_sizes=[list(s) for s in sizes],
            dynamic_dims_strides=[list(s) for s in strides],
        )
        check = guard.check
        if not check(*examples):  # self-test: it must accept what it was built from
            return None
    except Exception:
        return None
    return check, False


def _plain_strided(tensor: object) -> bool:
    return isinstance(tensor, torch.Tensor) and not tensor.is_nested


def _screened(raw: Callable[..., bool], count: int) -> Callable[..., bool]:
    """``raw`` behind a Python screen for tensors torch's evaluator cannot survive.

    The C++ evaluator reads every argument's strides before it compares dispatch keys, and a
    strided nested tensor (``torch.nested.nested_tensor([...])``: class ``torch.Tensor``,
    layout ``strided``) throws from ``strides()`` inside code that cannot propagate the
    exception, so the process aborts (SIGABRT) instead of the guard saying no. Every other
    unusual tensor (sparse, meta, mkldnn, quantized, jagged nested, subclasses) is refused by
    the evaluator itself; ``tests/jitcore/test_adaptors.py`` checks each in a subprocess. Any
    argument whose ``is_nested`` cannot be read (not a tensor) is refused here too.
    The screen costs one Python frame and one attribute read per tensor."""
    names = [f"t{i}" for i in range(count)]
    params = ", ".join(names)
    nested = " or ".join(f"{name}.is_nested" for name in names)
    source = (
        f"def check({params}, /):\n"
        "    try:\n"
        f"        if {nested}:\n"
        "            return False\n"
        "    except Exception:\n"
        "        return False\n"
        f"    return _raw({params})\n"
    )
    namespace: dict[str, object] = {"_raw": raw}
    filename = generated.source_filename(f"screen of a tensor guard of {count} tensor{'' if count == 1 else 's'}")
    check = generated.define(source, filename, namespace)["check"]
    weakref.finalize(check, generated.forget_source, filename)  # made per guard: linecache stays bounded
    check.raw = raw
    return check


_ANY = object()  # ArgumentCheck.value when the value is not checked


@attrs.frozen(eq=False)  # identity: an example tensor has no meaningful ==
class ArgumentCheck:
    """What a guard generated by :func:`make_guard` checks of one argument.

    Every check starts with the argument's class, compared by identity (subclasses and look-alikes
    fail: they may key differently). Then, as the caller describes it, at most one of:

    - a value: ``argument == value``, or ``through(argument) == value`` when equality is not
      exact enough (floats by their bits: ``-0.0 == 0.0`` and a NaN is not equal to itself);
    - an attribute's class: ``argument.<attribute>.__class__ is inner`` (a wrapper whose
      wrapped value is keyed by class, as replay's Dynamic);
    - a tensor: torch's C++ tensor guard (:func:`tensor_guard`) built from ``example``, checking
      the ``sizes`` and ``strides`` that are not None.

    Build them with the class methods; the callers decide what is guardable, the generator
    only writes it."""

    cls: type
    value: object = _ANY
    through: Callable[[object], object] | None = None
    attribute: str | None = None
    inner: type | None = None
    example: torch.Tensor | None = None
    sizes: tuple[int | None, ...] = ()
    strides: tuple[int | None, ...] = ()

    @classmethod
    def of_class(cls, klass: type) -> ArgumentCheck:
        """Any argument of exactly this class (a runtime scalar: its value reaches the kernel)."""
        return cls(klass)

    @classmethod
    def equal(cls, value: object) -> ArgumentCheck:
        """An argument of exactly ``value``'s class, equal (``==``) to it."""
        return cls(type(value), value=value)

    @classmethod
    def equal_through(cls, example: object, through: Callable[[object], object]) -> ArgumentCheck:
        """An argument of exactly ``example``'s class whose ``through(argument)`` equals
        ``through(example)`` (floats by bits)."""
        return cls(type(example), value=through(example), through=through)

    @classmethod
    def wrapping(cls, wrapper: type, attribute: str, inner: type) -> ArgumentCheck:
        """An argument of exactly class ``wrapper`` whose ``attribute`` is of exactly class ``inner``."""
        if not attribute.isidentifier():
            raise ValueError(f"not an attribute name: {attribute!r}")
        return cls(wrapper, attribute=attribute, inner=inner)

    @classmethod
    def tensor(cls, example: torch.Tensor, sizes: Sequence[int | None], strides: Sequence[int | None]) -> ArgumentCheck:
        """A ``torch.Tensor`` (exactly) like ``example`` with these static sizes and strides
        (None: not checked), through torch's C++ evaluator."""
        return cls(torch.Tensor, example=example, sizes=tuple(sizes), strides=tuple(strides))


def make_guard(
    checks: Sequence[ArgumentCheck],
    *,
    device: int,
    current_device: Callable[[], int],
    description: str,
    packed: bool = False,
) -> Callable[..., bool] | None:
    """A generated ``guard(...) -> bool`` that accepts exactly the arguments ``checks``
    describe, one per argument, while ``current_device()`` is ``device``; None where torch
    cannot guard one of the tensors (the caller then serves every call through its key path).

    ``packed=False`` makes ``guard(_a0, _a1, ...)`` with one parameter per check (a ``@jit``
    dispatcher calls it with its own arguments); ``packed=True`` makes ``guard(*args)``, which
    says no to another number of arguments (a region passes whatever its caller passed).

    The checks are written cheapest first: every class (and value, attribute) check in argument
    order, then the tensors' nested screen (see :func:`_screened`, inline here: no frame),
    then torch's C++ evaluator, then the device. The evaluator is called once for all tensor
    arguments when they were distinct objects when the guard was built (it says no to one
    tensor passed as two arguments, so such a call takes the key path), else once per tensor
    argument (callers do pass one tensor as several arguments). Arguments are ``_a0``,
    ``_a1``, ... in the source (never a user's name); values reach it through the namespace,
    and the source is compiled through :func:`jitcore.generated.define` under a filename made
    from ``description`` (``guard.source`` holds it)."""
    names = [f"_a{i}" for i in range(len(checks))]
    namespace: dict[str, object] = {"_device": current_device}
    tests: list[str] = []
    tensors = [(name, check) for name, check in zip(names, checks) if check.example is not None]
    for index, (name, check) in enumerate(zip(names, checks)):
        namespace[f"_c{index}"] = check.cls
        test = f"{name}.__class__ is _c{index}"
        if check.attribute is not None:
            namespace[f"_i{index}"] = check.inner
            test += f" and {name}.{check.attribute}.__class__ is _i{index}"
        elif check.value is not _ANY:
            namespace[f"_v{index}"] = check.value
            if check.through is None:
                test += f" and {name} == _v{index}"
            else:
                namespace[f"_f{index}"] = check.through
                test += f" and _f{index}({name}) == _v{index}"
        tests.append(test)
    tensor_tests = []
    if tensors:
        distinct = len({id(check.example) for _, check in tensors}) == len(tensors)
        groups = [tensors] if distinct else [[one] for one in tensors]
        every_safe = True
        for number, group in enumerate(groups):
            found = _raw_tensor_guard(
                [check.example for _, check in group],
                [check.sizes for _, check in group],
                [check.strides for _, check in group],
            )
            if found is None:
                return None
            namespace[f"_tensor_guard{number}"], safe = found
            every_safe = every_safe and safe
            tensor_tests.append(f"_tensor_guard{number}({', '.join(name for name, _ in group)})")
        if not every_safe:  # the nested screen, before any evaluator that needs it
            tensor_tests.insert(0, "not (" + " or ".join(f"{name}.is_nested" for name, _ in tensors) + ")")
    body = " and ".join([*tests, *tensor_tests, f"_device() == {int(device)}"])
    if not packed:
        source = f"def guard({', '.join(names)}):\n    return {body}\n"
    elif names:
        source = (
            f"def guard(*args):\n    if len(args) != {len(names)}:\n        return False\n"
            f"    {', '.join(names)}{',' if len(names) == 1 else ''} = args\n    return {body}\n"
        )
    else:
        source = f"def guard(*args):\n    return not args and {body}\n"
    filename = generated.source_filename(description)
    guard = generated.define(source, filename, namespace)["guard"]
    weakref.finalize(guard, generated.forget_source, filename)  # rebuilt often: linecache stays bounded
    guard.source = source
    return guard
