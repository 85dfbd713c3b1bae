"""Key plans: the lean key equals the full key byte for byte, or both refuse alike."""

from __future__ import annotations

import collections
import dataclasses
import enum

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import jitcore as jc
from jitcore.errors import ArgumentError
from jitcore.keys import KeyPlan, Parameter, parameters_of


def canonical_bytes(key):
    """A key's bytes: its repr, which spells every type (1, True, 1.0 and '1' all differ) and,
    unlike a pickle, does not depend on which equal objects happen to be shared."""
    return repr(key).encode()


def outcome(fn, *args):
    try:
        return ("ok", canonical_bytes(fn(*args)))
    except Exception as exc:
        return ("error", type(exc), str(exc))


def test_plan_from_a_launcher_reads_constexpr_annotations():
    def launcher(x, y, n: jc.Constexpr[int], alpha: float = 1.0):
        pass

    params = parameters_of(launcher)
    assert [p.name for p in params] == ["x", "y", "n", "alpha"]
    assert [p.constexpr for p in params] == [False, False, True, False]
    assert params[3].default == 1.0


def test_plan_reads_string_annotations():
    namespace = {}
    exec(
        "from __future__ import annotations\nimport jitcore as jc\n"
        "def launcher(x, n: jc.Constexpr[int], m: Unknown[int]): pass",
        namespace,
    )
    params = parameters_of(namespace["launcher"])
    assert [p.constexpr for p in params] == [False, True, False]


def test_key_plan_of_a_launcher_is_the_plan_jit_builds_for_it():
    def launcher(x, n: jc.Constexpr[int], alpha=1.0):
        pass

    plan = jc.KeyPlan.of(launcher)
    assert plan.names == ("x", "n", "alpha")
    x = torch.randn(4, 3)
    assert plan.lean_key(x, 3, 2.0) == plan.full_key(x, 3, 2.0)
    assert plan.lean_key(x, 3, 2.0)[1:] == (("int", 3), "float")  # n by value, alpha by type
    with pytest.raises(TypeError, match="fixed list"):
        jc.KeyPlan.of(lambda *args: None)


@pytest.mark.parametrize("source", ["def f(*args): pass", "def f(**kw): pass", "def f(x, *, y): pass"])
def test_plans_need_a_fixed_positional_parameter_list(source):
    namespace = {}
    exec(source, namespace)
    with pytest.raises(TypeError, match="fixed list"):
        parameters_of(namespace["f"])


def test_scalars_are_keyed_by_type_constexpr_by_value():
    plan = KeyPlan([Parameter("a"), Parameter("b", constexpr=True)])
    assert plan.lean_key(3, 4) == plan.lean_key(5, 4) == ("int", ("int", 4))
    assert plan.lean_key(3.0, 4) == ("float", ("int", 4))
    assert plan.lean_key(True, 4)[0] == "bool"
    assert plan.lean_key(np.float32(1), 4)[0] == "numpy.float32"
    assert plan.lean_key(1, True) != plan.lean_key(1, 1)  # bool and int constexprs never collide
    assert plan.lean_key(1, 4) != plan.lean_key(1, 5)
    assert plan.lean_key(1, torch.float16)[1] == ("dtype", torch.float16)


def test_unhashable_constexpr_is_a_clear_type_error_on_both_paths():
    plan = KeyPlan([Parameter("b", constexpr=True)])
    for value in ([1, 2], (1, [2]), {"a": 1}):
        lean, full = outcome(plan.lean_key, value), outcome(plan.full_key, value)
        assert lean == full
        assert lean[1] is TypeError and "Constexpr parameter 'b' needs a hashable" in lean[2]
    with pytest.raises(TypeError, match="got a tensor"):
        plan.lean_key(torch.randn(2))


