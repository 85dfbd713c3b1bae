"""Globals drift: identity fast path, rebinding, in-place mutation, closures, builtins, and the
reads followed beyond the function: helpers' globals, module attributes."""

from __future__ import annotations

import collections
import enum
import functools
import io
import linecache
import math
import re
import struct
import textwrap
import token
import tokenize
import traceback
import types

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jitcore as jc
from jitcore import drift
from jitcore.backends import use_backend
from jitcore.drift import GlobalsSnapshot, freeze, global_names, thaw
from jitcore.errors import GlobalDriftError

from .fakes import CountingBackend

BLOCK = 256
SIZES = [1, 2, 3]
TABLE = {"a": 1}


def helper():
    return 1


def reader():
    return BLOCK + len(SIZES) + TABLE["a"] + helper() + math.pi + [i for i in SIZES][0]


def test_global_names_include_nested_code():
    names = global_names(reader.__code__)
    assert {"BLOCK", "SIZES", "TABLE", "helper", "math", "len"} <= set(names)


def test_identity_hit_passes():
    snapshot = GlobalsSnapshot(reader)
    snapshot.check()
    assert any("is not" in line for line in snapshot.check_lines)


def test_rebinding_a_global_is_drift_naming_it(monkeypatch):
    snapshot = GlobalsSnapshot(reader)
    monkeypatch.setitem(globals(), "helper", lambda: 2)
    with pytest.raises(GlobalDriftError, match="'helper'.*pass it as an argument"):
        snapshot.check()


def test_rebinding_to_an_equal_scalar_is_not_drift(monkeypatch):
    snapshot = GlobalsSnapshot(reader)
    monkeypatch.setitem(globals(), "BLOCK", int("256"))
    snapshot.check()
    monkeypatch.setitem(globals(), "BLOCK", 256.0)  # equal value, other type: drift
    with pytest.raises(GlobalDriftError, match="'BLOCK'"):
        snapshot.check()


def test_in_place_mutation_of_a_container_is_drift():
    snapshot = GlobalsSnapshot(reader)
    SIZES.append(4)
    try:
        with pytest.raises(GlobalDriftError, match="'SIZES'"):
            snapshot.check()
    finally:
        SIZES.pop()
    snapshot.check()
    TABLE["a"] = 2
    try:
        with pytest.raises(GlobalDriftError, match="'TABLE'"):
            snapshot.check()
    finally:
        TABLE["a"] = 1


def test_deleting_a_global_is_drift(monkeypatch):
    snapshot = GlobalsSnapshot(reader)
    monkeypatch.delitem(globals(), "TABLE")
    with pytest.raises(GlobalDriftError, match="'TABLE'"):
        snapshot.check()


def test_shadowing_a_builtin_is_drift(monkeypatch):
    snapshot = GlobalsSnapshot(reader)
    monkeypatch.setitem(globals(), "len", lambda x: 0)
    with pytest.raises(GlobalDriftError, match="shadows the builtin"):
        snapshot.check()


def test_closure_cells_are_checked():
    scale = [2]

    def make():
        factor = scale

        def inner():
            return factor[0]

        return inner

    inner = make()
    snapshot = GlobalsSnapshot(inner)
    snapshot.check()
    scale[0] = 3
    with pytest.raises(GlobalDriftError, match="closure 'factor'"):
        snapshot.check()


def test_identity_values_are_held_alive():
    class Opaque:
        pass

    namespace = {"obj": Opaque()}
    exec("def f():\n    return obj", namespace)
    snapshot = GlobalsSnapshot(namespace["f"])
    held = namespace.pop("obj")
    namespace["obj"] = Opaque()
    with pytest.raises(GlobalDriftError):
        snapshot.check()
    assert any(entry.value is held for entry in snapshot.entries)


def test_prefix_keeps_names_apart():
    snapshot = GlobalsSnapshot(reader, prefix="_zz")
    assert all(name.startswith("_zz") for name in snapshot.namespace if name not in ("check", "__builtins__"))


# --- followed reads: helpers' globals, module attributes ----------------------------------------

AXPY = r"""
template <typename T>
__global__ void axpy(const T* x, const T* y, T* out, T alpha, long long n) {}
"""


@pytest.fixture
def backend():
    fake = CountingBackend()
    with use_backend(fake):
        yield fake


HELPERS = textwrap.dedent(
    """
    EPS = 1e-05
    BLOCK = 256
    TABLE = {"n": 1}

    def scale(x):
        return x * EPS

    def block():
        return BLOCK

    def sized():
        return TABLE["n"]

    def outer(x):
        return inner(x) + 1

    def inner(x):
        return x + EPS

    def fact(n):
        return 1 if n <= 1 else n * fact(n - 1)
"""
)


def exec_function(source: str, **names):
    """A function defined by ``source`` with the given globals (a launcher module stand-in)."""
    namespace = {"__name__": "launchers", **names}
    exec(textwrap.dedent(source), namespace)
    return next(v for k, v in namespace.items() if isinstance(v, types.FunctionType) and k not in names)


