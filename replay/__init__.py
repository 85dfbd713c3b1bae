"""replay: record sequences of jit launches (and torch ops) into CUDA/HIP graphs, keyed by the
shape-exact signatures of a region's arguments; replay them with one graph launch, rebinding
new input pointers and dynamic scalars exactly; run eagerly whatever cannot be replayed.

    from replay import capture, dynamic

    with capture() as cap:
        step = cap.region(decode_step)
        for batch in batches:
            logits = step(batch.tokens, kv_cache, dynamic(pos))
    print(cap.report())

See docs/replay.md for the semantics (keys, rebinding vs staging, output lifetime).
"""

from jitcore import __version__ as __version__
from replay.buckets import Padded, padded
from replay.dynamic import Dynamic, DynamicScalar, dynamic
from replay.errors import (
    DynamicScalarError,
    ReplayError,
    ReplayMismatchError,
    ReplayWarning,
    SessionClosedError,
    StaleOutputError,
)
from replay.policy import Policy
from replay.region import Region
from replay.session import Session, capture, graphed
from replay.stats import InputChoice, Stats
from replay.triton_launches import record_triton_launches

__all__ = [
    "Dynamic",
    "DynamicScalar",
    "DynamicScalarError",
    "InputChoice",
    "Padded",
    "Policy",
    "Region",
    "ReplayError",
    "ReplayMismatchError",
    "ReplayWarning",
    "Session",
    "SessionClosedError",
    "Stats",
    "StaleOutputError",
    "capture",
    "dynamic",
    "graphed",
    "padded",
    "record_triton_launches",
]
