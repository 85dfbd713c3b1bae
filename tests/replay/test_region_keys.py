"""Region keys: structure plus shape-exact leaf signatures; flatten and unflatten agree."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import decimal
import enum
import fractions
import functools
import itertools
import os
import struct
import subprocess
import sys
import typing
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import replay
from jitcore import torch_native
from replay import dynamic, region_keys
from replay.region_keys import FLAT, extent_bytes, flatten, leaf_key, plain_leaves, region_key, unflatten

Pair = collections.namedtuple("Pair", "a b")


def key_of(*args, **kwargs):
    spec, leaves, paths = flatten(args, kwargs)
    return region_key(0, spec, leaves, paths)


def test_flat_calls_take_the_short_path():
    x = torch.randn(3)
    spec, leaves, paths = flatten((x, 1, dynamic(2)), {})
    assert spec == (FLAT, 3) and leaves[0] is x and paths == ["args[0]", "args[1]", "args[2]"]
    assert unflatten(spec, leaves) == (tuple(leaves), {})


def test_nested_round_trip():
    x, y = torch.randn(2), torch.randn(3)
    args = ([x, (y, 3)], {"kv": y, "n": 4}, Pair(x, 5))
    kwargs = {"flag": True, "cache": [y]}
    spec, leaves, paths = flatten(args, kwargs)
    assert len(leaves) == 9
    assert "args[1]['kv']" in paths and "cache[0]" in paths
    rebuilt_args, rebuilt_kwargs = unflatten(spec, leaves)
    assert isinstance(rebuilt_args[2], Pair)
    assert rebuilt_args[0][1][0] is y and rebuilt_kwargs["cache"][0] is y and rebuilt_kwargs["flag"] is True


def test_keys_are_shape_exact_and_stride_exact():
    x = torch.randn(4, 6)
    assert key_of(x) == key_of(torch.randn(4, 6))
    assert key_of(x) != key_of(torch.randn(4, 7))
    assert key_of(x) != key_of(torch.randn(6, 4).t())
    assert key_of(x) != key_of(x.double())
    assert key_of(x) != key_of([x])  # the structure is part of the key


def test_dynamic_scalars_by_type_constants_by_value():
    x = torch.randn(2)
    assert key_of(x, dynamic(3)) == key_of(x, dynamic(7))
    assert key_of(x, dynamic(3)) != key_of(x, dynamic(3.0))
    assert key_of(x, 3) != key_of(x, 4)
    assert key_of(x, 1) != key_of(x, True)
    assert plain_leaves([dynamic(3), 4]) == [3, 4]


def test_unhashable_leaves_are_a_clear_error():
    with pytest.raises(TypeError, match=r"args\[1\] is an unhashable set"):
        key_of(torch.randn(2), {1, 2})


def test_refused_tensors_are_refused_in_keys_too():
    import jitcore

    with pytest.raises(jitcore.UnsupportedTensorError):
        leaf_key(torch.randn(3, dtype=torch.complex64).conj(), "args[0]")


def test_extent():
    assert extent_bytes(torch.empty(4, 6)) == 96
    assert extent_bytes(torch.empty(4, 6)[:, :2]) == (3 * 6 + 1 + 1) * 4
    assert extent_bytes(torch.empty(1, 5).expand(3, 5)) == 20
    assert extent_bytes(torch.empty(0, 5)) == 0


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 4), min_size=0, max_size=4),
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.int64, torch.uint8]),
)
def test_extent_of_any_layout_is_one_past_its_furthest_element(sizes, data, dtype):
    # contiguous tensors take a shortcut (numel * element size); every layout must agree with
    # the furthest element any index reaches, found by brute force over every index
    strides = data.draw(st.lists(st.integers(0, 6), min_size=len(sizes), max_size=len(sizes)), label="strides")
    if data.draw(st.booleans(), label="contiguous"):
        tensor = torch.empty(sizes, dtype=dtype)
    else:
        tensor = torch.empty(200, dtype=dtype).as_strided(sizes, strides)
    if tensor.numel() == 0:
        expected = 0
    else:
        furthest = max(
            sum(i * s for i, s in zip(index, tensor.stride()))
            for index in itertools.product(*(range(n) for n in tensor.shape))
        )
        expected = (furthest + 1) * tensor.element_size()
    assert extent_bytes(tensor) == expected


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_alias_pattern_shortcut_equals_the_exact_ranges(data):
    # views of two storages, and a storage aliased by another (a DLPack re-export): the
    # shortcut for disjoint storages must never hide an overlap
    base, other = torch.arange(64.0), torch.arange(32.0)
    aliased = torch.from_dlpack(base[8:40])  # a second storage over part of base's bytes
    sources = [base, other, aliased]
    leaves = []
    for _ in range(data.draw(st.integers(2, 5))):
        source = sources[data.draw(st.integers(0, 2))]
        start = data.draw(st.integers(0, source.numel() - 1))
        stop = data.draw(st.integers(start, source.numel()))
        step = data.draw(st.integers(1, 3))
        leaves.append(source[start:stop:step])
    assert region_keys.alias_pattern(leaves) == region_keys.pattern_of(region_keys.tensor_ranges(leaves))


# --- torch modes: every setting read by the key is seen by replay's per-call check -------------
def _flipped(getter, setter, other=lambda value: not value):
    """A context that sets a global torch setting to another value and restores it."""

    @contextlib.contextmanager
    def change():
        before = getter()
        try:
            setter(other(before))  # may fail half-way (torch sets the linalg backend, then raises)
            yield
        finally:
            setter(before)

    return change


_C = torch._C
_matmul = torch.backends.cuda.matmul
_BLAS = getattr(_C, "_BlasBackend", None)
_LINALG = getattr(_C, "_LinalgBackend", None)
#: For each setting the key holds, a context that changes it (explicit: a new reader needs one).
MODE_CHANGES = {
    "grad mode": torch.no_grad,
    "inference mode": torch.inference_mode,
    "autocast (cuda)": lambda: torch.autocast("cuda", dtype=torch.float16),
    "autocast dtype (cuda)": _flipped(
        lambda: torch.get_autocast_dtype("cuda"),
        lambda d: torch.set_autocast_dtype("cuda", d),
        lambda d: torch.bfloat16 if d != torch.bfloat16 else torch.float16,
    ),
    "autocast (cpu)": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "autocast dtype (cpu)": _flipped(
        lambda: torch.get_autocast_dtype("cpu"),
        lambda d: torch.set_autocast_dtype("cpu", d),
        lambda d: torch.float16 if d != torch.float16 else torch.bfloat16,
    ),
    "autocast cache": _flipped(torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled),
    "default dtype": _flipped(
        torch.get_default_dtype,
        torch.set_default_dtype,
        lambda d: torch.float64 if d != torch.float64 else torch.float32,
    ),
    "deterministic algorithms": _flipped(
        torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms
    ),
    "deterministic algorithms (warn only)": _flipped(
        _C._get_deterministic_algorithms_warn_only,
        lambda v: _C._set_deterministic_algorithms(_C._get_deterministic_algorithms(), warn_only=v),
    ),
    "float32 matmul precision": _flipped(
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
        lambda p: "medium" if p != "medium" else "highest",
    ),
    "cuBLAS TF32": _flipped(_C._get_cublas_allow_tf32, _C._set_cublas_allow_tf32),
    "cuBLAS fp16 reduced precision": _flipped(
        lambda: _matmul.allow_fp16_reduced_precision_reduction,
        lambda v: setattr(_matmul, "allow_fp16_reduced_precision_reduction", v),
    ),
    "cuBLAS bf16 reduced precision": _flipped(
        lambda: _matmul.allow_bf16_reduced_precision_reduction,
        lambda v: setattr(_matmul, "allow_bf16_reduced_precision_reduction", v),
    ),
    "cuBLAS fp16 accumulation": _flipped(
        lambda: _matmul.allow_fp16_accumulation, lambda v: setattr(_matmul, "allow_fp16_accumulation", v)
    ),
    "cuDNN TF32": _flipped(_C._get_cudnn_allow_tf32, _C._set_cudnn_allow_tf32),
    "cuDNN enabled": _flipped(_C._get_cudnn_enabled, _C._set_cudnn_enabled),
    "cuDNN benchmark": _flipped(_C._get_cudnn_benchmark, _C._set_cudnn_benchmark),
    "cuDNN deterministic": _flipped(_C._get_cudnn_deterministic, _C._set_cudnn_deterministic),
    "SDPA flash": _flipped(_C._get_flash_sdp_enabled, _C._set_sdp_use_flash),
    "SDPA memory-efficient": _flipped(_C._get_mem_efficient_sdp_enabled, _C._set_sdp_use_mem_efficient),
    "SDPA math": _flipped(_C._get_math_sdp_enabled, _C._set_sdp_use_math),
    "SDPA cuDNN": _flipped(_C._get_cudnn_sdp_enabled, _C._set_sdp_use_cudnn),
    "SDPA math fp16/bf16 reduction": _flipped(
        _C._get_math_sdp_allow_fp16_bf16_reduction, _C._set_math_sdp_allow_fp16_bf16_reduction
    ),
    "SDPA priority order": _flipped(
        _C._get_sdp_priority_order, _C._set_sdp_priority_order, lambda order: list(reversed(order))
    ),
    "preferred BLAS library": _flipped(
        _C._get_blas_preferred_backend,
        _C._set_blas_preferred_backend,
        lambda b: next(m for m in _BLAS.__members__.values() if m != b),
    ),
    "preferred linalg library": _flipped(
        _C._get_linalg_preferred_backend,
        _C._set_linalg_preferred_backend,
        lambda b: next(m for m in _LINALG.__members__.values() if m != b),
    ),
}


@contextlib.contextmanager
def _fp32_precisions_kept():
    """Puts every per-backend float32 precision back afterwards: a legacy TF32 setter writes
    them, and setting it back writes "ieee" where "none" was."""
    if region_keys._FP32_PRECISION is None:
        yield
        return
    get, put = _C._get_fp32_precision_getter, _C._set_fp32_precision_setter
    before = []
    for pair in itertools.product(("generic", "cuda", "mkldnn"), ("all", "matmul", "conv", "rnn")):
        with contextlib.suppress(RuntimeError, ValueError, TypeError):  # a pair this torch lacks
            before.append((pair, get(*pair)))
    try:
        yield
    finally:
        for pair, value in sorted(before, key=lambda entry: entry[0][1] != "all"):  # parents first
            put(*pair, value)


def _fp32_precision_change(backend: str, op: str):
    """A context that sets one of torch's per-backend float32 precisions (torch >= 2.9) to
    another value and restores them all: a setter also changes the precisions below it
    (generic "all" every backend's), so each is put back, parents first."""

    @contextlib.contextmanager
    def change():
        get, put = _C._get_fp32_precision_getter, _C._set_fp32_precision_setter
        with _fp32_precisions_kept():
            put(backend, op, "ieee" if get(backend, op) != "ieee" else "tf32")
            yield

    return change


if region_keys._FP32_PRECISION is not None:
    MODE_CHANGES.update(
        {f"fp32 precision ({b} {op})": _fp32_precision_change(b, op) for b, op in region_keys._FP32_PRECISIONS}
    )
_ROCM_FA = getattr(_C, "_ROCmFABackend", None)
#: Settings of newer torches (each where this torch has its getter and setter).
for _name, _getter, _setter, _other in (
    ("deterministic fill of uninitialized memory", "_get_deterministic_fill_uninitialized_memory",
     "_set_deterministic_fill_uninitialized_memory", lambda v: not v),
    ("cuDNN depthwise kernel", "_get_cudnn_depthwise_kernel", "_set_cudnn_depthwise_kernel",
     lambda k: "native" if k != "native" else "cudnn"),
    ("SDPA FlashAttention-3", "_get_fa3_sdp_enabled", "_set_sdp_use_fa3", lambda v: not v),
    ("preferred ROCm flash-attention library", "_get_rocm_fa_preferred_backend", "_set_rocm_fa_preferred_backend",
     lambda b: next(m for m in _ROCM_FA.__members__.values() if m != b)),
):  # fmt: skip
    if hasattr(_C, _getter) and hasattr(_C, _setter):
        MODE_CHANGES[_name] = _flipped(getattr(_C, _getter), getattr(_C, _setter), _other)


def test_every_mode_the_key_holds_has_a_change_in_this_test():
    assert set(region_keys.MODE_NAMES) <= set(MODE_CHANGES)


#: Settings that change nothing while autocast is off: the replay check ignores them then.
AUTOCAST_ONLY = {"autocast dtype (cuda)", "autocast dtype (cpu)", "autocast cache"}


def test_the_check_kind_is_the_one_asked_for(checks_kind):
    changed = region_keys.modes_changed(region_keys.torch_modes())
    kind = {"SettingsCheck": "c", "function": "python", "builtin_function_or_method": "watch"}
    assert kind[type(changed).__name__] == checks_kind


@pytest.mark.parametrize("name", region_keys.MODE_NAMES)
def test_every_mode_the_key_holds_is_seen_by_the_replay_check(name, checks_kind):
    """Change one setting: the key's tuple changes and the generated per-call check says so
    (the autocast dtypes and cache only while autocast is on: see the next test); back: the
    check passes again."""
    number = region_keys.MODE_NAMES.index(name)
    recorded = region_keys.torch_modes()
    changed = region_keys.modes_changed(recorded)
    autocast_off = not torch.is_autocast_enabled("cuda") and not torch.is_autocast_enabled("cpu")
    assert changed() is False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecations (MAGMA), CPU autocast dtypes
            with MODE_CHANGES[name]():
                now = region_keys.torch_modes()
                if now == recorded:
                    pytest.skip(f"this torch build cannot change {name}")
                assert now[number] != recorded[number]
                assert changed() is not (name in AUTOCAST_ONLY and autocast_off)
    except RuntimeError as error:  # a backend this torch build lacks (cuBLASLt on a CPU build)
        if "compiled with" not in str(error) and "not available" not in str(error):
            raise
        if region_keys.torch_modes() == recorded:
            pytest.skip(f"this torch build cannot change {name}: {error}")
    assert region_keys.torch_modes() == recorded
    assert changed() is False


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_autocast_dtype_and_cache_count_while_autocast_is_on(device, checks_kind):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("autocast for CUDA needs a GPU")
    dtypes = (torch.bfloat16, torch.float16)
    with torch.autocast(device, dtype=dtypes[0]):
        recorded = region_keys.torch_modes()
        changed = region_keys.modes_changed(recorded)
        assert changed() is False
        before = torch.get_autocast_dtype(device)
        torch.set_autocast_dtype(device, dtypes[1])
        try:
            assert changed() is True
        finally:
            torch.set_autocast_dtype(device, before)
        assert changed() is False
        torch.set_autocast_cache_enabled(not torch.is_autocast_cache_enabled())
        try:
            assert changed() is True
        finally:
            torch.set_autocast_cache_enabled(not torch.is_autocast_cache_enabled())
        assert changed() is False
    assert changed() is True  # autocast off again: another setting than recorded


def test_with_autocast_off_one_call_checks_it_for_every_device(checks_kind):
    recorded = region_keys.torch_modes()
    tests = region_keys._mode_tests(recorded)
    assert tests[0].getter == "_is_any_autocast_enabled"
    assert not {"is_autocast_enabled", "get_autocast_dtype", "is_autocast_cache_enabled"} & {t.getter for t in tests}
    changed = region_keys.modes_changed(recorded)
    if checks_kind == "c":
        assert changed.readers[0] is region_keys._any_autocast and changed.arguments[0] == ()
        autocast_readers = {torch._C.is_autocast_enabled, getattr(torch._C, "get_autocast_dtype", None)}
        assert not any(reader in autocast_readers for reader in changed.readers)  # per-device settings
    elif checks_kind == "python":
        source = "".join(__import__("linecache").getlines(changed.__code__.co_filename))
        lines = source.splitlines()
        first_test = lines[lines.index("        return (") + 1]  # the first setting the check reads
        assert "_any_autocast() is not _v0" in first_test
        autocast_cuda = region_keys._MODE_READERS[region_keys.MODE_NAMES.index("autocast (cuda)")].function
        assert autocast_cuda not in changed.__globals__.values()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert changed() is True


# --- torch settings read in C++: the torch-side helper's settings watch ------------------------
def _covered_readers(helper) -> list[tuple[str, object]]:
    """(name, a reader) for every per-replay reading the helper's state covers on this torch."""
    covered = set(helper.SETTINGS_COVERED)
    readers = [(r.what, r.read) for r in region_keys._MODE_READERS if (r.getter, r.args) in covered]
    if ("_is_any_autocast_enabled", ()) in covered and region_keys._any_autocast is not None:
        readers.append(("any autocast", region_keys._any_autocast))
    return readers


def _entered(name) -> contextlib.ExitStack | None:
    """MODE_CHANGES[name] entered (as a context to exit), or None where this torch build cannot
    make that change."""
    stack = contextlib.ExitStack()
    stack.enter_context(_fp32_precisions_kept())
    try:
        stack.enter_context(MODE_CHANGES[name]())
    except RuntimeError as error:
        stack.close()
        # a backend this torch build lacks (cuBLASLt on a CPU build); a legacy TF32 getter
        # after the per-backend precisions were set (torch 2.9 to 2.11 refuse to answer then)
        if not any(reason in str(error) for reason in ("compiled with", "not available", "legacy and new APIs")):
            raise
        return None
    return stack


@pytest.mark.parametrize("name", sorted(MODE_CHANGES))
def test_the_helpers_state_moves_with_every_setting_it_covers(name, torch_native_helper):
    """The watch's soundness: whatever changes a reading the state covers (each setting the
    key holds, and the legacy TF32 setters that write the per-backend precisions) changes
    the state read in C++, and putting it back puts the state back."""
    readers = _covered_readers(torch_native_helper)
    assert len(readers) >= 25  # the torches tested cover (nearly) every setting
    state = torch_native_helper.settings_state
    before, values = state(), [read() for _, read in readers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecations (MAGMA), CPU autocast dtypes
        change = _entered(name)
        if change is None:
            pytest.skip(f"this torch build cannot change {name}")
        try:
            moved = [what for (what, read), value in zip(readers, values) if read() != value]
            if not moved:
                pytest.skip(f"{name} changes no reading the state covers on this torch")
            assert state() != before, f"{name} changed {moved} but not the state read in C++"
        finally:
            change.__exit__(None, None, None)
    assert [read() for _, read in readers] == values
    assert state() == before


def test_a_watch_runs_the_full_check_whenever_its_state_moved(torch_native_helper):
    """settings_watch(exact, residual): the full check until it says "unchanged", then only
    the residual while the state stays; any other state runs the full check again, and
    becomes the reference only where the full check says "unchanged"."""
    calls, answer = [], [False]

    def exact():
        calls.append("exact")
        return answer[0]

    def residual():
        calls.append("residual")
        return False

    watch = torch_native_helper.settings_watch(exact, residual)
    assert watch() is False and calls == ["exact"]
    assert watch() is False and watch() is False and calls == ["exact", "residual", "residual"]
    calls.clear()
    with torch.no_grad():  # another state: the full check decides
        answer[0] = True
        assert watch() is True and watch() is True and calls == ["exact", "exact"]
        answer[0] = False
        assert watch() is False and watch() is False and calls == ["exact", "exact", "exact", "residual"]
    calls.clear()
    assert watch() is False and calls == ["exact"]  # grad mode again: not the reference now
    without_residual = torch_native_helper.settings_watch(exact, None)
    calls.clear()
    assert without_residual() is False and without_residual() is False and calls == ["exact"]


def test_a_watch_passes_its_checks_errors_and_refuses_bad_arguments(torch_native_helper):
    def broken():
        raise ValueError("cannot say")

    watch = torch_native_helper.settings_watch(broken, None)
    with pytest.raises(ValueError, match="cannot say"):
        watch()
    with pytest.raises(ValueError, match="cannot say"):
        watch()  # never armed by an error
    with pytest.raises(TypeError, match="no arguments"):
        watch(1)
    with pytest.raises(TypeError, match="exact callable"):
        torch_native_helper.settings_watch(1, None)
    with pytest.raises(TypeError, match="residual callable or None"):
        torch_native_helper.settings_watch(broken, 2)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_watch_answers_as_the_full_check_through_any_sequence_of_changes(torch_native_helper, monkeypatch, data):
    """Settings changed and put back in any order, nested: after every step the replay check
    made with the helper answers what the full (generated) check answers."""
    monkeypatch.setattr(region_keys, "_modes_changed_cache", {})
    recorded = region_keys.torch_modes()
    with torch_native.using(torch_native_helper):
        watch = region_keys.modes_changed(recorded)
    assert type(watch).__name__ == "builtin_function_or_method"
    full = region_keys.modes_changed(recorded, compiled=False)
    names = sorted(MODE_CHANGES)
    entered = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            for _ in range(data.draw(st.integers(1, 10), label="steps")):
                if entered and data.draw(st.booleans(), label="put one back"):
                    entered.pop().__exit__(None, None, None)
                else:
                    change = _entered(data.draw(st.sampled_from(names), label="change"))
                    if change is not None:
                        entered.append(change)
                expected = full()
                assert watch() is expected and watch() is expected
        finally:
            while entered:
                entered.pop().__exit__(None, None, None)
    assert watch() is False and full() is False


def test_the_c_check_makes_the_same_calls_and_comparisons():
    """replay._checks.SettingsCheck on its own: identity, equality and enum-value comparisons,
    the first difference ends it (later readers are not called), readers get their
    arguments, a reader's exception comes out, and bad construction is refused."""
    if region_keys._SettingsCheck is None:
        pytest.skip("replay._checks is not built here")
    check_type = region_keys._SettingsCheck
    calls = []

    def reader(value):
        def read(*args):
            calls.append(args)
            return value

        return read

    class Enum:
        def __init__(self, value):
            self.value = value

    same = check_type((reader(True), reader("x"), reader(Enum(3))), ((), (1, 2), ()), (True, "x", 3), "iev")
    assert same() is False and calls == [(), (1, 2), ()]
    calls.clear()
    for position, readers in enumerate(
        [
            (reader(False), reader("x"), reader(Enum(3))),
            (reader(True), reader("y"), reader(Enum(3))),
            (reader(True), reader("x"), reader(Enum(4))),
        ]
    ):
        assert check_type(readers, ((), (1, 2), ()), (True, "x", 3), "iev")() is True
        assert len(calls) == position + 1  # stopped at the difference
        calls.clear()
    assert check_type((reader([1, 2]),), ((),), ([1, 2],), "e")() is False
    assert check_type((reader([1, 2]),), ((),), ([1, 3],), "e")() is True
    half = 0.5
    assert check_type((reader(half),), ((),), (half,), "i")() is False
    assert check_type((reader(half),), ((),), (float("0.5"),), "i")() is True  # identity: another object

    def broken():
        raise RuntimeError("no reading")

    with pytest.raises(RuntimeError, match="no reading"):
        check_type((broken,), ((),), (True,), "i")()
    with pytest.raises(AttributeError):
        check_type((reader(5),), ((),), (5,), "v")()  # an int has no .value
    with pytest.raises(ValueError, match="one entry per setting"):
        check_type((reader(1),), ((), ()), (1,), "i")
    with pytest.raises(ValueError, match="ways"):
        check_type((reader(1),), ((),), (1,), "x")
    with pytest.raises(TypeError, match="not callable"):
        check_type((1,), ((),), (1,), "i")
    with pytest.raises(TypeError, match="no arguments"):
        same(1)
    # with `unreadable`, an Exception becomes its answer; a BaseException still comes out
    answers = []

    def unreadable():
        answers.append(1)
        return True

    assert check_type((broken,), ((),), (True,), "i", unreadable=unreadable)() is True and answers == [1]
    assert check_type((reader(5),), ((),), (5,), "v", unreadable=lambda: 0)() is False

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        check_type((interrupted,), ((),), (True,), "i", unreadable=unreadable)()
    with pytest.raises(TypeError, match="callable"):
        check_type((reader(1),), ((),), (1,), "i", unreadable=1)


_SPAN = st.tuples(st.integers(0, 200), st.integers(0, 40)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=300, deadline=None)
@given(spans=st.lists(_SPAN, max_size=12), asked=_SPAN)
def test_merged_ranges_answer_as_a_walk_over_every_range_would(spans, asked):
    # overlapping, touching, nested, empty and repeated spans, in any order
    lo, hi = asked
    walk = any(a < b and lo < hi and lo < b and a < hi for a, b in spans)
    assert region_keys.MergedRanges(spans).overlaps(lo, hi) == walk


# --- constants: keyed by their exact class and value (floats by bits), or refused ------------
@dataclasses.dataclass(frozen=True)
class Cfg:
    n: object


class NT(typing.NamedTuple):
    a: object


class Color(enum.Enum):
    RED = 1


class Sampling:  # compared by identity (object.__hash__): a mutable holder of values
    def __init__(self, temperature):
        self.temperature = temperature


class Loose:  # equality of its own: not known to be exact
    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Loose) and self.v == other.v

    def __hash__(self):
        return hash(self.v)


_X = torch.zeros(2)

#: Pairs the old keys (a type name and ==) merged, each of which a graph bakes differently.
COLLIDING_PAIRS = {
    "frozen dataclass field 4 vs 4.0": (Cfg(4), Cfg(4.0)),
    "frozen dataclass field True vs 1": (Cfg(True), Cfg(1)),
    "frozen dataclass field 0.0 vs -0.0": (Cfg(0.0), Cfg(-0.0)),
    "dict key 1 vs 1.0": ({1: _X}, {1.0: _X}),
    "dict key 1 vs True": ({1: _X}, {True: _X}),
    "dict key 0.0 vs -0.0": ({0.0: _X}, {-0.0: _X}),
    "frozenset {0.0} vs {-0.0}": (frozenset({0.0}), frozenset({-0.0})),
    "frozenset {1} vs {True}": (frozenset({1}), frozenset({True})),
    "True vs np.True_": (True, np.True_),
    "np.complex64 0 vs -0": (np.complex64(0), np.complex64(complex(-0.0, 0))),
    "np.float16 0 vs -0": (np.float16(0.0), np.float16(-0.0)),
    "np.int64(1) vs np.int32(1)": (np.int64(1), np.int32(1)),
    "datetime64 units": (np.datetime64(1, "D"), np.datetime64(1, "s")),
    "range(0) vs range(2, 2)": (range(0), range(2, 2)),
    "Decimal 1.0 vs 1.00": (decimal.Decimal("1.0"), decimal.Decimal("1.00")),
    "Fraction 1/2 vs 0.5": (fractions.Fraction(1, 2), 0.5),
    "torch.Size([2]) vs (2,)": (torch.Size([2]), (2,)),
    "named tuple 2 vs 2.0": (NT(2), NT(2.0)),
    "tuple in a frozenset (1,) vs (1.0,)": (frozenset({(1,)}), frozenset({(1.0,)})),
}


@pytest.mark.parametrize("name", COLLIDING_PAIRS)
def test_constants_that_differ_in_type_or_bits_get_keys_of_their_own(name):
    first, second = COLLIDING_PAIRS[name]
    assert key_of(_X, first) != key_of(_X, second)
    assert key_of(_X, first) == key_of(_X, first) and hash(key_of(_X, second)) == hash(key_of(_X, second))


def test_dynamic_scalars_are_keyed_by_their_type_object():
    assert key_of(_X, dynamic(True)) != key_of(_X, dynamic(np.True_))
    assert key_of(_X, dynamic(np.float32(1))) != key_of(_X, dynamic(np.float64(1)))
    assert key_of(_X, dynamic(np.float32(1))) == key_of(_X, dynamic(np.float32(2)))


def _exact(value):
    """What a graph bakes of a constant, written out plainly (the test's own reference): its
    class and, for floats and complex numbers anywhere, their bits."""
    if isinstance(value, float) and type(value) is float:
        return (float, struct.pack("<d", value))
    if type(value) is complex:
        return (complex, struct.pack("<dd", value.real, value.imag))
    if isinstance(value, np.generic):
        return (type(value), value.dtype.str, value.tobytes())
    if type(value) in (tuple, frozenset) or isinstance(value, NT):
        return (type(value), tuple(_exact(v) for v in value))
    if isinstance(value, Cfg):
        return (Cfg, _exact(value.n))
    return (type(value), value)


_NAN_PAYLOADS = [struct.unpack("<d", struct.pack("<Q", bits))[0] for bits in (0x7FF8000000000000, 0x7FF8000000000001)]
_SCALARS = st.sampled_from(
    [0, 1, -1, True, False, 0.0, -0.0, 1.0, *_NAN_PAYLOADS, float("inf"), 0j, complex(-0.0, 0.0), 1 + 0j]
    + [np.bool_(True), np.bool_(False), np.int64(1), np.int32(1), np.float32(0.0), np.float32(-0.0)]
    + [np.float64(1.0), np.float16(-0.0), np.complex64(0), np.complex64(complex(-0.0, 0)), "1", b"1", None]
)
_CONSTANTS = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.tuples(inner),
        st.tuples(inner, inner),
        st.frozensets(inner, max_size=1),  # one element: its iteration order is the only one
        inner.map(Cfg),
        inner.map(NT),
    ),
    max_leaves=4,
)
#: Where a constant may sit in a call: each place is walked or keyed element by element.
_PLACES = {
    "argument": lambda c: (c,),
    "inside a tuple": lambda c: ((c, 1),),
    "dict key": lambda c: ({c: _X},),
    "frozen dataclass field": lambda c: (Cfg(c),),
    "named tuple field": lambda c: (NT(c),),
    "keyword": lambda c: ((), {"flag": c}),
}