def test_helper_global_drift_names_the_path_and_both_values(load):
    (helpers,) = load(helpers=HELPERS)
    launch_axpy = exec_function("def launch_axpy(x):\n    return helpers.scale(x)\n", helpers=helpers)
    snapshot = GlobalsSnapshot(launch_axpy, owner="launch_axpy")
    snapshot.check()
    helpers.EPS = 0.001
    message = (
        "global 'helpers.EPS' read by scale() (called from launch_axpy) changed: "
        "it was 1e-05 when first compiled, now 0.001"
    )
    with pytest.raises(GlobalDriftError, match=re.escape(message)):
        snapshot.check()
    helpers.EPS = 1e-05
    snapshot.check()
    del helpers.EPS
    with pytest.raises(GlobalDriftError, match="'helpers.EPS'.*now gone"):
        snapshot.check()


def test_helper_imported_by_name_and_helper_identity(load):
    (helpers,) = load(helpers=HELPERS)
    launch = exec_function("def launch(x):\n    return scale(x)\n", scale=helpers.scale)
    snapshot = GlobalsSnapshot(launch, owner="@jit launch")
    assert [(e.where, e.path) for e in snapshot.entries] == [("global", "scale"), ("global", "helpers.EPS")]
    helpers.EPS = 2.0
    with pytest.raises(GlobalDriftError, match=r"'helpers.EPS' read by scale\(\) \(called from @jit launch\)"):
        snapshot.check()
    helpers.EPS = 1e-05
    launch.__globals__["scale"] = helpers.block  # rebinding the helper itself
    with pytest.raises(GlobalDriftError, match="global 'scale' read by @jit launch changed"):
        snapshot.check()


def test_module_attribute_read(load):
    (cfg,) = load(cfg="BLOCK = 128\nNAME = 'x'\n")
    launch = exec_function("def launch(n):\n    return n // cfg.BLOCK\n", cfg=cfg)
    snapshot = GlobalsSnapshot(launch, owner="@jit launch")
    assert [e.path for e in snapshot.entries] == ["cfg", "cfg.BLOCK"]  # NAME is not read: not checked
    cfg.NAME = "y"
    snapshot.check()
    cfg.BLOCK = 64
    with pytest.raises(GlobalDriftError, match="module attribute 'cfg.BLOCK' read by @jit launch changed: it was 128"):
        snapshot.check()


def test_module_attribute_chain_through_a_package(load):
    pkg, _sub = load(**{"pkg/__init__": "from . import sub\n", "pkg/sub": "VALUE = 3\n"})
    launch = exec_function("def launch(n):\n    return n * pkg.sub.VALUE\n", pkg=pkg)
    snapshot = GlobalsSnapshot(launch)
    assert [e.path for e in snapshot.entries] == ["pkg", "pkg.sub", "pkg.sub.VALUE"]
    pkg.sub.VALUE = 4
    with pytest.raises(GlobalDriftError, match="'pkg.sub.VALUE'.*it was 3 when first compiled, now 4"):
        snapshot.check()


def test_module_in_a_closure_cell(load):
    (cfg,) = load(cfg="BLOCK = 128\n")

    def make(module):
        def launch(n):
            return n // module.BLOCK

        return launch

    snapshot = GlobalsSnapshot(make(cfg))
    cfg.BLOCK = 32
    with pytest.raises(GlobalDriftError, match="'module.BLOCK'"):
        snapshot.check()


def test_recursive_helper_is_followed_once(load):
    (helpers,) = load(helpers=HELPERS + "\nBASE = 1\n\ndef count(n):\n    return BASE if n == 0 else count(n - 1)\n")
    launch = exec_function("def launch(n):\n    return helpers.fact(n) + helpers.count(n)\n", helpers=helpers)
    snapshot = GlobalsSnapshot(launch)
    paths = [e.path for e in snapshot.entries]
    assert len(paths) == len(set(paths)) and "helpers.BASE" in paths
    helpers.BASE = 2
    with pytest.raises(GlobalDriftError, match=r"'helpers.BASE' read by count\(\)"):
        snapshot.check()


def test_helper_calling_a_helper_names_the_call_chain(load):
    (helpers,) = load(helpers=HELPERS)
    launch = exec_function("def launch(x):\n    return helpers.outer(x)\n", helpers=helpers)
    snapshot = GlobalsSnapshot(launch, owner="@jit launch")
    helpers.EPS = 0.5
    chain = r"'helpers.EPS' read by inner\(\) \(called from outer\(\), called from @jit launch\)"
    with pytest.raises(GlobalDriftError, match=chain):
        snapshot.check()


