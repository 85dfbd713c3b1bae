"""The torch-op observer: which watched inputs non-view torch ops read and write, through
torch's dispatch mode (TorchOpObserver) and through the torch-side helper's record-function
callback (NativeOpObserver), which must answer the same."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import jitcore.torch_native
from replay.observe import METADATA_ONLY_NAMES, OWN_KERNEL_KEYS, NativeOpObserver, TorchOpObserver, op_observer
from replay.region_keys import byte_range


@pytest.fixture(params=["python", "native"])
def watch(request):
    """``watch(*tensors)``: an observer of their byte ranges, of each kind."""
    if request.param == "python":
        return lambda *tensors: TorchOpObserver([byte_range(t) for t in tensors])
    helper = request.getfixturevalue("torch_native_helper")
    return lambda *tensors: NativeOpObserver([byte_range(t) for t in tensors], helper)


def test_reads_writes_and_views(watch):
    x, y, z = torch.randn(8), torch.randn(8), torch.randn(8)
    observer = watch(x, y, z)
    with observer:
        view = x[2:]  # a view: no read
        _ = view * 2  # reads x through the view
        y.add_(1)  # writes y
        torch.mul(x, 2, out=torch.empty(8))
    assert observer.read == {0, 1}
    assert observer.written == {1}
    assert 2 not in observer.read


def test_out_arguments_count_as_writes(watch):
    x, out = torch.randn(4), torch.empty(4)
    observer = watch(x, out)
    with observer:
        torch.add(x, 1, out=out)
    assert observer.written == {1} and observer.read == {0, 1}


def test_unwatched_and_empty_tensors_are_ignored(watch):
    x = torch.randn(4)
    observer = watch(x, torch.empty(0))
    with observer:
        torch.randn(4) + 1
    assert observer.read == set() and observer.written == set()


def test_answers_inside_the_block_are_what_the_ops_did_so_far(watch):
    """The capture refuses a key from the answers before its observer's block ends (a read
    beyond the argument, a torch op's write to a staged input): each answer, asked inside the
    block, is what the ops did up to then, and the end keeps them."""
    cache, other = torch.randn(4, 8), torch.randn(8)
    observer = watch(cache[1], other)
    with observer:
        assert (observer.read, observer.written, observer.reached_beyond) == (set(), set(), set())
        other.mul_(2)
        assert (observer.read, observer.written, observer.reached_beyond) == ({1}, {1}, set())
        cache.sum(0)
        assert (observer.read, observer.written, observer.reached_beyond) == ({0, 1}, {1}, {0})
        assert observer.failure is None if isinstance(observer, NativeOpObserver) else True
    assert (observer.read, observer.written, observer.reached_beyond) == ({0, 1}, {1}, {0})


def test_a_native_failure_is_seen_inside_the_block(torch_native_helper):
    """Record functions turned off while the block runs: the answers asked before it ends
    already assume the worst, as the capture's refusals must."""
    observer = NativeOpObserver([(0, 8), (8, 16)], torch_native_helper)
    with observer:
        torch.autograd._enable_record_function(False)
        try:
            assert observer.failure is not None and "turned off" in observer.failure
            assert observer.read == observer.written == observer.reached_beyond == {0, 1}
        finally:
            torch.autograd._enable_record_function(True)
    assert observer.reached_beyond == {0, 1}


def test_metadata_only_ops_do_not_count_as_reads(watch):
    x = torch.randn(4)
    observer = watch(x)
    with observer:
        torch.empty_like(x)
        torch.zeros_like(x)
        x.new_empty(3)
    assert observer.read == set()


