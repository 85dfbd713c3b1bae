"""Every Python-visible entry point of the C extensions, misused: wrong types, huge and negative
ints, a list changed during the call by an item's ``__index__``, objects made with ``__new__``
and used without ``__init__``. Each must raise a Python exception, never crash the process.

Each misuse runs in a process of its own, so that a crash is one failed test, not a dead
pytest: one runner process imports torch, jitcore and replay once (and loads the torch-side
helper built for this torch, tests/conftest.py), then forks a child per case; the child runs
the case and reports what it raised or returned, the runner reports a child killed by a signal
as such. A case names what it must raise (the exception's class name), or "returned" where
the call is well defined and answers (a list read from the copy taken at the call).

The private entry points that take raw addresses (a vendor function's, a parameter array's)
cannot check the address itself: they are called here with real ones (ctypes callbacks and
buffers) and misused in everything else.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]


class Case(NamedTuple):
    module: str  # the extension module
    entry: str  # the entry point misused
    misuse: str  # how, in words (the test's id)
    code: str  # the misuse, run with PRELUDE's names
    expected: str  # the exception's class name, or "returned"


# Names every case may use (run once in the runner, before it forks).
PRELUDE = r"""
import ctypes, datetime, struct, sys, threading
import torch
from jitcore import torch_native
from jitcore.backends import _native as native
from jitcore import _exclusion as exclusion
HELPER, _why = torch_native.load()
from replay import _checks as checks, _eager as eager, _step as step

KERNEL_LAUNCH_TYPE = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3)
_launch = KERNEL_LAUNCH_TYPE(lambda *args: 0)
KERNEL_LAUNCH = ctypes.cast(_launch, ctypes.c_void_p).value  # a "driver" launch that succeeds
_P, _SIZE = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)
_one_node = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, _P, _SIZE)(
    lambda graph, out, count: (out.__setitem__(0, 0xA0) if out else None, count.__setitem__(0, 1))[0] or 0
)
_kernel_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))(
    lambda node, out: out.__setitem__(0, 0) or 0
)
_no_params = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(lambda node, out: 0)
# "driver" node reads of a graph of one kernel node whose parameter array is NULL
NODE_READS = [ctypes.cast(f, ctypes.c_void_p).value for f in (_one_node, _kernel_type, _no_params)]
_add = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] * 3 + [ctypes.c_size_t] + [ctypes.c_void_p] * 2)(
    lambda *args: 0
)
ADD_MEMCPY = ctypes.cast(_add, ctypes.c_void_p).value  # a "driver" copy node add that succeeds


class Clears:
    # An int whose __index__ empties the list it lies in, then answers `value`.
    def __init__(self, target, value):
        self.target, self.value = target, value

    def __index__(self):
        self.target.clear()
        return self.value


def settings_program(**fields):
    # A settings program (replay.torch_state.SettingsProgram's fields) with no tests unless given.
    import types
    base = dict(readers=(), arguments=(), expected=(), ways="", uncovered=(), state=None)
    return types.SimpleNamespace(**{**base, **fields})


def watch_program(**fields):
    # A watch program (replay.watch.WatchProgram's fields) holding nothing unless given.
    import types
    base = dict(dicts=(), dict_keys=(), dict_values=(), lists=(), list_items=(), objects=(), types=(),
                object_dicts=(), tensors=(), words=(), reader=None, others=0, same=lambda kind, index: True)
    return types.SimpleNamespace(**{**base, **fields})


class Huge:
    # A sized object as long as a size can be.
    def __len__(self):
        return sys.maxsize


def param_array(count, size):
    # The address of `count` pointers, each to `size` bytes: a kernel node's parameter array.
    values = [ctypes.create_string_buffer(size) for _ in range(count)]
    array = (ctypes.c_void_p * count)(*[ctypes.addressof(v) for v in values])
    _kept.append((values, array))
    return ctypes.addressof(array)


_kept = []


class Exclusion:
    _holders = {}


def packed(runs, template=bytes(16), offsets=(0,)):
    return native.PackedLaunch(KERNEL_LAUNCH, 1, template, offsets, runs)


from jitcore.recorder import LaunchRecord
from jitcore.codegen import _CALL_FIELDS
RECORD_FIELDS = tuple(LaunchRecord._fields.index(f) for f in _CALL_FIELDS)
RECORD = tuple.__new__(LaunchRecord, (None,) * len(LaunchRecord._fields))  # a record template


class Short(tuple):
    pass


