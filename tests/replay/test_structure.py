"""The replay package stays readable: no class over 25 methods (each class has one job), and no
function over 60 lines (a reader holds one on a screen). A new exception needs a reason here."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "replay"
MODULES = sorted(PACKAGE.glob("*.py"))
MAX_METHODS = 25
MAX_LINES = 60


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_no_class_has_more_than_25_methods(path):
    crowded = [
        (node.name, count)
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.ClassDef)
        and (count := sum(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body))
        > MAX_METHODS
    ]
    assert crowded == []


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_no_function_is_longer_than_60_lines(path):
    long = [
        (node.name, node.lineno, length)
        for node in ast.walk(_tree(path))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (length := node.end_lineno - node.lineno + 1) > MAX_LINES
    ]
    assert long == []