def test_an_op_reading_a_tensor_that_holds_a_watched_range_is_noted(watch):
    """``cache`` read by an op while ``cache[1]`` is the watched argument: noted (the capture
    refuses the key); views inside a watched range, and overlapping watched ranges each
    holding the tensor read, are not."""
    cache = torch.randn(4, 8)
    observer = watch(cache[1], torch.randn(3))
    with observer:
        cache[1][2:5] * 2  # inside the argument
    assert observer.read == {0} and observer.reached_beyond == set()
    with observer:
        cache.sum()  # the whole global: reaches beyond the argument
    assert observer.reached_beyond == {0}

    base = torch.randn(16)
    x, y = base[:10], base[6:]
    observer = watch(x, y)
    with observer:
        x * 2  # overlaps y too, but x holds it whole
        y + 1
    assert observer.read == {0, 1} and observer.reached_beyond == set()
    with observer:
        base[4:12].sum()  # held by neither
    assert observer.reached_beyond == {0, 1}


# What both observers see, op by op: each case runs on x = base[:4], y = base[4:8] (watched)
# and w (not watched); the pair of answers (read, written, reached beyond) must be equal.
OPS = {
    "add": lambda x, y, w: x + y,
    "mul_": lambda x, y, w: x.mul_(2),
    "out=": lambda x, y, w: torch.add(w, 1, out=y),
    "index_select": lambda x, y, w: x.index_select(0, torch.tensor([0, 2])),
    "cat (a tensor list)": lambda x, y, w: torch.cat([x, y]),
    "copy_": lambda x, y, w: x.copy_(w),
    "contiguous, already": lambda x, y, w: x.contiguous(),
    "contiguous of a transpose": lambda x, y, w: x.t().contiguous(),
    "reshape": lambda x, y, w: x.reshape(-1),
    "where": lambda x, y, w: torch.where(x > 0, x, y),
    "linear (composite)": lambda x, y, w: F.linear(x, w),
    "softmax": lambda x, y, w: F.softmax(x, -1),
    "index_put_ (optional tensors)": lambda x, y, w: x.index_put_((torch.tensor([0]),), torch.tensor(1.0)),
    "_foreach_add_ (written list)": lambda x, y, w: torch._foreach_add_([x, y], 1.0),
    "setitem": lambda x, y, w: x.__setitem__(slice(0, 2), w[:2]),
    "empty_like and zeros_like": lambda x, y, w: (torch.empty_like(x), torch.zeros_like(y)),
    "to another dtype": lambda x, y, w: x.to(torch.float64),
    "item": lambda x, y, w: x[0, 0].item(),
    "masked_fill_": lambda x, y, w: x.masked_fill_(y > 0, 0.0),
    "scatter_": lambda x, y, w: x.scatter_(0, torch.zeros(1, 4, dtype=torch.long), y[:1]),
    "embedding": lambda x, y, w: F.embedding(torch.tensor([0, 1]), x),
    "layer_norm": lambda x, y, w: F.layer_norm(x, (4,), w[0], w[1]),
    "einsum": lambda x, y, w: torch.einsum("ij,jk->ik", x, w),
    "split": lambda x, y, w: [part + 1 for part in x.split(2)],
    "expand": lambda x, y, w: x[0].expand(4, 4) + y,
    "as_strided": lambda x, y, w: torch.as_strided(x, (2, 2), (1, 1)) * 2,
    "dropout, eval (composite)": lambda x, y, w: F.dropout(x, 0.5, training=False),
    "result_type (composite)": lambda x, y, w: torch.result_type(x, y),
    "lerp_": lambda x, y, w: x.lerp_(y, 0.5),
    "beyond: the whole base": lambda x, y, w: x.untyped_storage() and torch.as_strided(x, (12,), (1,)).sum(),
    "attention": lambda x, y, w: F.scaled_dot_product_attention(x[None, None], y[None, None], w[None, None]),
}


