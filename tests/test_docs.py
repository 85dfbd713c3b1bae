"""Runnable code blocks in the README and docs/ are run: ```python test (any machine) and
```python gpu (a GPU); the blocks of one file share a namespace, in order."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python (test|gpu)\n(.*?)^```", re.S | re.M)


def blocks(kind: str) -> list:
    found = []
    for path in FILES:
        chunks = [code for tag, code in BLOCK.findall(path.read_text()) if tag == kind]
        if chunks:
            found.append(pytest.param(chunks, id=path.relative_to(ROOT).as_posix()))
    return found


def run(chunks: list[str], name: str) -> None:
    namespace: dict[str, object] = {"__name__": f"docs_{name}"}
    for number, code in enumerate(chunks):
        exec(compile(code, f"<{name} block {number}>", "exec"), namespace)


@pytest.mark.parametrize("chunks", blocks("test"))
def test_cpu_blocks(chunks, request):
    run(chunks, request.node.callspec.id)


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", blocks("gpu"))
def test_gpu_blocks(chunks, request):
    run(chunks, request.node.callspec.id)


def test_there_are_runnable_blocks():
    assert blocks("test") and blocks("gpu")
