"""Compaction: a device's graphs recorded again into a fresh pool, largest inputs first.

A recording that grew the pool substantially may have fragmented it (a bigger shape cannot
reuse the blocks smaller shapes were recorded into); recorded again into a fresh pool, the
graphs share one set of blocks. replay.admission.CompactionRule says when it is worth its
recordings; each graph's swap goes through replay.lifecycle (``recapture``).

A key is recorded again only under its own torch settings (``key[2]``): a graph bakes the
kernels torch chose under the settings it was recorded with, and a compaction runs under the
settings of the call that triggered it. A key whose settings differ now, and a key of calls
passing objects (its recording needs the caller's object, which no placeholder stands in
for), is released instead (``release``: it records again when called).
"""

from __future__ import annotations

import logging
import time

import torch

from replay import recording, torch_state
from replay.admission import CompactionRule
from replay.errors import RefusedKey

log = logging.getLogger("replay")


def recordable_now(key: tuple) -> bool:
    """Whether a compaction may record ``key`` again: under its own torch settings (those in
    force now), and from placeholders of its leaves (no object argument)."""
    if len(key[1]) > 3:
        return False
    try:
        return key[2] == torch_state.torch_modes()
    except RefusedKey:  # settings no key may be made under (an active dispatch mode)
        return False


class Compaction:
    """A session's compactions: when, and how."""

    def __init__(self, session) -> None:
        self.session = session
        self.rule = CompactionRule()
        self.enabled = True  # off for good once a compaction stops paying

    def after_record(self, entry, capture) -> None:
        """A new graph of ``capture.device`` is held: compact the device's graphs when the
        rule says it pays (and no recording budget forbids it)."""
        session = self.session
        device = capture.device
        size = session.known_pool_bytes(device)  # measured by the recording
        self.rule.recorded(device, size, capture.memory - getattr(capture, "output_bytes", 0))
        others = [e for e in session.lru if e is not entry and e.graph is not None and e.graph.device == device]
        if (
            self.enabled
            and others
            and recordable_now(entry.key)  # (its own graph is replayed next: never released here)
            and capture.memory >= max(1 << 20, size // 10)
            and self.rule.due(device, size, len(others) + 1, session.counters.records)
            and session.admission.may_record()
        ):
            self.compact(device)

    def compact(self, device: int) -> bool:
        """Record every graph of ``device`` again into a fresh pool (largest inputs first) and
        free the old pool. Keeps the old graphs if any recording fails."""
        session = self.session
        if recording.CAPTURES.holds_shared():
            return False  # inside another region's eager run: no capture can start here
        held = [e for e in session.lru if e.graph is not None and e.graph.device == device]
        entries = sorted((e for e in held if recordable_now(e.key)), key=lambda e: e.graph.input_bytes, reverse=True)
        for region in session.regions:  # captures still awaiting analysis live in the old pool:
            for entry in list(region.entries.values()):  # they go, and record again when called
                if entry.unanalysed is not None and entry.unanalysed.device == device:
                    session.keys.release(entry)
        kept = set(entries)
        for entry in held:  # as do graphs that cannot be recorded again here and now
            if entry not in kept:
                session.keys.release(entry)
        started = time.perf_counter()
        before = session.pool_bytes(device)
        new_pool = recording.KeptPool(device, session.capture_stream(device))
        fresh = self._recapture(entries, new_pool, device)
        if fresh is None:
            return False
        for entry, graph in fresh.items():
            session.keys.recapture(entry, graph)
        session.pools[device] = new_pool  # the old KeptPool goes, and with it the old pool
        with recording.CAPTURES.exclusive():  # both would break another thread's capture
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        after = session.pool_bytes(device)
        session.admission.recorded(time.perf_counter() - started)
        self.rule.done(device, after, len(fresh))
        session.counters.compactions += 1
        session.counters.recaptures += len(fresh)
        log.info(
            "cuda:%d: %d graphs recorded again into a fresh pool: %.1f MiB -> %.1f MiB",
            device,
            len(fresh),
            before / 2**20,
            after / 2**20,
        )
        if after > 0.9 * before:
            self.enabled = False
        return True

    def _recapture(self, entries: list, new_pool, device: int) -> dict | None:
        """Each entry's graph recorded again into ``new_pool``; None where one failed (the new
        graphs released, compaction off from now on)."""
        fresh: dict = {}
        try:
            for entry in entries:
                fresh[entry] = entry.region.recorder.recapture(entry, new_pool.id)
        except (recording.CaptureFailed, recording.CaptureAborted, recording.CaptureRetry) as failure:
            for graph in fresh.values():
                graph.release()
            self.enabled = False
            if isinstance(failure, recording.SpoiledPool):
                self.session.retire_pool(device)
            return None
        except BaseException:
            for graph in fresh.values():
                graph.release()
            self.enabled = False
            raise
        return fresh