#: The thread states both observers are compared under.
MODES = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference": torch.inference_mode}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(OPS))
def test_both_observers_answer_the_same_for_every_op(name, mode, torch_native_helper):
    """Also under inference mode (no autograd key), where a composite op reaches a dispatch
    mode whole: ``contiguous`` or ``to`` would be skipped as views, hiding the copy inside
    them, and ``dropout`` outside training would count as a read of what it only returns.
    Both observers see such ops as their parts, as outside inference mode."""
    answers = []
    for make in (TorchOpObserver, lambda ranges: NativeOpObserver(ranges, torch_native_helper)):
        with MODES[mode]():
            base = torch.randn(12, 4)
            x, y, w = base[:4], base[4:8], torch.randn(4, 4)
            observer = make([byte_range(x), byte_range(y)])
            with observer:
                OPS[name](x, y, w)
        answers.append((observer.read, observer.written, observer.reached_beyond))
    assert answers[0] == answers[1]


@pytest.mark.parametrize("kind", ["python", "native"])
def test_the_copy_inside_a_composite_op_is_a_read_under_inference_mode(kind, torch_native_helper):
    with torch.inference_mode():
        for op, expected in (
            (lambda x: x.t().contiguous(), {0}),
            (lambda x: x.to(torch.float64), {0}),
            (lambda x: x.contiguous(), set()),  # already contiguous: itself, nothing read
            (lambda x: F.dropout(x, 0.5, training=False), set()),
        ):
            x = torch.randn(4, 4)
            ranges = [byte_range(x)]
            observer = TorchOpObserver(ranges) if kind == "python" else NativeOpObserver(ranges, torch_native_helper)
            with observer:
                op(x)
            assert observer.read == expected


def test_a_native_observation_without_record_functions_assumes_the_worst(torch_native_helper):
    x, y = torch.randn(4), torch.randn(4)
    observer = NativeOpObserver([byte_range(x), byte_range(y)], torch_native_helper)
    torch.autograd._enable_record_function(False)
    try:
        with observer:
            torch.randn(4) + 1  # touches neither, but nothing could be seen
    finally:
        torch.autograd._enable_record_function(True)
    assert "record functions" in observer.failure
    assert observer.read == observer.written == observer.reached_beyond == {0, 1}


def test_native_observers_nest_and_each_sees_the_ops_inside_it(torch_native_helper):
    x, y = torch.randn(4), torch.randn(4)
    outer = NativeOpObserver([byte_range(x), byte_range(y)], torch_native_helper)
    inner = NativeOpObserver([byte_range(y)], torch_native_helper)
    with outer:
        x + 1
        with inner:
            y.add_(1)
        x.mul_(2)
    assert (outer.read, outer.written) == ({0, 1}, {0, 1})
    assert (inner.read, inner.written) == ({0}, {0})
    with outer:  # nothing left watching between observations: a later block starts afresh
        pass
    assert outer.failure is None


def test_an_observation_ended_on_another_thread_is_refused(torch_native_helper):
    import threading

    token = torch_native_helper.op_observer_begin([(0, 8)])
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_end_error(torch_native_helper, token)))
    thread.start()
    thread.join()
    assert "another thread" in errors[0]
    torch_native_helper.op_observer_end(token)


def _end_error(helper, token) -> str:
    try:
        helper.op_observer_end(token)
    except RuntimeError as error:
        return str(error)
    return ""


def test_op_observer_takes_the_helper_where_it_is_loaded(torch_native_helper):
    with jitcore.torch_native.using(torch_native_helper):
        assert isinstance(op_observer([(0, 8)]), NativeOpObserver)
    with jitcore.torch_native.using(None):
        assert isinstance(op_observer([(0, 8)]), TorchOpObserver)


def test_both_observers_skip_the_same_ops(torch_native_helper):
    """The metadata-only ops and the kernels that make an op more than its parts are written
    twice, in Python and in the helper's C++: the same lists."""
    assert torch_native_helper.OBSERVER_METADATA_ONLY == tuple(f"aten::{name}" for name in METADATA_ONLY_NAMES)
    assert torch_native_helper.OBSERVER_OWN_KERNEL_KEYS == OWN_KERNEL_KEYS