def _call_key(place, constant):
    made = _PLACES[place](constant)
    args, kwargs = (made[0], made[1]) if len(made) == 2 else (made, {})
    return key_of(_X, *args, **kwargs)


@settings(max_examples=400, deadline=None)
@given(first=_CONSTANTS, second=_CONSTANTS, place=st.sampled_from(sorted(_PLACES)))
def test_property_two_constants_share_a_key_exactly_when_their_types_and_bits_agree(first, second, place):
    """Any two constants that differ in class (anywhere inside) or in a float's bits get
    different keys, wherever they sit in the call; equal ones (distinct objects too) the same."""
    try:
        hash(first), hash(second)
    except TypeError:
        return  # a frozenset of a NaN and another value: not this test's subject
    assert (_call_key(place, first) == _call_key(place, second)) == (_exact(first) == _exact(second))
    rebuilt = copy.deepcopy(first)  # equal, other objects
    assert _call_key(place, rebuilt) == _call_key(place, first)


ALLOWED_CONSTANTS = {
    "a class": torch.nn.Linear,
    "a function": torch.nn.functional.relu,
    "a builtin": len,
    "a torch function": torch.relu,
    "a bound builtin of a string": "ab".upper,
    "a classmethod": dict.fromkeys,
    "a method descriptor": str.upper,
    "a ufunc": np.add,
    "a module": np,
    "an enum member": Color.RED,
    "a dtype": torch.float16,
    "a device": torch.device("cpu"),
    "a layout": torch.strided,
    "a memory format": torch.channels_last,
    "a numpy dtype": np.dtype("float32"),
    "None": None,
    "Ellipsis": ...,
    "bytes": b"x",
    "a Fraction": fractions.Fraction(1, 3),
    "a frozen dataclass of allowed values": Cfg((1, "a", torch.float32)),
    "a named tuple of allowed values": NT(Color.RED),
}