def test_unsupported_scalar_type_names_the_parameter():
    plan = KeyPlan([Parameter("x"), Parameter("weird")])
    with pytest.raises(ArgumentError, match="parameter 'weird': unsupported argument type object"):
        plan.lean_key(torch.randn(3), object())
    assert outcome(plan.lean_key, 1, "s") == outcome(plan.full_key, 1, "s")


def test_cache_signature_is_duck_typed():
    class Config:
        def __cache_signature__(self):
            return ("config", 7)

    plan = KeyPlan([Parameter("c")])
    assert plan.lean_key(Config()) == plan.full_key(Config())
    assert plan.lean_key(Config())[0].signature == ("config", 7)


def test_no_runtime_checkable_protocol_isinstance_in_key_paths():
    import inspect

    from jitcore import keys, tensors

    for module in (keys, tensors):
        assert "runtime_checkable" not in inspect.getsource(module)


def test_adaptors_and_subclasses_go_through_the_generic_path():
    plan = KeyPlan([Parameter("x")])
    x = torch.randn(4, 4)
    assert plan.lean_key(jc.from_dlpack(x)) == plan.full_key(jc.from_dlpack(x))
    p = torch.nn.Parameter(torch.randn(4, 4))
    assert plan.lean_key(p) == plan.full_key(p) == plan.lean_key(p.detach())


_ARGS = st.one_of(
    st.integers(-5, 5),
    st.floats(allow_nan=False),
    st.booleans(),
    st.sampled_from([np.float32(1.5), np.int64(3), np.bool_(True), np.uint8(2)]),
    st.builds(
        lambda shape, t: torch.empty(shape).t() if t and len(shape) == 2 else torch.empty(shape),
        st.lists(st.integers(0, 4), max_size=3),
        st.booleans(),
    ),
    st.builds(lambda n, step: torch.empty(n)[::step], st.integers(0, 6), st.integers(1, 3)),
    st.just(torch.randn(3, dtype=torch.complex64).conj()),
    st.just(torch.empty(2, device="meta")),
    st.just("text"),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(_ARGS, min_size=1, max_size=6), st.data())
def test_property_lean_key_equals_full_key(args, data):
    flags = data.draw(st.lists(st.booleans(), min_size=len(args), max_size=len(args)))
    plan = KeyPlan(
        [
            Parameter(f"a{i}", constexpr=flag and not isinstance(a, torch.Tensor))
            for i, (a, flag) in enumerate(zip(args, flags))
        ]
    )
    assert outcome(plan.lean_key, *args) == outcome(plan.full_key, *args)


@pytest.mark.parametrize("count", [1, 4, 16])
def test_generated_lean_key_source_is_readable(count):
    plan = KeyPlan([Parameter(f"t{i}") for i in range(count)])
    assert plan.source.startswith("def lean_key(")
    assert plan.lean_key(*[torch.randn(3)] * count) == plan.full_key(*[torch.randn(3)] * count)


# --- Constexpr values: hashed by value, keyed by exact type -------------------------------------
class Settings:  # a plain class: hashed by identity, its attributes settable
    block = 128


@dataclasses.dataclass(frozen=True)
class Frozen:
    block: int
    eps: float
    extra: object = None


class Mode(enum.IntEnum):
    ONE = 1


Pair = collections.namedtuple("Pair", "a b")


@pytest.mark.parametrize(
    "value, holds",
    [
        (Settings(), ""),
        (Settings, ""),  # a class: its attributes can change in place too
        (lambda: 1, ""),
        ((1, Settings()), ", which holds a Settings"),
        (frozenset({Settings()}), ", which holds a Settings"),
        (Frozen(1, 0.5, extra=Settings()), ", which holds a Settings"),
    ],
)
def test_constexpr_values_hashed_by_identity_are_refused_on_both_paths(value, holds):
    plan = KeyPlan([Parameter("cfg", constexpr=True)])
    lean, full = outcome(plan.lean_key, value), outcome(plan.full_key, value)
    assert lean == full and lean[1] is TypeError
    assert "Constexpr parameter 'cfg' needs a value hashed by its value" in lean[2]
    assert f"got a {type(value).__qualname__}{holds} hashed by identity" in lean[2]


