"""Recording helpers that need no GPU (the captures themselves are tested on the GPU)."""

from __future__ import annotations

from replay.recording import _first_line


def test_a_failure_without_a_message_still_has_a_reason():
    # a capture that fails with an exception whose message is empty must still end in a
    # ReplayWarning naming something, never an IndexError that hides the eager fallback
    assert _first_line(RuntimeError("")) == "RuntimeError"
    assert _first_line(RuntimeError("   \n  ")) == "RuntimeError"
    assert _first_line(RuntimeError("first\nsecond")) == "first"
