"""Globals drift: identity fast path, rebinding, in-place mutation, closures, builtins."""

from __future__ import annotations

import math

import pytest

from jitcore.drift import GlobalsSnapshot, global_names
from jitcore.errors import GlobalDriftError

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
    assert any(entry[3] is held for entry in snapshot.entries)


def test_prefix_keeps_names_apart():
    snapshot = GlobalsSnapshot(reader, prefix="_zz")
    assert all(name.startswith("_zz") for name in snapshot.namespace if name not in ("check", "__builtins__"))