def recorded(sink, template=RECORD, told=RECORD_FIELDS, record_type=LaunchRecord):
    # A packed launch of one int, recorded into `sink` once the record class was told.
    native.use_launch_record(record_type, told)
    packed(((0, '<i'),)).recorded(sink, template, (), 1, 1, 1, 1, 1, 1, 0, 0, 5)
    return sink


def replay_step_graph():
    # A recorded graph replayed by csrc/replay_step.c (the replay tests' simulated exec).
    from tests.replay.test_graph import build, scalar_plan
    from replay import graph as graph_module
    from replay.dynamic import Dynamic

    x = torch.randn(8)
    with torch_native.using(HELPER):
        graph, _sim = build([x, Dynamic(1.0)], scalar_plan())
    assert isinstance(graph.replay, graph_module.ReplayStep), graph.step_refused
    graph.replay(x, Dynamic(1.0))
    return graph, x, Dynamic
"""


N, X, T = "jitcore.backends._native", "jitcore._exclusion", "jitcore._torch_native"
C, E, S = "replay._checks", "replay._eager", "replay._step"
LAUNCH = "native.bind('kernel_launch', 'f', KERNEL_LAUNCH)"
SIDE = "e = Exclusion(); s = exclusion.SharedSide(e); e._holders[threading.get_ident()] = "
REGION = "class R:\n    def dispatch(self, args): raise LookupError('no dispatch')\n"

# fmt: off
CASES = [Case(*row) for row in [
    # --- jitcore.backends._native ----------------------------------------------------------------------
    (N, "read_params", "sizes emptied by an item's __index__",
     "s = [8] * 1000; s.insert(0, Clears(s, 8)); assert len(native.read_params(param_array(1001, 8), s)) == 1001",
     "returned"),
    (N, "read_params", "sizes not a sequence", "native.read_params(param_array(1, 8), 8)", "TypeError"),
    (N, "read_params", "a size of text", "native.read_params(param_array(1, 8), ['8'])", "TypeError"),
    (N, "read_params", "a negative size", "native.read_params(param_array(1, 8), [-1])", "ValueError"),
    (N, "read_params", "a huge size", "native.read_params(param_array(1, 8), [2**70])", "OverflowError"),
    (N, "read_params", "a negative address", "native.read_params(-8, [8])", "OverflowError"),
    (N, "read_params", "an address of text", "native.read_params(str(param_array(1, 8)), [8])", "TypeError"),
    (N, "read_params", "an address a float", "native.read_params(float(param_array(1, 8)), [8])", "TypeError"),
    (N, "read_params", "no arguments", "native.read_params()", "TypeError"),
    (N, "PackedLaunch", "a run offset near 2**63", "packed(((2**63 - 2, '<i'),))(1, 1, 1, 1, 1, 1, 0, 0, 5)",
     "ValueError"),
    (N, "PackedLaunch", "a run offset past 2**63", "packed(((2**64, '<i'),))", "OverflowError"),
    (N, "PackedLaunch", "a negative run offset", "packed(((-4, '<i'),))", "ValueError"),
    (N, "PackedLaunch", "a parameter offset near 2**63", "packed((), offsets=(2**63 - 1,))", "ValueError"),
    (N, "PackedLaunch", "a parameter offset past 2**63", "packed((), offsets=(2**64,))", "OverflowError"),
    (N, "PackedLaunch", "a run that is a list", "packed(([0, '<i'],))", "TypeError"),
    (N, "PackedLaunch", "a run's format with a NUL", "packed(((0, '<i\\0i'),))", "ValueError"),
    (N, "PackedLaunch", "a run's unknown code", "packed(((0, '<s'),))", "ValueError"),
    (N, "PackedLaunch", "more codes than it holds", "packed(((0, '<' + 'x' * 5000),), bytes(8000))", "ValueError"),
    (N, "PackedLaunch", "a template of text", "packed((), 'sixteen bytes...')", "TypeError"),
    (N, "PackedLaunch", "offsets a list", "packed((), offsets=[0])", "TypeError"),
    (N, "PackedLaunch", "a launch address of 0", "native.PackedLaunch(0, 1, bytes(8), (0,), ())", "ValueError"),
    (N, "PackedLaunch", "a negative launch address", "native.PackedLaunch(-1, 1, bytes(8), (0,), ())",
     "OverflowError"),
    (N, "PackedLaunch", "made with __new__ and no arguments", "native.PackedLaunch.__new__(native.PackedLaunch)",
     "TypeError"),
    (N, "PackedLaunch", "called with a value too few", "packed(((0, '<i'),))(1, 1, 1, 1, 1, 1, 0, 0)", "TypeError"),
    (N, "PackedLaunch", "a negative grid", "packed(((0, '<i'),))(-1, 1, 1, 1, 1, 1, 0, 0, 5)", "OverflowError"),
    (N, "PackedLaunch", "a huge block", "packed(((0, '<i'),))(1, 1, 1, 2**40, 1, 1, 0, 0, 5)", "OverflowError"),
    # struct.error, as struct.pack says it:
    (N, "PackedLaunch", "a value past its code's range", "packed(((0, '<i'),))(1, 1, 1, 1, 1, 1, 0, 0, 2**40)",
     "error"),
    (N, "PackedLaunch", "a value of text", "packed(((0, '<i'),))(1, 1, 1, 1, 1, 1, 0, 0, 'five')", "error"),
    # what (5).data_ptr() raises, as the Python path's packing does:
    (N, "PackedLaunch", "a tensor's code given an int", "packed(((0, '<P'),))(1, 1, 1, 1, 1, 1, 0, 0, 5)",
     "AttributeError"),
    (N, "PackedLaunch", "a stream of text", "packed(((0, '<i'),))(1, 1, 1, 1, 1, 1, 0, 'stream', 5)", "TypeError"),
    (N, "PackedLaunch", "reporting with a keyword", "packed(((0, '<i'),)).reporting(1, 1, 1, 1, 1, 1, 0, 0, x=5)",
     "TypeError"),
    (N, "PackedLaunch", "recorded before a record class was told",
     "packed(((0, '<i'),)).recorded(([], [], None), RECORD, (), 1, 1, 1, 1, 1, 1, 0, 0, 5)", "RuntimeError"),
    (N, "PackedLaunch", "recorded into a list", "recorded([])", "TypeError"),
    (N, "PackedLaunch", "recorded into a sink of tuples", "recorded(((), (), None))", "TypeError"),
    (N, "PackedLaunch", "recorded with a tail that is no callable", "recorded(([], [], 5))", "TypeError"),
    (N, "PackedLaunch", "recorded from a template of another class", "recorded(([], [], None), template=(1, 2))",
     "TypeError"),
    (N, "PackedLaunch", "recorded from a template shorter than told", "recorded(([], [], None), Short((1, 2)), "
     "record_type=Short)", "ValueError"),
    (N, "PackedLaunch", "recorded with a tail that raises", "recorded(([], [], lambda stream: 1 / 0))",
     "ZeroDivisionError"),
    (N, "PackedLaunch", "recorded with a tail answering an int", "recorded(([], [], lambda stream: 5))", "TypeError"),
    (N, "PackedLaunch", "recorded with a tail answering one node",
     "r, n, _ = recorded(([], [], lambda stream: (7,))); assert n == [7] and r[0].param_bytes[:4] == b'\\5\\0\\0\\0'",
     "returned"),
    (N, "PackedLaunch", "recorded with too few arguments", "native.use_launch_record(LaunchRecord, RECORD_FIELDS); "
     "packed(((0, '<i'),)).recorded(([], [], None), RECORD, ())", "TypeError"),
    (N, "PackedLaunch", "recorded with a value too few", "native.use_launch_record(LaunchRecord, RECORD_FIELDS); "
     "packed(((0, '<i'),)).recorded(([], [], None), RECORD, (), 1, 1, 1, 1, 1, 1, 0, 0)", "TypeError"),
    (N, "CaptureTail", "an address of 0", "native.CaptureTail(0, 1)", "ValueError"),
    (N, "CaptureTail", "a negative address", "native.CaptureTail(-1, 1)", "OverflowError"),
    (N, "CaptureTail", "an address of text", "native.CaptureTail('a', 1)", "TypeError"),
    (N, "CaptureTail", "a status past an int", "native.CaptureTail(native.NULL_CAPTURE_INFO, 2**40)", "OverflowError"),
    (N, "CaptureTail", "made with keywords", "native.CaptureTail(address=native.NULL_CAPTURE_INFO, active=1)",
     "TypeError"),
    (N, "CaptureTail", "made with __new__ and no arguments", "native.CaptureTail.__new__(native.CaptureTail)",
     "TypeError"),
    (N, "CaptureTail", "asked without a stream", "native.CaptureTail(native.NULL_CAPTURE_INFO, 1)()", "TypeError"),
    (N, "CaptureTail", "asked of a stream of text", "native.CaptureTail(native.NULL_CAPTURE_INFO, 1)('s')",
     "TypeError"),
    (N, "CaptureTail", "asked with a keyword", "native.CaptureTail(native.NULL_CAPTURE_INFO, 1)(stream=0)",
     "TypeError"),
    (N, "CaptureTail", "asked of a stream not capturing",
     "assert native.CaptureTail(native.NULL_CAPTURE_INFO, 1)(0) is None", "returned"),
    (N, "CaptureTail", "the tail of a recorded launch",
     "r, n, _ = recorded(([], [], native.CaptureTail(native.NULL_CAPTURE_INFO, 1))); assert (n, len(r)) == ([None], 1)",
     "returned"),
    (N, "NodeReads", "an address of 0", "native.NodeReads(0, NODE_READS[1], NODE_READS[2], 0)", "ValueError"),
    (N, "NodeReads", "a negative address", "native.NodeReads(NODE_READS[0], -1, NODE_READS[2], 0)", "OverflowError"),
    (N, "NodeReads", "an address a float", "native.NodeReads(NODE_READS[0], NODE_READS[1], 1.5, 0)", "TypeError"),
    (N, "NodeReads", "a node type past an int", "native.NodeReads(*NODE_READS, 2**40)", "OverflowError"),
    (N, "NodeReads", "made with __new__ and no arguments", "native.NodeReads.__new__(native.NodeReads)", "TypeError"),
    (N, "NodeReads", "sizes a list", "native.NodeReads(*NODE_READS, 0)(1, [(8,)])", "TypeError"),
    (N, "NodeReads", "sizes of a function that are a list", "native.NodeReads(*NODE_READS, 0)(1, {0: [8]})",
     "TypeError"),
    (N, "NodeReads", "a negative size", "native.NodeReads(*NODE_READS, 0)(1, {0: (-8,)})", "ValueError"),
    (N, "NodeReads", "a graph of text", "native.NodeReads(*NODE_READS, 0)('g', None)", "TypeError"),
    (N, "NodeReads", "read with a keyword", "native.NodeReads(*NODE_READS, 0)(1, sizes=None)", "TypeError"),
    (N, "NodeReads", "parameters of a NULL array read as empty",
     "assert native.NodeReads(*NODE_READS, 0)(1, {0: (8, 4)})[2][0][-1] == (b'', b'')", "returned"),
    (N, "bind", "a copy node after dependencies of text",
     "native.bind('graph_add_memcpy', 'a', ADD_MEMCPY)(1, ('a',), 8, 0)", "TypeError"),
    (N, "bind", "a copy node after a set of dependencies",
     "native.bind('graph_add_memcpy', 'a', ADD_MEMCPY)(1, {2}, 8, 0)", "TypeError"),
    (N, "bind", "a copy node of no parameters", "native.bind('graph_add_memcpy', 'a', ADD_MEMCPY)(1, (), 0, 0)",
     "ValueError"),
    (N, "bind", "a copy node after dependencies emptied by an item's __int__",
     "d = [2] * 100; d.insert(0, Clears(d, 1)); native.bind('graph_add_memcpy', 'a', ADD_MEMCPY)(1, d, 8, 0)",
     "returned"),
    (N, "without_tensors", "records a tuple", "native.without_tensors(((1,),), 0, torch.Tensor, (int,), 'a')",
     "TypeError"),
    (N, "without_tensors", "a record that is no tuple", "native.without_tensors([[(1,)]], 0, torch.Tensor, (), 'a')",
     "TypeError"),
    (N, "without_tensors", "a position past a record", "native.without_tensors([((1,),)], 1, torch.Tensor, (), 'a')",
     "TypeError"),
    (N, "without_tensors", "arguments that are no tuple", "native.without_tensors([([1],)], 0, torch.Tensor, (), 'a')",
     "TypeError"),
    (N, "without_tensors", "a negative position", "native.without_tensors([((1,),)], -1, torch.Tensor, (), 'a')",
     "TypeError"),
    (N, "without_tensors", "a position past 2**64", "native.without_tensors([((1,),)], 2**64, torch.Tensor, (), 'a')",
     "OverflowError"),
    (N, "without_tensors", "kept types that are no types",
     "native.without_tensors([(('s',),)], 0, torch.Tensor, 5, 'a')", "TypeError"),
    (N, "without_tensors", "an attribute name that is no text",
     "native.without_tensors([((1,),)], 0, torch.Tensor, (), 5)", "TypeError"),
    (N, "without_tensors", "records emptied by an argument's lookup",
     "L = []\nclass Clearing:\n    def __getattr__(self, name):\n        L.clear(); raise AttributeError(name)\n"
     "L += [((Clearing(), 1.5),)] * 3; got = native.without_tensors(L, 0, torch.Tensor, (), 'a')\n"
     "assert [r[0] for r in got] == [(None, 1.5)] * 3 and L == []", "returned"),
    (N, "without_tensors", "no arguments", "native.without_tensors()", "TypeError"),
    (N, "use_launch_record", "a record class that is no tuple", "native.use_launch_record(list, RECORD_FIELDS)",
     "TypeError"),
    (N, "use_launch_record", "positions a list", "native.use_launch_record(LaunchRecord, list(RECORD_FIELDS))",
     "TypeError"),
    (N, "use_launch_record", "too few positions", "native.use_launch_record(LaunchRecord, RECORD_FIELDS[:3])",
     "TypeError"),
    (N, "use_launch_record", "a negative position",
     "native.use_launch_record(LaunchRecord, (-1,) + RECORD_FIELDS[1:])", "ValueError"),
    (N, "use_launch_record", "a position past 2**64",
     "native.use_launch_record(LaunchRecord, (2**64,) + RECORD_FIELDS[1:])", "OverflowError"),
    (N, "use_launch_record", "a position of text",
     "native.use_launch_record(LaunchRecord, ('0',) + RECORD_FIELDS[1:])", "TypeError"),
    (N, "use_launch_record", "no arguments", "native.use_launch_record()", "TypeError"),
    (N, "bind", "a negative address", "native.bind('kernel_launch', 'f', -1)", "OverflowError"),
    (N, "bind", "an address past 2**64", "native.bind('kernel_launch', 'f', 2**64)", "OverflowError"),
    (N, "bind", "an address of 0", "native.bind('kernel_launch', 'f', 0)", "ValueError"),
    (N, "bind", "an address of text", "native.bind('kernel_launch', 'f', '1')", "TypeError"),
    (N, "bind", "an unknown kind", "native.bind('launch_everything', 'f', KERNEL_LAUNCH)", "ValueError"),
    (N, "bind", "a kind that is an int", "native.bind(1, 'f', KERNEL_LAUNCH)", "TypeError"),
    (N, "bind", "a name with a lone surrogate", "native.bind('kernel_launch', '\\ud800', KERNEL_LAUNCH)",
     "UnicodeEncodeError"),
    (N, "kernel_launch", "a handle of text", f"{LAUNCH}('1', 1, 1, 1, 1, 1, 1, 0, 0, 0, 0)", "TypeError"),
    (N, "kernel_launch", "a handle a float", f"{LAUNCH}(1.5, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0)", "TypeError"),
    (N, "kernel_launch", "a negative handle", f"{LAUNCH}(-1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0)", "OverflowError"),
    (N, "kernel_launch", "a dimension past 2**32", f"{LAUNCH}(1, 2**32, 1, 1, 1, 1, 1, 0, 0, 0, 0)", "OverflowError"),
    (N, "kernel_launch", "too few arguments", f"{LAUNCH}(1, 1)", "TypeError"),
    (N, "use_data_pointer_reader", "an int", "native.use_data_pointer_reader(5)", "ValueError"),
    (N, "use_data_pointer_reader", "another module's capsule", "native.use_data_pointer_reader(datetime.datetime_CAPI)",
     "ValueError"),
    # --- jitcore._exclusion ----------------------------------------------------------------------------
    (X, "SharedSide", "__enter__ without __init__", "exclusion.SharedSide.__new__(exclusion.SharedSide).__enter__()",
     "RuntimeError"),
    (X, "SharedSide", "__exit__ without __init__",
     "exclusion.SharedSide.__new__(exclusion.SharedSide).__exit__(None, None, None)", "RuntimeError"),
    (X, "SharedSide", "an exclusion without holders", "exclusion.SharedSide(object())", "TypeError"),
    (X, "SharedSide", "holders that are a list", "e = Exclusion(); e._holders = []; exclusion.SharedSide(e)",
     "TypeError"),
    (X, "SharedSide", "a negative depth", SIDE + "-1; s.__enter__()", "ValueError"),
    (X, "SharedSide", "the largest depth", SIDE + "2**63 - 1; s.__enter__()", "ValueError"),
    (X, "SharedSide", "a huge depth", SIDE + "2**70; s.__enter__()", "OverflowError"),
    (X, "SharedSide", "a depth of text", SIDE + "'1'; s.__exit__(None, None, None)", "TypeError"),
    (X, "SharedSide", "__exit__ with one argument", "exclusion.SharedSide(Exclusion()).__exit__(None)", "TypeError"),
    (X, "SharedSide", "waiting set past 2**63", "exclusion.SharedSide(Exclusion()).waiting = 2**63", "OverflowError"),
    # --- jitcore._torch_native (the torch-side helper) -------------------------------------------------
    (T, "tensor_guard", "sizes emptied by an item's __index__",
     "x = torch.ones(4, 6); s = [4, 6]; s[0] = Clears(s, 4); assert HELPER.tensor_guard((x,), (s,), ((None,) * 2,))(x)",
     "returned"),
    (T, "tensor_guard", "examples a list", "HELPER.tensor_guard([torch.randn(2)], ((2,),), ((1,),))", "TypeError"),
    (T, "tensor_guard", "an example that is not a tensor", "HELPER.tensor_guard((5,), ((2,),), ((1,),))",
     "TypeError"),
    (T, "tensor_guard", "sizes of another rank", "HELPER.tensor_guard((torch.randn(2),), ((2, 1),), ((1,),))",
     "ValueError"),
    (T, "tensor_guard", "sizes an int", "HELPER.tensor_guard((torch.randn(2),), (2,), ((1,),))", "TypeError"),
    (T, "tensor_guard", "a huge size", "HELPER.tensor_guard((torch.randn(2),), ((2**70,),), ((1,),))",
     "OverflowError"),
    (T, "tensor_guard", "a size of text", "HELPER.tensor_guard((torch.randn(2),), (('2',),), ((1,),))", "TypeError"),
    (T, "tensor_guard", "fewer sizes than examples", "HELPER.tensor_guard((torch.randn(2),), (), ((1,),))",
     "ValueError"),
    (T, "tensor_guard", "its check given too few tensors",
     "x = torch.randn(2); HELPER.tensor_guard((x,), ((2,),), ((1,),))()", "TypeError"),
    (T, "tensor_guard", "its check given ints",
     "x = torch.randn(2); assert HELPER.tensor_guard((x,), ((2,),), ((1,),))(5) is False", "returned"),
    (T, "op_observer_begin", "ranges emptied by an item's __index__",
     "r = [(0, 8)] * 100; r[0] = (Clears(r, 0), 8); HELPER.op_observer_end(HELPER.op_observer_begin(r))",
     "returned"),
    (T, "op_observer_begin", "a range that is not a pair", "HELPER.op_observer_begin([5])", "TypeError"),
    (T, "op_observer_begin", "a range of three", "HELPER.op_observer_begin([(1, 2, 3)])", "TypeError"),
    (T, "op_observer_begin", "a negative address", "HELPER.op_observer_begin([(-1, 8)])", "OverflowError"),
    (T, "op_observer_begin", "an address past 2**64", "HELPER.op_observer_begin([(0, 2**64)])", "OverflowError"),
    (T, "op_observer_begin", "ranges an int", "HELPER.op_observer_begin(5)", "TypeError"),
    (T, "op_observer_end", "an int for the token", "HELPER.op_observer_end(5)", "ValueError"),
    (T, "op_observer_peek", "another module's capsule", "HELPER.op_observer_peek(datetime.datetime_CAPI)",
     "ValueError"),
    (T, "settings_watch", "an exact check that is not callable", "HELPER.settings_watch(1, None)", "TypeError"),
    (T, "settings_watch", "its check given an argument", "HELPER.settings_watch(lambda: False, None)(1)",
     "TypeError"),
    (T, "settings_state", "called with an argument", "HELPER.settings_state(1)", "TypeError"),
    (T, "data_pointer", "an int", "assert HELPER.data_pointer(5) is None", "returned"),
    (T, "tensor_state", "an int", "assert HELPER.tensor_state(5) is None", "returned"),
    (T, "tensor_state", "a sparse tensor", "assert HELPER.tensor_state(torch.ones(2).to_sparse()) is None",
     "returned"),
    (T, "storage_span", "text", "assert HELPER.storage_span('x') is None", "returned"),
    (T, "storage_use_count", "a tensor for the storage", "assert HELPER.storage_use_count(torch.ones(1)) is None",
     "returned"),
    # what (5).detach() raises: for anything but a tensor the method is called
    (T, "fresh_output", "an int", "HELPER.fresh_output(5)", "AttributeError"),
    # --- replay's C entry points -----------------------------------------------------------------------
    (C, "disjoint", "lists", "checks.disjoint([1], [2])", "TypeError"),
    (C, "disjoint", "a pointer of text", "checks.disjoint(('1',), (2,))", "TypeError"),
    (C, "disjoint", "a negative extent", "checks.disjoint((1,), (-1,))", "OverflowError"),
    (C, "disjoint", "a range past 2**64", "checks.disjoint((2**64 - 1,), (2,))", "OverflowError"),
    (C, "disjoint", "one extent too few", "checks.disjoint((1, 2), (1,))", "ValueError"),
    (C, "SettingsCheck", "an int for its program", "checks.SettingsCheck(5)", "TypeError AttributeError"),
    (C, "SettingsCheck", "a program with ints for its tuples",
     "checks.SettingsCheck(settings_program(readers=1, arguments=2, expected=3, ways='i'))", "TypeError"),
    (C, "SettingsCheck", "a program with an unknown way",
     "checks.SettingsCheck(settings_program(readers=(len,), arguments=((),), expected=(0,), ways='z'))", "ValueError"),
    (C, "SettingsCheck", "a program with one argument tuple too few",
     "checks.SettingsCheck(settings_program(readers=(len, len), arguments=((),), expected=(0, 0), ways='ii'))",
     "ValueError"),
    (C, "SettingsCheck", "a state that is no capsule",
     "checks.SettingsCheck(settings_program(state=5))", "TypeError ValueError"),
    (C, "SettingsCheck", "made with __new__ and no arguments", "checks.SettingsCheck.__new__(checks.SettingsCheck)",
     "TypeError"),
    (C, "SettingsCheck", "called with an argument", "checks.SettingsCheck(settings_program())(1)", "TypeError"),
    (C, "WatchCheck", "an int for its program", "checks.WatchCheck(5)", "AttributeError"),
    (C, "WatchCheck", "a program with ints for its tuples", "checks.WatchCheck(watch_program(dicts=1))", "TypeError"),
    (C, "WatchCheck", "a list among its dicts", "checks.WatchCheck(watch_program(dicts=([],), dict_keys=((),), "
     "dict_values=((),)))", "TypeError"),
    (C, "WatchCheck", "keys and values of other lengths", "checks.WatchCheck(watch_program(dicts=({},), "
     "dict_keys=((1,),), dict_values=((),)))", "ValueError"),
    (C, "WatchCheck", "one type too few", "checks.WatchCheck(watch_program(objects=(1,)))", "ValueError"),
    (C, "WatchCheck", "a type that is an int", "checks.WatchCheck(watch_program(objects=(1,), types=(1,), "
     "object_dicts=(None,)))", "TypeError"),
    (C, "WatchCheck", "another module's capsule for its reader",
     "checks.WatchCheck(watch_program(reader=datetime.datetime_CAPI))", "TypeError"),
    (C, "WatchCheck", "words of text", "checks.WatchCheck(watch_program(tensors=(1,), words=('x',)))", "TypeError"),
    (C, "WatchCheck", "words that call an int a tensor",  # not read by the helper: compared in Python, never unpacked
     "assert checks.WatchCheck(watch_program(tensors=(5,), words=((id(int), 0, 0, 0, 0, 0),), "
     "reader=HELPER.replay_support))() is False", "returned"),
    (C, "WatchCheck", "a negative count of others", "checks.WatchCheck(watch_program(others=-1))", "ValueError"),
    (C, "WatchCheck", "same that is not callable", "checks.WatchCheck(watch_program(same=1))", "TypeError"),
    (C, "WatchCheck", "same that raises", "checks.WatchCheck(watch_program(others=1, same=lambda k, i: 1 / 0))()",
     "ZeroDivisionError"),
    (C, "WatchCheck", "made with __new__ and no arguments", "checks.WatchCheck.__new__(checks.WatchCheck)",
     "TypeError"),
    (C, "WatchCheck", "called with an argument", "checks.WatchCheck(watch_program())(1)", "TypeError"),
    (C, "flush_denormal", "an argument", "checks.flush_denormal(1)", "TypeError"),
    (C, "total_length", "an int", "checks.total_length(5)", "TypeError"),
    (C, "total_length", "lengths past the largest size", "checks.total_length(Huge(), Huge())", "OverflowError"),
    (E, "EagerGate", "called without __init__", "eager.EagerGate.__new__(eager.EagerGate)((1,))",
     "TypeError ValueError RuntimeError"),
    (E, "EagerGate", "its program read without __init__", "eager.EagerGate.__new__(eager.EagerGate).program",
     "TypeError ValueError RuntimeError"),
    # the region's own error, or a refusal of the call without __init__
    (E, "RegionCall", "called without __init__", REGION + "eager.RegionCall.__new__(eager.RegionCall)(R(), 1)",
     "LookupError RuntimeError"),
    (S, "ReplayStep", "its last-stream list emptied after it was built",
     "graph, x, Dynamic = replay_step_graph(); graph.session.last_stream.clear(); graph.replay(x, Dynamic(1.0))",
     "IndexError TypeError ValueError RuntimeError"),  # IndexError: what the generated replay raises too
    (S, "ReplayStep", "a program that is an int", "step.ReplayStep(5)", "TypeError"),
    (S, "ReplayStep", "made with __new__ and no arguments", "step.ReplayStep.__new__(step.ReplayStep)", "TypeError"),
    (S, "held", "an int for the step", "step.held(5, 5)", "TypeError"),
    # lane.storage, read as an attribute
    (S, "storage_references", "an int for the lane", "step.storage_references(5)", "AttributeError"),
]]
# fmt: on
RUNNER = r"""
import json, os, signal, sys, time, traceback
cases = json.load(sys.stdin)
namespace = {}
exec(compile(PRELUDE, "<prelude>", "exec"), namespace)
results = {}
for case in cases:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            exec(compile(case["code"], "<case>", "exec"), dict(namespace))
            outcome = "returned"
        except BaseException as error:
            outcome = f"raised {type(error).__name__}: {error}"[:500]
        os.write(write, outcome.encode())
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = None
            break
        time.sleep(0.002)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    if status is None:
        results[case["id"]] = "hung"
    elif os.WIFSIGNALED(status):
        results[case["id"]] = f"killed by signal {os.WTERMSIG(status)} ({signal.Signals(os.WTERMSIG(status)).name})"
    else:
        results[case["id"]] = said
