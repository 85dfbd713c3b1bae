"""Sessions: memory pools, the graph cache, the policy and the stats; ``capture()`` and ``graphed``.

    with capture() as cap:                 # a session: memory pool, graphs, policy, stats
        step = cap.region(decode_step)     # also usable as a decorator
        for batch in batches:
            logits = step(batch.tokens, kv_cache, replay.dynamic(pos))
    print(cap.report())

Per call of a region (replay.region): a flat call is served by its pre-key (replay.dispatch);
otherwise the key is computed. A new key runs eagerly (compiling what it needs) until it has
been called more than ``record_after`` times recently and the cache policy admits it
(replay.admission: recent frequency, ``max_graphs``, the recording budget), then is recorded
into a graph (replay.orchestration), then replayed. A key whose capture fails runs eagerly
from then on, with one warning naming the reason. replay.lifecycle holds a key's states.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import attrs
import torch

from jitcore.for_replay import get_backend
from replay import observe, polymorphic, recording
from replay.admission import Admission
from replay.compaction import Compaction
from replay.errors import SessionClosedError
from replay.graph import RecordedGraph
from replay.keying import describe_key
from replay.lifecycle import Entry, Keys
from replay.output_slots import OutputSlots, torch_stream
from replay.policy import Policy
from replay.region import Region
from replay.stats import Stats, report
from replay.warn import warn

log = logging.getLogger("replay")

#: Keys listed one by one in ``Session.report()``; the rest are summed up in one row.
REPORT_KEYS = 24


class Session:
    """A capture session: one memory pool per device, the graph cache, policy and stats."""

    #: How a key is captured and turned into a replayable graph; CPU tests of the session's
    #: logic replace these with doubles (the GPU tests run the real ones).
    record_key = staticmethod(recording.capture)
    analyse = staticmethod(recording.analyse)
    build_graph = RecordedGraph

    def __init__(self, policy: Policy | None = None, **overrides: object):
        """``policy`` (replay.Policy: the defaults where None), with ``overrides`` of its fields."""
        if policy is None:
            self.policy = Policy(**overrides)
        elif isinstance(policy, Policy):
            self.policy = attrs.evolve(policy, **overrides)
        else:
            raise TypeError(f"policy must be a replay.Policy, got {type(policy).__qualname__}")
        observe.prepare()
        self.counters = Stats()
        self.lock = threading.RLock()
        self.regions: list[Region] = []
        self.lru: OrderedDict[Entry, None] = OrderedDict()  # graphs held, least recently replayed first
        self.pending: dict[Entry, None] = {}  # recorded, not yet analysed: they take a place in the cache
        self.admission: Admission[Entry] = Admission(
            record_after=self.policy.record_after,
            max_graphs=self.policy.max_graphs,
            budget=self.policy.record_budget,
            replays=lambda entry: entry.graph.replays if entry.graph is not None else 0,
            saving=lambda entry: entry.region.cost.saving(),
        )
        self.keys = Keys(self)  # the one writer of the keys' states and indices (replay.lifecycle)
        self.compaction = Compaction(self)
        self.pools: dict[int, recording.KeptPool] = {}  # device -> the pool it records into now
        self._retired_pools: list[recording.KeptPool] = []
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._output_slots: dict[tuple[Region, int], OutputSlots] = {}  # (region, device) -> its slots
        self.last_stream: list[int | None] = [None]
        self.closed = False
        self._said_eager = False
        self._gpu = torch.cuda.is_available()  # asked once: every eager call reads it

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- regions -------------------------------------------------------------------------
    def region(self, fn: Callable | None = None, *, name: str | None = None):
        """Wrap ``fn`` as a region of this session (usable as ``@cap.region``)."""
        if fn is None:
            return lambda f: self.region(f, name=name)
        self.check_open()
        region = Region(self, fn, name)
        self.regions.append(region)
        return region

    def current_device(self) -> int:
        """The device graphs are recorded for (-1 without a GPU)."""
        return get_backend().current_device() if self._gpu else -1

    def can_record(self) -> bool:
        """Without a GPU every call runs eagerly (the same results, no graphs)."""
        return self._gpu

    def say_eager_once(self) -> None:
        if not self._said_eager:
            self._said_eager = True
            warn("no CUDA GPU: every call of this capture() session runs eagerly (the same results)")

    def check_open(self) -> None:
        if self.closed:
            raise SessionClosedError("this capture() session is closed (its with-block ended); open a new one")

    # --- resources -----------------------------------------------------------------------
    def pool(self, device: int) -> tuple:
        """The id of this session's memory pool on ``device``."""
        pool = self.pools.get(device)
        if pool is None:
            pool = self.pools[device] = recording.KeptPool(device, self.capture_stream(device))
        return pool.id

    def capture_stream(self, device: int) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def stream_switch(self, stream: int) -> None:
        """Replays of one session share a pool: order a replay on a new stream after the last
        replay on the previous one, so they never run concurrently."""
        previous = self.last_stream[0]
        if previous is not None and previous != stream:
            event = torch.cuda.Event()  # (raw handles: the default stream's is 0, see torch_stream)
            event.record(torch_stream(previous, None))
            torch_stream(stream, None).wait_event(event)
        self.last_stream[0] = stream

    def output_slots(self, region: Region, device: int) -> OutputSlots:
        """The output slots ``region``'s graphs on ``device`` share (replay.output_slots)."""
        slots = self._output_slots.get((region, device))
        if slots is None:
            target = f"cuda:{device}"
            slots = self._output_slots[(region, device)] = OutputSlots(
                lambda size: torch.empty(size, dtype=torch.uint8, device=target),
                changed=region.router.outputs_changed,  # a slot came or went
            )
        return slots

    def output_slot_ranges(self, region: Region) -> list[tuple[int, int]]:
        """The memory ``region``'s replays may write into its output slots, on every device."""
        return [span for (owner, _), slots in self._output_slots.items() if owner is region for span in slots.ranges()]

    def release_output_slots(self, region: Region | None = None) -> None:
        """Drop the output slots of ``region`` (of every region when None) once its graphs are
        gone: free ones are freed, held ones go when their outputs go."""
        for key in [k for k in self._output_slots if region is None or k[0] is region]:
            self._output_slots.pop(key).release()

    def retire_pool(self, device: int) -> None:
        """Record into a fresh pool from now on (a failed capture left the current one
        unusable for captures). Graphs recorded into the old pool keep it alive. The failure
        also gave the device's generator a new state, which graphs that draw random numbers
        no longer advance: those are dropped and record again."""
        old = self.pools.pop(device, None)
        if old is not None:
            self._retired_pools.append(old)
        for region in self.regions:
            for entry in list(region.entries.values()):
                held = entry.graph if entry.graph is not None else entry.unanalysed  # recorded or pending
                if entry.uses_rng and held is not None and held.device == device:
                    # torch registered the old state with it: its replay would advance that
                    # state (and raise, the old state being stuck in capture mode)
                    self.keys.release(entry)

    def pool_bytes(self, device: int) -> int:
        """The device's pool size, measured now (compaction compares before and after)."""
        return recording.pool_bytes(device, self.pool(device))

    def memory_bytes(self) -> int:
        """The pools' size (as each recording last measured it) plus the output memory: the
        graphs' own output buffers and the regions' output slots."""
        outputs = sum(getattr(e.graph.capture, "output_bytes", 0) for e in self.lru if e.graph is not None)
        outputs += sum(slots.nbytes() for slots in self._output_slots.values())
        retired = sum(self.known_pool_bytes(p.device, p.id) for p in self._retired_pools)
        pools = sum(self.known_pool_bytes(device) for device in self.pools)
        return pools + retired + outputs

    def known_pool_bytes(self, device: int, pool: tuple | None = None) -> int:
        """A pool's size as its last recording measured it (recording.known_pool_bytes),
        measured now if never: no allocator snapshot after every recording."""
        pool = self.pool(device) if pool is None else pool
        known = recording.known_pool_bytes(device, pool)
        if known is not None:
            return known
        return self.pool_bytes(device) if pool == self.pool(device) else recording.pool_bytes(device, pool)

    # --- the end ---------------------------------------------------------------------------
    def invalidate(self) -> None:
        """Drop every graph of the session; keys record again after their eager runs."""
        with self.lock:
            self.keys.invalidate()
            self.release_output_slots()
            self.counters.invalidations += 1
            log.info("session invalidated: every graph dropped")

    def close(self) -> None:
        if not self.closed:
            self.invalidate()
            self.counters.invalidations -= 1  # closing is not an invalidation by the user
            self._retired_pools.clear()
            self.pools.clear()  # the pools go (memory the caller still holds stays until it is freed)
            self.closed = True

    # --- introspection -------------------------------------------------------------------
    def stats(self) -> Stats:
        with self.lock:  # (memory_bytes walks the graphs another thread may be recording)
            stats = self.counters.copy()
            # measured when asked, not after every recording: it walks every graph and slot set
            stats.graph_memory_bytes = 0 if self.closed else self.memory_bytes()
        stats.calls = stats.replays + stats.eager_runs  # every call either replays or runs eagerly
        return stats

    def report(self) -> str:
        """Totals, then the most called keys (``REPORT_KEYS``) one per row, then one row per
        region for the rest: calls of keys without an entry (never recorded, or forgotten to
        keep the bookkeeping bounded) and keys beyond the listed ones. The rows add up to the
        totals."""
        text = report(self.stats(), _key_rows(self.regions) + _variant_rows(self.regions))
        if self.policy.polymorphic:
            text += "\n" + "\n".join("  " + line for region in self.regions for line in region.router.report())
        if not self.can_record():
            text += "\n  no CUDA GPU: every call ran eagerly (the same results, no graphs)"
        return text

    def dump(self) -> str:
        """The generated replay source of every graph held, each after a line saying whether
        csrc/replay_step.c runs it (and if not, why)."""
        parts = []
        for entry in self.lru:
            graph = entry.graph
            if graph is not None:
                how = graph.how_it_replays() if hasattr(graph, "how_it_replays") else "replayed by this function"
                source = graph.full_source() if hasattr(graph, "full_source") else graph.source
                parts.append(f"# {how}\n{source}")
        return "\n".join(parts)