@pytest.mark.parametrize("name", ALLOWED_CONSTANTS)
def test_constants_that_hold_no_state_are_keyed(name):
    value = ALLOWED_CONSTANTS[name]
    assert key_of(_X, value) == key_of(_X, value)


REFUSED_ARGUMENTS = {
    "an object compared by identity": ((Sampling(1.0),), r"args\[1\] is a .*Sampling, an object compared by identity"),
    "the same, in a frozen dataclass": ((Cfg(Sampling(1.0)),), r"args\[1\]\.n is a .*Sampling"),
    "the same, in a named tuple": ((NT(Sampling(1.0)),), r"args\[1\]\[0\] is a .*Sampling"),
    "an nn.Module": ((torch.nn.Linear(2, 2),), r"args\[1\] is an nn.Module .*Close over the module"),
    "a torch.Generator": ((torch.Generator(),), r"args\[1\] is a torch\._C\.Generator"),
    "a functools.partial": ((functools.partial(len),), r"args\[1\] is a functools\.partial"),
    "a bound method of a mutable object": ((Sampling(1.0).__init__,), r"args\[1\]\.__self__ is a .*Sampling"),
    "a tensor's bound method": ((torch.zeros(2).add,), r"args\[1\]\.__self__ is a tensor inside a constant"),
    "an equality of its own": ((Loose(1),), r"args\[1\] is a .*Loose, a constant whose equality is its own"),
    "a tensor as a dict key": (({torch.zeros(1): 1},), r"args\[1\] key .* is a tensor inside a constant"),
}