def test_container_global_read_by_a_helper_mutated_in_place(load):
    (helpers,) = load(helpers=HELPERS)
    launch = exec_function("def launch():\n    return helpers.sized()\n", helpers=helpers)
    snapshot = GlobalsSnapshot(launch)
    helpers.TABLE["n"] = 2
    with pytest.raises(GlobalDriftError, match=re.escape("it was {'n': 1} when first compiled, now {'n': 2}")):
        snapshot.check()
    helpers.TABLE["n"] = 1
    snapshot.check()


def test_the_old_value_is_the_snapshots_not_the_current_one():
    """Issue 13 item 7: a container mutated in place was reported with its current value."""
    snapshot = GlobalsSnapshot(reader)
    TABLE["a"] = 2
    try:
        with pytest.raises(GlobalDriftError, match=re.escape("it was {'a': 1} when first compiled, now {'a': 2}")):
            snapshot.check()
    finally:
        TABLE["a"] = 1
    SIZES.append(4)
    try:
        with pytest.raises(GlobalDriftError, match=re.escape("it was [1, 2, 3] when first compiled, now [1, 2, 3, 4]")):
            snapshot.check()
    finally:
        SIZES.pop()


def test_thaw_rebuilds_what_freeze_saw():
    point = collections.namedtuple("point", "x y")
    value = {"a": [1, (2.0, "s")], "b": {3}, "c": point(1, [2]), "d": collections.OrderedDict(k=frozenset({1}))}
    frozen = freeze(value)
    value["a"].append(9)
    assert thaw(frozen) == {"a": [1, (2.0, "s")], "b": {3}, "c": point(1, [2]), "d": {"k": frozenset({1})}}
    assert type(thaw(frozen)["c"]) is point


def test_a_helpers_own_state_is_not_drift(load):
    (_state, helpers) = load(
        state="STEPS = 0\nMODE = 'fast'\n",
        helpers="""
        import state

        _CACHE = {}
        _LIB = None
        CALLS = []
        COUNTS = {"n": 0}
        LIMIT = 4

        def lib():
            global _LIB
            if _LIB is None:
                _LIB = object()
            return _LIB

        def fill(k):
            _CACHE[k] = k * 2

        def cached(k):
            if k not in _CACHE:
                fill(k)
            CALLS.append(k)
            COUNTS["n"] += 1
            state.STEPS += 1
            return _CACHE[k] + LIMIT + state.STEPS + len(state.MODE)
        """,
    )
    launch = exec_function("def launch(k):\n    return helpers.lib(), helpers.cached(k)\n", helpers=helpers)
    snapshot = GlobalsSnapshot(launch)
    launch(3)  # a trace fills the caches after the snapshot was taken
    snapshot.check()
    paths = [e.path for e in snapshot.entries]
    assert {"helpers._CACHE", "helpers._LIB", "helpers.CALLS", "helpers.COUNTS", "helpers.state.STEPS"}.isdisjoint(
        paths
    )
    assert "helpers.state.MODE" in paths
    helpers.LIMIT = 5  # read, never written by the helpers: checked
    with pytest.raises(GlobalDriftError, match="'helpers.LIMIT'"):
        snapshot.check()


def test_partials_methods_and_staticmethods_are_followed(load):
    (helpers,) = load(
        helpers="""
        import functools

        EPS = 1.0

        def scale(x, factor):
            return x * factor * EPS

        class Ops:
            @staticmethod
            def static(x):
                return x + EPS

            def bound(self, x):
                return x - EPS

        half = functools.partial(scale, factor=0.5)
        static = Ops.__dict__["static"]
        bound = Ops().bound
        """
    )
    for name in ("half", "static", "bound"):
        launch = exec_function(f"def launch(x):\n    return {name}(x)\n", **{name: getattr(helpers, name)})
        snapshot = GlobalsSnapshot(launch)
        assert "helpers.EPS" in [e.path for e in snapshot.entries], name
        helpers.EPS = 2.0
        with pytest.raises(GlobalDriftError, match="'helpers.EPS'"):
            snapshot.check()
        helpers.EPS = 1.0


def test_a_callable_objects_forward_is_followed(load):
    (helpers,) = load(
        helpers="""
        import torch

        SCALE = 2.0

        class Scale(torch.nn.Module):
            def forward(self, x):
                return x * SCALE

        class Plain:
            def __call__(self, x):
                return x * SCALE
        """
    )
    for module in (helpers.Scale(), helpers.Plain()):
        snapshot = GlobalsSnapshot(module, owner="region step")
        helpers.SCALE = 3.0
        with pytest.raises(GlobalDriftError, match=r"'helpers.SCALE' read by \w+\.(forward|__call__)\(\)"):
            snapshot.check()
        helpers.SCALE = 2.0
    GlobalsSnapshot(torch.add).check()  # nothing to follow: an empty check