def _key_rows(regions: Sequence[Region]) -> list[tuple]:
    """The report's rows of keys: the most called one by one, the rest summed per region."""
    keyed = []
    rest: dict[str, list[int]] = {}  # region -> [keys, calls, replays, eager runs]
    for region in regions:
        forgotten = region.forgotten
        if forgotten.eager_runs or forgotten.replays:
            calls = forgotten.eager_runs + forgotten.replays
            rest[region.name] = [0, calls, forgotten.replays, forgotten.eager_runs]
        for entry in region.entries.values():
            keyed.append((entry.replays + entry.eager_runs, region, entry))
    keyed.sort(key=lambda item: item[0], reverse=True)
    rows = []
    for calls, region, entry in keyed[:REPORT_KEYS]:
        graph = entry.graph
        state = entry.state.value if not entry.reason else f"{entry.state.value}: {entry.reason}"
        seconds = f"{graph.capture.seconds * 1e3:.2f}" if graph else "-"
        memory = f"{graph.memory / 2**20:.1f}" if graph else "-"
        rows.append(
            (region.name, describe_key(entry.key), state, calls, entry.replays, entry.eager_runs, seconds, memory)
        )
    for calls, region, entry in keyed[REPORT_KEYS:]:
        total = rest.setdefault(region.name, [0, 0, 0, 0])
        total[0] += 1
        total[1] += calls
        total[2] += entry.replays
        total[3] += entry.eager_runs
    for name, (count, calls, replays, eager_runs) in rest.items():
        described = f"({count} more keys and keys without an entry)" if count else "(keys without an entry)"
        rows.append((name, described, "-", calls, replays, eager_runs, "-", "-"))
    return rows


