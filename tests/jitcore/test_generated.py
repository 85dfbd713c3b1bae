"""jitcore.generated: the one way generated source is compiled, cached by its text and shown."""

from __future__ import annotations

import ast
import builtins
import pathlib
import traceback
import uuid

import pytest

import jitcore as jc
import replay
from jitcore import generated


def test_generated_code_is_compiled_only_by_generated_define():
    """The one compile path: every exec/eval (and builtins.compile) in the packages is the one
    in generated.define, which registers the source with linecache."""
    found = []
    for package in (jc, replay):
        root = pathlib.Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
            scopes = {
                id(node): function.name for function in functions for node in ast.walk(function)
            }  # innermost last
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                if isinstance(func, ast.Name) and func.id in ("exec", "eval"):
                    called = func.id
                elif (
                    isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "builtins"
                ):
                    called = func.attr if func.attr in ("exec", "eval", "compile") else None
                else:
                    called = None
                if called:
                    found.append((path.relative_to(root.parent).as_posix(), scopes.get(id(node)), called))
    assert sorted(found) == [
        ("jitcore/generated.py", "compile_source", "compile"),
        ("jitcore/generated.py", "define", "exec"),
    ]


def test_the_same_generated_text_is_compiled_once_and_shown_under_each_filename(monkeypatch):
    """Replays of the shapes of one region generate the same text (every value is named through
    the namespace): compiled once, each copy traced back to its own registered filename."""
    compiled = []
    compile_ = builtins.compile
    monkeypatch.setattr(builtins, "compile", lambda source, *rest: compiled.append(source) or compile_(source, *rest))
    source = f"def run(x):\n    # {uuid.uuid4().hex}\n    return _divide(x)\n"
    first, second = generated.source_filename("cache test"), generated.source_filename("cache test")
    run_first = generated.define(source, first, {"_divide": lambda x: 1 / x})["run"]
    run_second = generated.define(source, second, {"_divide": lambda x: 2 / x})["run"]
    assert compiled == [source]  # the second definition reused the code
    assert run_first(4) == 0.25 and run_second(4) == 0.5  # each with its own namespace
    generated.forget_source(first)
    with pytest.raises(ZeroDivisionError) as info:
        run_second(0)
    frame = [f for f in traceback.extract_tb(info.tb) if f.name == "run"][0]
    assert frame.filename == second and frame.line == "return _divide(x)"
    generated.forget_source(second)