def test_torch_numpy_and_stdlib_functions_are_not_followed(load):
    (helpers,) = load(
        helpers="""
        import math
        import numpy as np
        import torch
        import torch.nn.functional as F

        def act(x):
            return F.relu(torch.add(x, math.sqrt(4.0))) + float(np.float32(1))
        """
    )
    launch = exec_function(
        "def launch(x):\n    return helpers.act(x) + torch.nn.functional.gelu(x) + math.floor(np.pi)\n",
        helpers=helpers,
        torch=torch,
        math=math,
        np=np,
    )
    snapshot = GlobalsSnapshot(launch)
    readers = {e.reader for e in snapshot.entries}
    assert readers <= {"launch", "act() (called from launch)", ""}
    paths = [e.path for e in snapshot.entries if e.where != "builtin"]
    # the launcher's own globals, the helper, its module globals: nothing inside torch/numpy/math
    assert paths == [
        "helpers",
        "helpers.act",
        "helpers.F",
        "helpers.torch",
        "helpers.math",
        "helpers.np",
        "torch",
        "math",
        "np",
    ]
    for fn in (torch.nn.functional.relu, torch.nn.functional.gelu, np.sum, functools.reduce, math.sqrt, len):
        assert drift._followed_function(fn) is None
    assert all(getattr(fn, "__module__", "") != "torch" for fn in snapshot.namespace.values())
    x = torch.randn(4)
    launch(x)
    torch.manual_seed(1)  # global library state changing: not drift
    snapshot.check()


def test_jit_dispatchers_are_not_followed():
    def launch(x):
        pass

    dispatcher = jc.jit(launch)
    assert drift._followed_function(dispatcher) is None
    outer = exec_function("def region(x):\n    return launch(x)\n", launch=dispatcher)
    assert [e.path for e in GlobalsSnapshot(outer).entries] == ["launch"]
    # a region directly over a launcher snapshots the launcher's globals, not the dispatcher's
    # bookkeeping (which changes with every new key)
    direct = GlobalsSnapshot(jc.jit(reader))
    assert {e.path for e in direct.entries} == {e.path for e in GlobalsSnapshot(reader).entries}


def test_depth_bound_warns_about_what_it_leaves_out(load, monkeypatch):
    monkeypatch.setattr(drift, "MAX_DEPTH", 3)
    chain = (
        "".join(f"def f{i}():\n    return f{i + 1}()\n\n" for i in range(6))
        + "def f6():\n    return LAST\n\nLAST = 1\n"
    )
    (deep,) = load(deep=chain)
    launch = exec_function("def launch():\n    return deep.f0()\n", deep=deep)
    with pytest.warns(RuntimeWarning, match=r"does not cover f3\(\) \(3 calls deep\)"):
        snapshot = GlobalsSnapshot(launch)
    assert snapshot.unchecked == ["f3() (3 calls deep)"]


def test_entry_budget_warns(load, monkeypatch):
    monkeypatch.setattr(drift, "MAX_ENTRIES", 3)
    (cfg,) = load(cfg="A = 1\nB = 2\nC = 3\nD = 4\n")
    launch = exec_function("def launch():\n    return cfg.A + cfg.B + cfg.C + cfg.D\n", cfg=cfg)
    with pytest.warns(RuntimeWarning, match="values beyond the first 3"):
        snapshot = GlobalsSnapshot(launch)
    assert len(snapshot.entries) == 3


def test_builtins_read_by_a_helper_module(load):
    (helpers,) = load(helpers="def f(x):\n    return len(x) + max(x) + min(x) + abs(x[0])\n")
    launch = exec_function("def launch(x):\n    return helpers.f(x)\n", helpers=helpers)
    snapshot = GlobalsSnapshot(launch)
    assert sum("isdisjoint" in line for line in snapshot.check_lines) == 1  # one check for four names
    helpers.min = lambda x: 0
    with pytest.raises(GlobalDriftError, match=r"builtin 'min' read by f\(\) \(called from launch\).*shadows"):
        snapshot.check()


def test_code_reads_finds_chains_and_state():
    def sample():
        global BLOCK
        BLOCK = cfg.a.b + helpers.scale(1)  # noqa: F821
        TABLE["k"] = 1
        SIZES.append(1)
        return [x.y for x in SIZES]

    def assigns():
        cfg.x = 1  # noqa: F821
        cfg.sub.y = 2  # noqa: F821
        cfg.count += 1  # noqa: F821
        return cfg.read  # noqa: F821

    reads = drift.code_reads(sample.__code__)
    assert reads.chains["cfg"] == (("a", "b"),) and reads.chains["helpers"] == (("scale",),)
    assert reads.state == {"BLOCK", "TABLE", "SIZES"}
    assert "cfg" in reads.globals and "x" not in reads.chains
    reads = drift.code_reads(assigns.__code__)
    assert reads.attribute_state == {("cfg", (), "x"), ("cfg", ("sub",), "y"), ("cfg", (), "count")}
    assert reads.chains["cfg"] == (("sub",), ("read",))