@pytest.mark.parametrize(
    "value",
    [None, ..., torch.float16, torch.strided, int, np.float32, Mode.ONE, Frozen(1, 0.5), Pair(1, "a"), (1, "a", 2.0)],
)
def test_constexpr_values_hashed_by_value_are_keyed(value):
    plan = KeyPlan([Parameter("cfg", constexpr=True)])
    assert canonical_bytes(plan.lean_key(value)) == canonical_bytes(plan.full_key(value))
    assert plan.lean_key(value) == plan.lean_key(value)


def test_a_mutable_constexpr_is_refused_before_anything_is_cached():
    from .fakes import CountingBackend

    backend = CountingBackend()
    kernel = jc.Kernel("__global__ void k(int block) {}", "k")

    @jc.jit
    def launch(cfg: jc.Constexpr[object]):
        kernel[1, 1](cfg.block)

    with jc.backends.use_backend(backend):
        with pytest.raises(TypeError, match="hashed by identity: a change made to it in place"):
            launch(Settings())
        launch(Frozen(256, 0.0))
    assert launch.cache_info().states == 1 and len(backend.calls) == 1


# Values equal to each other under ==, of different types or bits: each must have its own key.
TWINS = [
    True,
    1,
    np.True_,
    np.int64(1),
    np.int32(1),
    1.0,
    np.float64(1.0),
    np.float32(1.0),
    Mode.ONE,
    (True,),
    (1,),
    (np.True_,),
    Pair(1, 0.0),
    (1, 0.0),
    (1, -0.0),
    frozenset({1}),
    frozenset({True}),
    Frozen(1, 0.0),
    Frozen(1, -0.0),
    Frozen(True, 0.0),
]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(TWINS), st.sampled_from(TWINS))
def test_property_constexpr_keys_collide_only_for_the_same_type_and_value(first, second):
    """``True == 1 == np.True_ == 1.0`` and ``0.0 == -0.0`` in Python, but a launcher traced
    with one may compile other code than with the other (a template argument, a float's sign):
    their keys differ unless the values are the same object of one type."""
    plan = KeyPlan([Parameter("c", constexpr=True)])
    same = first is second
    assert (plan.lean_key(first) == plan.lean_key(second)) == same, (first, second)
    assert (plan.full_key(first) == plan.full_key(second)) == same
    assert canonical_bytes(plan.lean_key(first)) == canonical_bytes(plan.full_key(first))


# --- numpy scalars: every bool, integer and float type, by what it is ---------------------------
NUMPY_SCALAR_TYPES = sorted(
    {t for t in np.sctypeDict.values() if issubclass(t, (np.bool_, np.integer, np.floating))}, key=str
)


@pytest.mark.parametrize("kind", NUMPY_SCALAR_TYPES, ids=lambda t: t.__name__)
def test_every_numpy_bool_integer_and_float_type_up_to_8_bytes_is_a_runtime_scalar(kind):
    plan = KeyPlan([Parameter("n")])
    value = kind(3)
    dtype = np.dtype(kind)
    if dtype.kind not in "biuf" or dtype.itemsize > 8:  # timedelta64 (an integer with a unit), longdouble
        with pytest.raises(ArgumentError, match="parameter 'n': unsupported argument type"):
            plan.lean_key(value)
        return
    assert plan.lean_key(value) == plan.full_key(value) == (f"numpy.{dtype.name}",)


def test_a_numpy_longlong_is_keyed_like_the_int64_it_is():
    plan = KeyPlan([Parameter("n")])
    value = np.array([3], dtype="q")[0]  # numpy.longlong on Linux, a type apart from numpy.int64
    assert plan.lean_key(value) == plan.lean_key(np.int64(3)) == ("numpy.int64",)
