"""replay's view of jitcore: the public top level and jitcore.for_replay, nothing else.

Read from the code's imports (ast): a new reach into jitcore's inner modules fails here, and
goes through jitcore/for_replay.py (listed in docs/design.md) or stays out.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import jitcore
import replay
from jitcore import for_replay
from jitcore.backends.null import NullBackend

SOURCES = sorted(pathlib.Path(replay.__file__).parent.glob("*.py"))
#: Top-level names that are jitcore modules: replay reaches what it needs of them through for_replay.
_MODULES = {"recorder", "torch_native"}
#: What replay may read from ``jitcore`` itself.
TOP_LEVEL = (set(jitcore.__all__) - _MODULES) | {"__version__", "__file__", "for_replay"}
#: What replay may read from ``jitcore.for_replay``.
FOR_REPLAY = set(for_replay.__all__)


def _jitcore_names(tree: ast.AST) -> set[str]:
    """The names a module binds to the jitcore package (``import jitcore``, ``import jitcore as jc``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "jitcore" or (alias.name.startswith("jitcore.") and alias.asname is None):
                    names.add(alias.asname or "jitcore")
    return names


def _reaches(tree: ast.AST) -> list[str]:
    """Every use of jitcore outside its top level and for_replay, as ``line: what``, in line order."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {a.name}"
                for a in node.names
                if a.name.startswith("jitcore.") and a.name != "jitcore.for_replay"
            ]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("jitcore"):
            allowed = {"jitcore": TOP_LEVEL, "jitcore.for_replay": FOR_REPLAY}.get(node.module, set())
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names if a.name not in allowed]
    package = _jitcore_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in package:
            if node.attr not in TOP_LEVEL:
                found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner = node.value
            if isinstance(inner.value, ast.Name) and inner.value.id in package and inner.attr == "for_replay":
                if node.attr not in FOR_REPLAY:
                    found.append(f"{node.lineno}: for_replay.{node.attr}")
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
            if node.value.attr == "hot_namespace":  # a generated namespace read by name
                found.append(f"{node.lineno}: hot_namespace[...]")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_replay_reads_jitcore_through_its_top_level_and_for_replay_alone(path):
    assert _reaches(ast.parse(path.read_text())) == []


def test_the_scan_sees_each_way_in():
    source = """
import jitcore
import jitcore.recorder
import jitcore as jc
from jitcore.backends import get_backend
from jitcore import recorder, Kernel
from jitcore.for_replay import make_guard, hidden
jitcore.recorder.recording
jc.torch_native
jitcore.for_replay.secret
backend.hot_namespace["_current_stream"]
dict(backend.hot_namespace)
"""
    assert _reaches(ast.parse(source)) == [
        "3: import jitcore.recorder",
        "5: from jitcore.backends import get_backend",
        "6: from jitcore import recorder",
        "7: from jitcore.for_replay import hidden",
        "8: jitcore.recorder",
        "9: jc.torch_native",
        "10: for_replay.secret",
        "11: hot_namespace[...]",
    ]


def test_every_name_for_replay_lists_is_there():
    assert all(hasattr(for_replay, name) for name in for_replay.__all__)
    assert set(jitcore.__all__) >= TOP_LEVEL - {"__version__", "__file__", "for_replay"}


def test_the_readers_are_the_ones_generated_launch_code_calls():
    backend = NullBackend()
    assert for_replay.current_device_reader(backend) is backend.hot_namespace["_current_device"]
    assert for_replay.current_stream_reader(backend) is backend.hot_namespace["_current_stream"]
    assert for_replay.current_stream_reader(backend)(0) == backend.current_stream(0)