def test_jit_launcher_calling_a_helper_raises_on_drift(backend, load):
    (helpers,) = load(helpers=HELPERS)
    axpy = jc.Kernel(AXPY, "axpy")

    @jc.jit
    def launch_axpy(x, y, out, alpha):
        n = x.numel()
        axpy.instantiate(x.dtype)[jc.cdiv(n, helpers.block()), helpers.block()](x, y, out, alpha, n)

    x = torch.randn(1000)
    launch_axpy(x, x, x, 1.0)
    launch_axpy(x, x, x, 1.0)
    assert backend.calls[-1][2] == (256, 1, 1)
    helpers.BLOCK = 128
    message = "global 'helpers.BLOCK' read by block() (called from @jit launch_axpy) changed: it was 256"
    with pytest.raises(GlobalDriftError, match=re.escape(message)):
        launch_axpy(x, x, x, 1.0)  # the hit path
    with pytest.raises(GlobalDriftError, match="'helpers.BLOCK'"):
        launch_axpy(torch.randn(4, 4), x, x, 1.0)  # the miss path
    helpers.BLOCK = 256
    launch_axpy(x, x, x, 1.0)
    assert launch_axpy.cache_info().states == 1


def test_jit_launcher_reading_a_module_attribute(backend, load):
    (cfg,) = load(cfg="BLOCK = 64\n")
    axpy = jc.Kernel(AXPY, "axpy")
    launch = jc.jit(
        exec_function(
            """
            def launch(x, y, out, alpha):
                n = x.numel()
                axpy.instantiate(x.dtype)[jc.cdiv(n, cfg.BLOCK), cfg.BLOCK](x, y, out, alpha, n)
            """,
            jc=jc,
            axpy=axpy,
            cfg=cfg,
        )
    )
    x = torch.randn(100)
    launch(x, x, x, 2.0)
    assert backend.calls[-1][1:3] == ((2, 1, 1), (64, 1, 1))
    cfg.BLOCK = 32
    with pytest.raises(GlobalDriftError, match="module attribute 'cfg.BLOCK' read by @jit launch"):
        launch(x, x, x, 2.0)


def test_a_jit_launchers_drift_error_shows_the_compiled_value_and_the_current_one(backend):
    """Issue 13 item 7, end to end: a dict global mutated in place from {'n': 1} to {'n': 2} is
    reported as it was at compile time and as it is now, on a (guarded) hit and on a miss."""
    cfg = {"n": 1}
    axpy = jc.Kernel(AXPY, "axpy")
    launch = jc.jit(
        exec_function(
            """
            def launch(x, y, out, alpha):
                axpy.instantiate(x.dtype)[cfg["n"], 32](x, y, out, alpha, x.numel())
            """,
            axpy=axpy,
            cfg=cfg,
        )
    )
    x = torch.randn(64)
    launch(x, x, x, 1.0)
    launch(x, x, x, 1.0)  # now the guarded most-recent state
    cfg["n"] = 2
    message = re.escape("global 'cfg' read by @jit launch changed: it was {'n': 1} when first compiled, now {'n': 2}")
    for args in ((x, x, x, 1.0), (torch.randn(8, dtype=torch.float64),) * 3 + (1.0,)):  # a hit, then a miss
        with pytest.raises(GlobalDriftError, match=message):
            launch(*args)
    assert launch.cache_info().compiles == 1


# --- the generated check: through codegen, no user names, containers unrolled --------------------


def closure_over(value):
    def read():
        return value

    return read


class FreezeSpy:
    """Stands in for freeze() in a check's namespace, counting the calls: the unrolled tests
    must decide without it while nothing changed."""

    def __init__(self):
        self.calls = 0

    def __call__(self, value):
        self.calls += 1
        return freeze(value)


def spied(snapshot: GlobalsSnapshot) -> FreezeSpy:
    spy = snapshot.namespace[f"{snapshot.prefix}freeze"] = FreezeSpy()  # the check's globals
    return spy


def test_the_check_names_no_user_global_attribute_or_builtin_and_shows_in_tracebacks():
    settings_module = types.ModuleType("some_user_settings_xyz")
    settings_module.some_user_attribute_xyz = 3
    fn = exec_function(
        """
        def fn():
            return some_user_global_xyz + some_user_settings_xyz.some_user_attribute_xyz + len(some_user_list_xyz)
        """,
        some_user_global_xyz=7,
        some_user_settings_xyz=settings_module,
        some_user_list_xyz=[1, 2],
    )
    snapshot = GlobalsSnapshot(fn)
    source = "".join(linecache.getlines(snapshot.filename))
    assert source == snapshot.source and snapshot.check.__code__.co_filename == snapshot.filename
    for text in (source, "\n".join(snapshot.check_lines)):
        assert "some_user" not in text and "_xyz" not in text
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    assert not [t for t in tokens if t.type == token.STRING]  # no name by repr, not even a builtin's
    snapshot.check()
    fn.__globals__["some_user_global_xyz"] = 8
    with pytest.raises(GlobalDriftError, match="global 'some_user_global_xyz' read by") as info:
        snapshot.check()
    generated = [frame for frame in traceback.extract_tb(info.tb) if frame.filename == snapshot.filename]
    assert generated and "drift(" in generated[-1].line