@pytest.mark.parametrize("name", REFUSED_ARGUMENTS)
def test_arguments_a_graph_would_bake_without_seeing_them_change_are_refused_naming_the_path(name):
    args, message = REFUSED_ARGUMENTS[name]
    with pytest.raises(region_keys.RefusedKey, match=message) as refused:
        key_of(_X, *args)
    assert refused.value.path is not None and refused.value.path.startswith("args[")


def test_a_mutated_object_argument_never_keeps_its_key():
    """The finding's loop: params.temperature changed between calls. Refused, never the same key."""
    params = Sampling(1.0)
    with pytest.raises(region_keys.RefusedKey, match="pass the values themselves|Pass the values themselves"):
        key_of(_X, params)
    assert key_of(_X, params.temperature) != key_of(_X, 0.5)  # what the message advises: keyed by value


def test_unhashable_dataclasses_say_to_freeze_them():
    @dataclasses.dataclass
    class Mutable:
        n: int

    with pytest.raises(TypeError, match=r"args\[1\] is an unhashable .*Mutable .*frozen=True"):
        key_of(_X, Mutable(1))


# --- containers: every kind flatten walks comes back as its own class ------------------------
class ModelOutput(collections.OrderedDict):  # transformers' pattern: keys as properties
    @property
    def logits(self):
        return self["logits"]