print(json.dumps(results))
"""


def case_id(case: Case) -> str:
    return f"{case.module}.{case.entry}: {case.misuse}"


def needs_helper(case: Case) -> bool:
    return case.module == T or "replay_step_graph" in case.code or "HELPER." in case.code


@pytest.fixture(scope="module")
def outcomes(request) -> dict[str, str]:
    """What each case did, run by one runner process forking a child per case."""
    extensions = ("jitcore.backends._native", "jitcore._exclusion", "replay._eager", "replay._step", "replay._checks")
    missing = [m for m in extensions if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"not built here: {', '.join(missing)}")
    if not hasattr(os, "fork"):
        pytest.skip("the runner forks a child per case")
    try:
        cache = request.getfixturevalue("torch_native_cache")  # the helper built for this torch
    except pytest.skip.Exception:
        cache = None  # no C++ compiler, or JITCORE_NATIVE=0: the helper's cases skip
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        JITCORE_CACHE_DIR=str(cache or request.getfixturevalue("tmp_path_factory").mktemp("cache")),
    )
    env.pop("JITCORE_NATIVE", None)
    cases = [{"id": case_id(case), "code": case.code} for case in CASES if cache or not needs_helper(case)]
    runner = f"PRELUDE = {PRELUDE!r}\n{RUNNER}"
    done = subprocess.run(
        [sys.executable, "-c", runner], input=json.dumps(cases), cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "case",
    [pytest.param(case, id=case_id(case)) for case in CASES],
)
def test_a_misused_entry_point_raises_and_never_crashes(case, outcomes):
    if case_id(case) not in outcomes:
        pytest.skip("needs the torch-side helper, not built here")
    outcome = outcomes[case_id(case)]
    if outcome.startswith(("killed", "hung")):
        pytest.fail(f"{case_id(case)}: {outcome}")
    answered = outcome.removeprefix("raised ").split(":")[0] if outcome.startswith("raised ") else outcome
    assert answered in case.expected.split(), f"{case_id(case)}: expected {case.expected}, got {outcome}"


def test_every_python_visible_entry_point_has_a_case(torch_native_helper):
    """A new entry point comes with its misuses here."""
    from jitcore import _exclusion
    from jitcore.backends import _native
    from replay import _checks, _eager, _step

    covered = {(case.module, case.entry) for case in CASES}
    bound = {"kernel_launch"}  # made by _native.bind: one function per kind, all alike
    modules = {
        "jitcore.backends._native": _native,
        "jitcore._exclusion": _exclusion,
        "jitcore._torch_native": torch_native_helper,
        "replay._checks": _checks,
        "replay._eager": _eager,
        "replay._step": _step,
    }
    for name, module in modules.items():
        entries = {e for e in dir(module) if not e.startswith("_") and callable(getattr(module, e))}
        entries -= {"data_pointer_reader", "replay_support"}  # capsules, read from C only
        uncovered = {e for e in entries if (name, e) not in covered and e not in bound}
        assert not uncovered, f"{name}: no misuse case for {sorted(uncovered)}"
