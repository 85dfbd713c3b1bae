"""Globals drift: identity fast path, rebinding, in-place mutation, closures, builtins, and the
reads followed beyond the function: helpers' globals, module attributes."""

from __future__ import annotations

import collections
import functools
import math
import re
import textwrap
import types

import numpy as np
import pytest
import torch

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