class Tagged(tuple):
    pass


class Items(list):
    pass


@dataclasses.dataclass(frozen=True)
class Batch:
    ids: torch.Tensor
    n: int


def _containers():
    t = torch.arange(6.0).reshape(2, 3)
    counts = collections.defaultdict(list, {"a": t})
    return {
        "tuple": (t, 1),
        "list": [t, 2.5],
        "dict": {"k": t, 3: None},
        "named tuple": Pair(t, 1),
        "typing.NamedTuple": NT(t),
        "torch.Size": t.shape,
        "empty torch.Size": torch.Size([]),
        "topk (structseq)": torch.topk(t.flatten(), 2),
        "max (structseq)": torch.max(t, 1),
        "sort (structseq)": torch.sort(t, 1),
        "OrderedDict": collections.OrderedDict([("b", t), ("a", 1)]),
        "defaultdict": counts,
        "frozen dataclass": Batch(t, 3),
        "nested": {"out": [Pair(torch.topk(t.flatten(), 1), t.shape)], "od": collections.OrderedDict(x=(t,))},
    }


def _same(a, b):
    """Equal, of the same class at every level (a defaultdict with the same factory)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a is b
    elif isinstance(a, dict):
        assert list(a) == list(b) and getattr(a, "default_factory", None) is getattr(b, "default_factory", None)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a == b


@pytest.mark.parametrize("name", list(_containers()))
@pytest.mark.parametrize("side", ["argument", "output"])
def test_every_container_kind_round_trips_as_its_own_class(name, side):
    value = _containers()[name]
    spec, leaves, _ = flatten((value,), {}, walk_dataclasses=side == "output")
    _same(unflatten(spec, leaves)[0][0], value)
    if side == "argument":
        assert key_of(value) == key_of(_containers()[name])  # equal containers, other objects: one key


@pytest.mark.parametrize("name", ["named tuple", "torch.Size", "topk (structseq)", "OrderedDict", "nested"])
def test_a_graphs_replay_rebuilds_every_container_kind(name):
    """The generated replay function (graph.py) calls a spec's kind: the same classes come back."""
    from replay.rebinding import Plan
    from tests.replay.test_graph import build

    value = _containers()[name]
    x = torch.randn(4)
    named = [leaf for leaf in flatten((value,), {}, walk_dataclasses=True)[1] if isinstance(leaf, torch.Tensor)]
    graph, _ = build([x], Plan(), outputs=value, held=named)  # tensors it reaches by name: returned themselves
    _same(graph.replay(x), value)


