"""Pieces of replay.recording that need a GPU (the capture itself is tested through sessions,
in test_replay_gpu.py and test_hazards_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from replay.recording import _OnStream

pytestmark = pytest.mark.gpu


def test_a_capture_stream_is_current_inside_and_the_callers_after_even_on_error():
    device = torch.cuda.current_device()
    caller, capture = torch.cuda.Stream(device), torch.cuda.Stream(device)
    with torch.cuda.stream(caller):
        with _OnStream(capture):
            assert torch.cuda.current_stream() == capture
        assert torch.cuda.current_stream() == caller
        with pytest.raises(ZeroDivisionError), _OnStream(capture):
            assert torch.cuda.current_stream() == capture
            1 / 0  # noqa: B018
        assert torch.cuda.current_stream() == caller and torch.cuda.current_device() == device


@pytest.mark.multigpu
def test_a_stream_of_another_device_switches_the_device_as_torchs_context_does():
    other = 1 - torch.cuda.current_device()
    stream = torch.cuda.Stream(other)
    before = torch.cuda.current_device()
    with _OnStream(stream):
        assert torch.cuda.current_device() == other and torch.cuda.current_stream() == stream
    assert torch.cuda.current_device() == before