def test_a_jit_dispatcher_inlines_the_check_without_user_names(backend):
    axpy = jc.Kernel(AXPY, "axpy")
    table = {"n": 1}
    source = """
        def launch(x, y, out, alpha):
            axpy.instantiate(x.dtype)[some_user_table_xyz["n"], 32](x, y, out, alpha, x.numel())
    """
    launch = jc.jit(exec_function(source, axpy=axpy, some_user_table_xyz=table))
    x = torch.randn(64)
    launch(x, x, x, 1.0)
    launch(x, x, x, 1.0)
    assert "_dv" in launch.jit.source and "some_user" not in launch.jit.source
    table["n"] = 2
    with pytest.raises(GlobalDriftError, match="global 'some_user_table_xyz'") as info:
        launch(x, x, x, 1.0)
    assert any(
        frame.filename == launch.jit.filename and "drift(" in frame.line for frame in traceback.extract_tb(info.tb)
    )


class Unequal(int):
    def __eq__(self, other):
        raise ValueError("no comparing")

    __hash__ = int.__hash__


def test_an_exception_inside_the_check_shows_the_generated_line():
    fn = closure_over({"a": Unequal(1)})
    snapshot = GlobalsSnapshot(fn)
    snapshot.check()
    fn.__closure__[0].cell_contents = {"a": Unequal(1)}  # another object of the same class: compared
    with pytest.raises(ValueError, match="no comparing") as info:
        snapshot.check()
    frames = [frame for frame in traceback.extract_tb(info.tb) if frame.filename == snapshot.filename]
    assert frames and "==" in frames[0].line


def test_containers_of_tensors_are_checked_without_freezing():
    weights, biases = [torch.zeros(1) for _ in range(6)], [torch.ones(1) for _ in range(6)]

    def fn():
        return weights[0] + biases[0]

    snapshot = GlobalsSnapshot(fn, prefix="_r")
    assert not any("freeze(_rcell" in line for line in snapshot.check_lines)  # unrolled, not frozen
    spy = spied(snapshot)
    for _ in range(3):
        snapshot.check()
    assert spy.calls == 0
    original = weights[2]
    weights[2] = torch.zeros(1)  # same values, another tensor
    with pytest.raises(GlobalDriftError, match="closure 'weights'.*it was .*tensor"):
        snapshot.check()
    weights[2] = original
    snapshot.check()


@pytest.mark.parametrize(
    "new",
    [3, None, [], (1,), "ab", {"a": 1}, {1, 2}],
    ids=["int", "None", "empty", "tuple", "str", "dict", "set"],
)
def test_a_container_that_became_something_else_is_drift_naming_both(new):
    items = [torch.zeros(1), 2.5, {"k": (1, 2)}]
    fn = closure_over(items)
    snapshot = GlobalsSnapshot(fn)
    fn.__closure__[0].cell_contents = new
    with pytest.raises(GlobalDriftError) as info:
        snapshot.check()
    message = str(info.value)
    assert "it was [tensor([0.]), 2.5, {'k': (1, 2)}] when first compiled" in message
    assert f"now {drift._short.repr(new)};" in message


class Backwards(tuple):
    def __iter__(self):
        return reversed(tuple(tuple.__iter__(self)))


def test_sets_large_containers_and_their_own_iteration_are_compared_frozen():
    for value in ({1, 2}, [{1}], list(range(drift.MAX_UNROLLED)), {"a": frozenset()}, [Backwards((1, 2))]):
        snapshot = GlobalsSnapshot(closure_over(value))
        assert any(line.startswith("if _freeze(_cell") for line in snapshot.check_lines)
        snapshot.check()
    snapshot = GlobalsSnapshot(closure_over(list(range(drift.MAX_UNROLLED - 1))))  # the list and its items
    assert not any(line.startswith("if _freeze(") for line in snapshot.check_lines)


class Pair(collections.namedtuple("Pair", "first second")):
    __slots__ = ()


class Color(enum.IntEnum):
    RED = 1
    GREEN = 2


POOL = [torch.zeros(1), torch.zeros(1), object(), np.float64(1.0), Color.RED, Color.GREEN, torch.float32]
SCALARS = st.one_of(
    st.integers(-2, 2),
    st.integers(2**70, 2**70 + 2),  # big: an equal int is another object
    st.floats(allow_nan=True, allow_infinity=True, width=16),
    st.sampled_from([0.0, -0.0, math.nan, 1.0]),
    st.booleans(),
    st.none(),
    st.text(max_size=2),
    st.binary(max_size=1),
    st.complex_numbers(max_magnitude=2, allow_nan=False, allow_infinity=False),
    st.sampled_from(POOL),
)
KEYS = st.one_of(
    st.integers(-2, 2), st.booleans(), st.none(), st.text(max_size=2), st.sampled_from([0.0, -0.0, 1.0, Color.RED])
)


