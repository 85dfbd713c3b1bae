"""Region keys: structure plus shape-exact leaf signatures; flatten and unflatten agree."""

from __future__ import annotations

import collections
import contextlib
import itertools
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_every_mode_the_key_holds_has_a_change_in_this_test():
    assert set(region_keys.MODE_NAMES) <= set(MODE_CHANGES)


#: Settings that change nothing while autocast is off: the replay check ignores them then.
AUTOCAST_ONLY = {"autocast dtype (cuda)", "autocast dtype (cpu)", "autocast cache"}


def test_the_check_kind_is_the_one_asked_for(checks_kind):
    changed = region_keys.modes_changed(region_keys.torch_modes())
    assert (type(changed).__name__ == "SettingsCheck") is (checks_kind == "c")


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
    changed = region_keys.modes_changed(recorded)
    if checks_kind == "c":
        assert changed.readers[0] is region_keys._any_autocast and changed.arguments[0] == ()
        autocast_readers = {torch._C.is_autocast_enabled, getattr(torch._C, "get_autocast_dtype", None)}
        assert not any(reader in autocast_readers for reader in changed.readers)  # per-device settings
    else:
        source = "".join(__import__("linecache").getlines(changed.__code__.co_filename))
        assert "_any_autocast() is not _v0" in source.splitlines()[2]
        autocast_cuda = region_keys._MODE_READERS[region_keys.MODE_NAMES.index("autocast (cuda)")].function
        assert autocast_cuda not in changed.__globals__.values()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert changed() is True


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


_SPAN = st.tuples(st.integers(0, 200), st.integers(0, 40)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=300, deadline=None)
@given(spans=st.lists(_SPAN, max_size=12), asked=_SPAN)
def test_merged_ranges_answer_as_a_walk_over_every_range_would(spans, asked):
    # overlapping, touching, nested, empty and repeated spans, in any order
    lo, hi = asked
    walk = any(a < b and lo < hi and lo < b and a < hi for a, b in spans)
    assert region_keys.MergedRanges(spans).overlaps(lo, hi) == walk
