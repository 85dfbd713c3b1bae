"""What a session did: counters, per-key details and the per-input rebinding choices."""

from __future__ import annotations

import collections

import attrs

#: Input choices a session keeps for its report (``Stats.inputs``): those of its most recent
#: recordings, whatever number of keys a loop records over its life.
MAX_INPUT_CHOICES = 4096


@attrs.define
class InputChoice:
    """How one region input is handled in one recorded graph."""

    region: str
    key: str
    input: str
    choice: str  # "rebound", "staged", "staged+copied back", "unused"
    reason: str = ""


@attrs.define
class Stats:
    """Counters of a session (``Session.stats()`` returns a copy)."""

    calls: int = 0  # replays + eager runs (filled in by Session.stats())
    replays: int = 0  # calls served by a graph launch
    records: int = 0
    record_retries: int = 0  # captures redone (a jit miss, or more inputs had to be staged)
    eager_runs: int = 0
    eager_only_keys: int = 0
    patches: int = 0  # kernel-node parameter updates pushed to graph execs
    staged_copies: int = 0  # staging copies run inside replays
    padded_in_place: int = 0  # padded arguments written straight into a graph's staged buffer (no copies)
    capture_seconds: float = 0.0
    graph_memory_bytes: int = 0  # bytes the session's memory pools hold (graph outputs, intermediates), when asked
    graphs: int = 0  # graphs currently held
    evictions: int = 0
    refused: int = 0  # recordings not admitted: every graph held was replayed more often recently
    deferred: int = 0  # recordings postponed: the recording budget was spent
    too_rare: int = 0  # recordings not made: the key's recent calls would not pay for one
    recaptures: int = 0  # graphs recorded again by compactions
    compactions: int = 0  # times the graphs of a device were recorded again into a fresh pool
    invalidations: int = 0
    verifications: int = 0
    declined: int = 0  # calls a recorded graph could not serve exactly (run eagerly instead)
    variants: int = 0  # sizes a bucket's graph serves at their own size (replay.polymorphic)
    not_polymorphic: int = 0  # sizes observed whose launches the bucket's graph cannot run: padded
    #: the most recent ``MAX_INPUT_CHOICES`` (a list in a copy)
    inputs: collections.deque[InputChoice] | list[InputChoice] = attrs.Factory(
        lambda: collections.deque(maxlen=MAX_INPUT_CHOICES)
    )

    def copy(self) -> Stats:
        return attrs.evolve(self, inputs=list(self.inputs))


def report(stats: Stats, rows: list[tuple]) -> str:
    """A readable table: totals, then one line per key, then each input's choice."""
    lines = [
        "replay session report",
        f"  calls {stats.calls}, replays {stats.replays}, eager runs {stats.eager_runs}, "
        f"records {stats.records} (retries {stats.record_retries}), eager-only keys {stats.eager_only_keys}",
        f"  node patches {stats.patches}, staged copies {stats.staged_copies} "
        f"(padded in place {stats.padded_in_place}), verifications {stats.verifications}, "
        f"declined by a graph {stats.declined}",
        f"  graphs held {stats.graphs}, evictions {stats.evictions}, not admitted {stats.refused}, "
        f"postponed by the budget {stats.deferred}, too rare to pay back {stats.too_rare}, "
        f"compactions {stats.compactions} ({stats.recaptures} graphs), "
        f"invalidations {stats.invalidations}, "
        f"capture {stats.capture_seconds * 1e3:.1f} ms, graph memory {stats.graph_memory_bytes / 2**20:.1f} MiB",
    ]
    if stats.variants or stats.not_polymorphic:
        lines.append(
            f"  polymorphic: {stats.variants} sizes served by their bucket's graph, "
            f"{stats.not_polymorphic} sizes padded instead"
        )
    if rows:
        header = ("region", "key", "state", "calls", "replays", "eager", "capture ms", "MiB")
        table = [header, *[tuple(str(c) for c in row) for row in rows]]
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        lines.append("")
        for number, row in enumerate(table):
            lines.append("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)))
            if number == 0:
                lines.append("  " + "  ".join("-" * width for width in widths))
    if stats.inputs:
        lines.append("")
        lines.append("  inputs:")
        lines.extend(f"    {line}" for line in _input_lines(stats.inputs))
    return "\n".join(lines)


def _input_lines(choices: list[InputChoice]) -> list[str]:
    """One line per (region, input, choice): a loop over many shapes makes the same choice per key,
    and listing it once per key would bury the one input that is staged in one key."""
    keys_of_region: dict[str, list[str]] = {}
    grouped: dict[tuple[str, str, str, str], list[str]] = {}
    for choice in choices:
        region_keys = keys_of_region.setdefault(choice.region, [])
        if choice.key not in region_keys:
            region_keys.append(choice.key)
        grouped.setdefault((choice.region, choice.input, choice.choice, choice.reason), []).append(choice.key)
    lines = []
    for (region, input_name, choice, reason), keys in grouped.items():
        why = f" ({reason})" if reason else ""
        total = len(keys_of_region[region])
        if total == 1:
            lines.append(f"{region} {keys[0]} {input_name}: {choice}{why}")
        elif len(keys) == total:
            lines.append(f"{region} {input_name}: {choice}{why}, in all {total} keys")
        else:
            listed = ", ".join(keys[:2]) + (", ..." if len(keys) > 2 else "")
            lines.append(f"{region} {input_name}: {choice}{why}, in {len(keys)} of {total} keys: {listed}")
    return lines