SETS = st.one_of(st.sets(KEYS, max_size=2), st.frozensets(KEYS, max_size=2))


def containers(children):
    lists = st.lists(children, max_size=4)
    pairs = st.tuples(children, children).map(lambda items: Pair(*items))
    return st.one_of(lists, lists.map(tuple), pairs, st.dictionaries(KEYS, children, max_size=3))


VALUES = st.recursive(SCALARS, containers, max_leaves=16)
# a set anywhere is compared frozen: a few of those, mostly containers the check unrolls
TOP = st.one_of(*[containers(VALUES)] * 4, SETS, st.lists(st.one_of(VALUES, SETS), max_size=3))


def fresh(value):
    """An equal value that is another object (where Python makes one)."""
    if type(value) is float:
        return struct.unpack("<d", struct.pack("<d", value))[0]
    if type(value) is int:
        return int(str(value))
    if type(value) is str:
        return "".join(list(value)) + ""
    return value


def twin(value):
    """A value that == compares equal to ``value`` (or nearly), of another type or sign."""
    if isinstance(value, bool):
        return int(value)
    if type(value) is int:
        return float(value) if value not in (0, 1) else bool(value)
    if type(value) is float:
        return -value if value == 0 else (int(value) if value.is_integer() else fresh(value))
    if isinstance(value, Color):
        return int(value)
    return value


def mutated(draw, value, top=False):
    """``value`` changed in one of the ways drift checks must tell apart (or not): the same
    object, an equal copy, an equal twin of another type, a container rebuilt with mutated
    items, reordered, shortened, grown, or turned into another kind of container."""
    ways = (
        ["rebuild", "rebuild", "reshape", "other"] if top else ["same", "fresh", "twin", "other", "rebuild", "reshape"]
    )
    how = draw(st.sampled_from(ways))
    if how == "same":
        return value
    if how == "fresh":
        return fresh(value)
    if how == "twin":
        return twin(value)
    if how == "other":
        return draw(VALUES)
    if isinstance(value, dict):
        items = [(key if draw(st.booleans()) else twin(key), mutated(draw, item)) for key, item in value.items()]
        if how == "reshape":
            items = draw(st.sampled_from([items[::-1], items[1:], items + [("new", 1)]]))
        return dict(items)
    if isinstance(value, (list, tuple)):
        items = [mutated(draw, item) for item in value]
        if how == "reshape":
            items = draw(st.sampled_from([items[::-1], items[:-1], items + [items[0] if items else 0]]))
            kind = draw(st.sampled_from([list, tuple, Pair] if len(items) == 2 else [list, tuple]))
            return kind(*items) if kind is Pair else kind(items)
        return Pair(*items) if type(value) is Pair else type(value)(items)
    if isinstance(value, (set, frozenset)):
        return type(value)(twin(item) for item in value) if how == "rebuild" else set(value) ^ {draw(KEYS)}
    return value


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(original=TOP, data=st.data(), in_place=st.booleans(), prefix=st.sampled_from(["_", "_r", "_d"]))
def test_unrolled_checks_mean_exactly_what_comparing_frozen_copies_means(original, data, in_place, prefix):
    fn = closure_over(original)
    snapshot = GlobalsSnapshot(fn, prefix=prefix)
    frozen = freeze(original)
    unrolled = any(line == "if not (" for line in snapshot.check_lines)
    spy = spied(snapshot)
    snapshot.check()
    assert spy.calls == (0 if unrolled else 1)
    current = mutated(data.draw, original, top=True)
    if in_place and current is not original and type(current) is type(original) and type(original) in (list, dict):
        original.clear()  # mutated in place: the cell still holds the same object
        (original.update if isinstance(original, dict) else original.extend)(current)
        current = original
    fn.__closure__[0].cell_contents = current
    spy.calls = 0
    if freeze(current) != frozen:
        with pytest.raises(
            GlobalDriftError,
            match=f"closure 'value' read by .* changed: it was {re.escape(drift._short.repr(thaw(frozen)))} when",
        ):
            snapshot.check()
    else:
        snapshot.check()
        assert spy.calls == (0 if unrolled else 1)  # the unrolled tests alone accept every unchanged value


# --- floats by their bits, as Constexpr keys compare them ---------------------------------------
SHIFT = 0.0
SHIFTS = [0.0, 1.5]
NAN_PAYLOAD = struct.unpack("<d", bytes.fromhex("010000000000f87f"))[0]


def shift_reader():
    return SHIFT + SHIFTS[0]