REFUSED_CONTAINERS = {
    "a dict subclass (ModelOutput-like)": (ModelOutput(logits=_X), r"args\[0\] is a .*ModelOutput \(a dict subclass\)"),
    "a list subclass": (Items([_X]), r"args\[0\] is a .*Items \(a list subclass\)"),
    "a tuple subclass": (Tagged((_X,)), r"args\[0\] is a .*Tagged, a tuple subclass that cannot be rebuilt"),
    "a structseq with hidden fields": (os.stat("."), r"args\[0\] is a stat_result, a structseq with fields"),
    "a dict subclass inside a list": ([ModelOutput(logits=_X)], r"args\[0\]\[0\] is a .*ModelOutput"),
}


@pytest.mark.parametrize("name", REFUSED_CONTAINERS)
@pytest.mark.parametrize("side", ["argument", "output"])
def test_containers_that_cannot_be_rebuilt_exactly_are_a_clear_error(name, side):
    value, message = REFUSED_CONTAINERS[name]
    with pytest.raises(TypeError, match=message):
        flatten((value,), {}, walk_dataclasses=side == "output")


def test_frozen_dataclasses_holding_tensors_make_their_tensors_leaves():
    """A fresh Batch every step: one key per shape (its tensors rebound like any argument),
    not a key per object; its other fields are constants of the key."""
    x = torch.zeros(4)
    first, second = Batch(torch.ones(4), 1), Batch(torch.ones(4), 1)
    spec, leaves, paths = flatten((x, first), {})
    assert leaves[1] is first.ids and paths == ["args[0]", "args[1].ids", "args[1].n"]
    assert key_of(x, first) == key_of(x, second)
    assert key_of(x, first) != key_of(x, Batch(torch.ones(5), 1)) != key_of(x, Batch(torch.ones(4), 1.0))
    rebuilt = unflatten(spec, leaves)[0][1]
    assert type(rebuilt) is Batch and rebuilt.ids is first.ids and rebuilt.n == 1