def _variant_rows(regions: Sequence[Region]) -> list[tuple]:
    """The report's rows of sizes served by their bucket's graph, one per region."""
    rows = []
    for region in regions:
        variants = [v for v in region.variants.values() if isinstance(v, polymorphic.VariantGraph)]
        if variants:
            replays = sum(v.replays for v in variants)
            described = f"({len(variants)} sizes served by their bucket's graph)"
            rows.append((region.name, described, "-", replays, replays, 0, "-", "-"))
    return rows


def capture(
    *,
    record_after: int = 1,
    max_graphs: int = 64,
    record_budget: float = 0.03,
    buckets: Sequence[int] | None = None,
    polymorphic: bool = False,
    clone_outputs: bool = False,
    verify_every: int = 0,
    check_stale: bool | None = None,
) -> Session:
    """A capture session (a context manager): ``with capture(record_after=1) as cap: ...``.

    Every option is a field of :class:`replay.Policy`, which says what it does and checks it:
    ``record_after`` (recent calls of a key before it may be recorded), ``max_graphs`` (graphs
    kept), ``record_budget`` (how far recording may run ahead of what replays saved), ``buckets`` (the sizes
    ``replay.padded`` arguments are padded to), ``polymorphic`` (a padded size served by its
    bucket's graph at its own size), ``clone_outputs`` (copies instead of the graph's own
    buffers), ``verify_every`` (every Nth replay also run eagerly and compared; 0: off),
    ``check_stale`` (outputs raise once a later replay overwrote them; None: where
    ``REPLAY_DEBUG=1``)."""
    options = dict(locals())
    return Session(Policy(**options))


def graphed(
    fn: Callable | None = None,
    *,
    record_after: int = 1,
    max_graphs: int = 64,
    record_budget: float = 0.03,
    buckets: Sequence[int] | None = None,
    polymorphic: bool = False,
    clone_outputs: bool = False,
    verify_every: int = 0,
    check_stale: bool | None = None,
):
    """A region with its own session: ``@graphed`` or ``@graphed(record_after=2)``; the
    options are :func:`capture`'s (replay.Policy)."""
    options = dict(locals())
    del options["fn"]
    if fn is None:
        return lambda f: graphed(f, **options)
    return Session(Policy(**options)).region(fn)