FLOAT_REBINDINGS = [
    (0.0, -0.0, True),
    (-0.0, 0.0, True),
    (0.0, struct.unpack("<d", struct.pack("<d", 0.0))[0], False),  # another object, same bits
    (math.nan, struct.unpack("<d", struct.pack("<d", math.nan))[0], False),  # a NaN of the same bits
    (math.nan, NAN_PAYLOAD, True),  # another NaN payload
    (complex(0.0, 0.0), complex(0.0, -0.0), True),
    (np.float64(0.0), np.float64(-0.0), True),
]


@pytest.mark.parametrize("old, new, drifts", FLOAT_REBINDINGS)
def test_a_float_global_is_compared_by_its_bits(monkeypatch, old, new, drifts):
    monkeypatch.setitem(globals(), "SHIFT", old)
    snapshot = GlobalsSnapshot(shift_reader)
    monkeypatch.setitem(globals(), "SHIFT", new)
    if drifts:
        with pytest.raises(GlobalDriftError, match="global 'SHIFT' read by .* changed"):
            snapshot.check()
    else:
        snapshot.check()


@pytest.mark.parametrize("old, new, drifts", FLOAT_REBINDINGS)
@pytest.mark.parametrize("size", [2, drift.MAX_UNROLLED + 1])  # the unrolled tests, then the frozen copies
def test_a_float_in_a_container_is_compared_by_its_bits(monkeypatch, old, new, drifts, size):
    values = [old] + [1.5] * (size - 1)
    monkeypatch.setitem(globals(), "SHIFTS", values)
    snapshot = GlobalsSnapshot(shift_reader)
    assert (size <= drift.MAX_UNROLLED) == any(line == "if not (" for line in snapshot.check_lines)
    snapshot.check()
    values[0] = new  # in place
    if drifts:
        with pytest.raises(GlobalDriftError, match="global 'SHIFTS' read by .* changed"):
            snapshot.check()
    else:
        snapshot.check()
    assert thaw(freeze(values)) == values or math.isnan(new)


def test_a_float_global_rebound_to_negative_zero_is_drift_for_a_launcher(monkeypatch):
    from .fakes import track_layouts

    backend = CountingBackend()
    kernel = jc.Kernel("__global__ void k(float v) {}", "k")

    @jc.jit
    def launch():
        kernel[1, 1](SHIFT)

    with use_backend(backend):
        track_layouts(backend, kernel.instantiate())
        launch()
        assert backend.calls[-1][7] == (struct.pack("<f", 0.0),)
        monkeypatch.setitem(globals(), "SHIFT", -0.0)
        with pytest.raises(GlobalDriftError, match="global 'SHIFT'.*it was 0.0 when first compiled, now -0.0"):
            launch()
    assert len(backend.calls) == 1


_HELD_ROW = None  # set by the test below (a module global a helper reads)


def test_the_snapshots_tensors_are_every_tensor_the_code_reaches_by_name():
    """Globals, closure values, module attributes and helpers' globals, and the tensors inside
    the lists, tuples, sets and dicts they hold (nested): replay compares its arguments with
    them. Numbers, strings and builtins are not tensors; a tensor nobody reads by name is not
    among them."""
    import torch

    from jitcore.drift import GlobalsSnapshot

    global _HELD_ROW
    table, nested, unread = torch.randn(3), torch.randn(2), torch.randn(5)
    _HELD_ROW = torch.randn(4)
    caches = [torch.randn(1), {"k": (nested, 3)}, "text"]

    def helper(x):
        return x + _HELD_ROW

    def region(x):
        return helper(x) + table + caches[0] + len(caches)

    found = GlobalsSnapshot(region).tensors_by_name()
    held = {id(t) for t in found.tensors}
    assert held == {id(table), id(_HELD_ROW), id(caches[0]), id(nested)} and found.complete
    assert id(unread) not in held


_WIDE: list = []


def test_a_tensor_search_cut_short_by_its_bound_says_so(monkeypatch):
    """The search looks at a bounded number of values, the containers and their items alike;
    where values are left unread when it stops, a tensor may be among them, so the answer is
    marked incomplete (replay then doubts every argument) rather than taken as all there is."""
    import torch

    from jitcore import drift
    from jitcore.drift import GlobalsSnapshot

    monkeypatch.setattr(drift, "_TENSOR_SEARCH_LIMIT", 6)
    weight = torch.randn(2)

    def region(x):
        return x + len(_WIDE) + weight

    _WIDE[:] = [1, 2, 3, 4]  # the closure tensor, the list and its 4 items: 6 values, all read
    found = GlobalsSnapshot(region).tensors_by_name()
    assert found.complete and [id(t) for t in found.tensors] == [id(weight)]
    _WIDE[:] = [1, 2, 3, 4, torch.randn(1)]  # 7 values: one is left unread
    found = GlobalsSnapshot(region).tensors_by_name()
    assert not found.complete
    monkeypatch.setattr(drift, "_TENSOR_SEARCH_LIMIT", 7)
    assert GlobalsSnapshot(region).tensors_by_name().complete