def test_a_dataclass_that_is_not_frozen_is_not_walked():
    @dataclasses.dataclass(eq=False)
    class State:  # hashable by identity: the region may write it, a rebuilt copy would take the writes
        t: torch.Tensor

    with pytest.raises(region_keys.RefusedKey, match=r"args\[1\] is a .*State, an object compared by identity"):
        key_of(_X, State(torch.ones(2)))


# --- through the session (the tests' double): arguments reach the region as given ------------
@pytest.fixture
def double():
    from jitcore.backends import use_backend
    from jitcore.backends.null import NullBackend
    from tests.replay import test_session as ts

    with use_backend(NullBackend()):
        session = ts.DoubleSession(record_after=1, record_budget=1)
        ts.DoubleSession.current = session
        yield session


def test_torch_size_defaultdict_and_batch_arguments_run_and_replay(double):
    def step(x, size, counts, batch):
        return x.new_zeros(size) + len(counts["missing"]) + batch.ids.sum() + batch.n

    region = double.region(step)
    for _ in range(4):
        batch = Batch(torch.ones(3), 2)  # fresh every call: one key, rebound
        got = region(torch.zeros(2), torch.Size([2, 3]), collections.defaultdict(list), batch)
        assert torch.equal(got, torch.full((2, 3), 5.0))
    assert double.stats().replays >= 2


class BakingGraph:
    """A graph double that bakes what a capture bakes: each leaf that is not a tensor or a
    dynamic scalar keeps (a deep copy of) its value at recording."""

    @staticmethod
    def make(base):
        class Baking(base):
            def __init__(self, region, key, capture, spec, leaves, paths, session, number):
                super().__init__(region, key, capture, spec, leaves, paths, session, number)
                self.baked = [
                    leaf if isinstance(leaf, (torch.Tensor, region_keys.Dynamic)) else copy.deepcopy(leaf)
                    for leaf in leaves
                ]

            def replay(self, *leaves):
                self.replays += 1
                self.session.counters.replays += 1
                now = [
                    n if isinstance(n, (torch.Tensor, region_keys.Dynamic)) else b for n, b in zip(leaves, self.baked)
                ]
                args, kwargs = region_keys.unflatten(self.key[1], region_keys.plain_leaves(now))
                return self.region.fn(*args, **kwargs)

        return Baking


def test_a_mutated_object_argument_is_never_served_by_a_stale_graph(double):
    """The finding's loop: the graph recorded at temperature 1.0 must not serve 0.5. Refused
    loudly: RefusedKey naming the argument (until the session catches it), or a ReplayWarning
    and the eager result."""
    double.build_graph = BakingGraph.make(type(double).build_graph)

    def step(logits, params):
        return logits / params.temperature

    region = double.region(step)
    params, logits = Sampling(1.0), torch.full((4,), 2.0)
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for temperature in (1.0, 1.0, 1.0, 0.5, 0.5):
            params.temperature = temperature
            try:
                results.append(region(logits, params).tolist())
            except region_keys.RefusedKey as refused:
                assert "args[1]" in str(refused) and "frozen dataclass" in str(refused)
                results.append(None)
    assert [2.0] * 4 not in results[3:], "a stale graph served the call"
    assert any(r is None for r in results) or any("args[1]" in str(w.message) for w in caught)


def test_a_refused_argument_runs_eagerly_with_one_warning(double):
    def step(logits, params):
        return logits / params.temperature

    region = double.region(step)
    params, logits = Sampling(1.0), torch.full((4,), 2.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for temperature in (1.0, 1.0, 1.0, 0.5, 0.25):
            params.temperature = temperature
            assert region(logits, params).tolist() == [2.0 / temperature] * 4
    refusals = [w for w in caught if issubclass(w.category, replay.ReplayWarning) and "args[1]" in str(w.message)]
    assert len(refusals) == 1 and double.stats().replays == 0


# --- torch settings: the new TF32 API (torch >= 2.9) in either import order ------------------
_NEW_API_SCRIPT = r"""
import os, sys, warnings
warnings.simplefilter("error")  # a reader dropped or a refusal would show
import torch
order = sys.argv[1]
if order == "before":
    torch.backends.cuda.matmul.fp32_precision = "tf32"
from replay import region_keys as rk
wanted = {"fp32 precision (cuda matmul)", "fp32 precision (cuda conv)", "fp32 precision (generic all)"}
assert wanted <= set(rk.MODE_NAMES), rk.MODE_NAMES
torch.backends.cuda.matmul.fp32_precision = "tf32"
tf32 = rk.torch_modes()  # never raises, in either order
changed = rk.modes_changed(tf32)
assert changed() is False
torch.backends.cuda.matmul.fp32_precision = "ieee"
ieee = rk.torch_modes()
assert ieee != tf32 and changed() is True, (ieee, tf32)
torch.backends.cuda.matmul.fp32_precision = "tf32"
assert changed() is False
def toggled(holder):
    return lambda: setattr(holder, "fp32_precision", "tf32" if holder.fp32_precision == "ieee" else "ieee")
b = torch.backends
for change in (
    # the legacy API writes the map too ("high" and "medium" differ in oneDNN's entries only)
    lambda: torch.set_float32_matmul_precision("highest" if b.cuda.matmul.fp32_precision == "tf32" else "high"),
    toggled(b), toggled(b.cudnn), toggled(b.cudnn.conv), toggled(b.cudnn.rnn), toggled(b.cuda.matmul),
):
    before = rk.torch_modes()
    check = rk.modes_changed(before)
    change()
    assert rk.torch_modes() != before and check() is True
# oneDNN's precisions (CPU ops, which no graph holds) are neither keyed nor checked
for change in (toggled(b.mkldnn.matmul), toggled(b.mkldnn.conv), toggled(b.mkldnn.rnn)):
    before = rk.torch_modes()
    check = rk.modes_changed(before)
    change()
    assert rk.torch_modes() == before and check() is False
print("ok", os.environ.get("JITCORE_NATIVE", "1"))
"""


@pytest.mark.skipif(region_keys._FP32_PRECISION is None, reason="torch < 2.9 has no per-backend fp32_precision")
@pytest.mark.parametrize("order", ["before", "after"])
def test_the_new_tf32_api_is_keyed_and_checked_in_either_import_order(order, checks_kind):
    """In a fresh process (torch's settings are process-wide): the API set before replay is
    imported (the old readers were dropped: silently wrong) or after (every key raised)."""
    import pathlib

    root = pathlib.Path(region_keys.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", _NEW_API_SCRIPT, order], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok")


def test_a_setting_that_cannot_be_read_refuses_the_key_and_the_replay(monkeypatch, checks_kind):
    """Never a key or a replay without a setting: a reader that raises makes torch_modes
    raise RefusedKey naming it, and a replay's check answer True (refused) with one warning."""
    recorded = region_keys.torch_modes()
    state = {"broken": False}

    def flaky():
        if state["broken"]:
            raise RuntimeError("cannot say")
        return True

    readers = [*region_keys._MODE_READERS, region_keys._ModeReader("a flaky setting", "flaky", flaky, (), False)]
    monkeypatch.setattr(region_keys, "_MODE_READERS", readers)
    monkeypatch.setattr(region_keys, "MODE_NAMES", (*region_keys.MODE_NAMES, "a flaky setting"))
    monkeypatch.setattr(region_keys, "_modes_changed_cache", {})
    monkeypatch.setattr(region_keys, "_WARNED_UNREADABLE", set())
    modes = region_keys._make_torch_modes()
    recorded = modes()
    check = region_keys.modes_changed(recorded)
    assert check() is False
    state["broken"] = True
    with pytest.raises(region_keys.RefusedKey, match="the torch setting a flaky setting cannot be read"):
        modes()
    with pytest.warns(replay.ReplayWarning, match="a flaky setting cannot be read"):
        assert check() is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check() is True  # warned once
    state["broken"] = False
    assert check() is False
