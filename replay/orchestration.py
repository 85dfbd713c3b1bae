"""A key's recording, orchestrated: capture, first launch, analysis into a graph, recapture,
retry, give up.

replay.recording captures and analyses; replay.graph builds the replay; this module says in
which order, on which of the key's calls, and what a failure does to the key: every change of
its state goes through replay.lifecycle. A capture is launched once at once (the call's
result); its analysis waits for the key's next call, so a key called once is never analysed.
"""

from __future__ import annotations

import functools
import logging
import time

import attrs
import torch

import jitcore
from jitcore.for_replay import CaptureBusy, get_backend
from replay import effects, instrumentation, objects, recording, region_keys
from replay.dispatch import MISS, SHARED_CAPTURE_EXCLUSION, flat_guard
from replay.errors import RefusedKey
from replay.graph import RecordedGraph
from replay.graph_outputs import stale_guard
from replay.keying import KeyText, describe_key
from replay.lifecycle import ANALYSING, WARMING, Entry
from replay.observe import op_observer
from replay.rebinding import STAGED
from replay.region_keys import FlatCall
from replay.stats import InputChoice
from replay.warn import warn

log = logging.getLogger("replay")

#: Captures the analysis may ask for with more inputs staged before the key gives up.
MAX_RESTAGES = 2
#: Recordings the analysis may turn down (recording.RecordLater) before the key gives up.
MAX_LATER = 3


@attrs.define
class Hints:
    """What the keys of one argument structure (spec) of a region taught about its inputs:
    which ones torch ops read or write (to be staged, or copied back), from an observed
    warm-up and from analyses of their graphs. A new key of the spec starts from them, so
    its first calls need no observer of their own (they cost what eager costs) and its first
    capture rarely needs a second. Hints only choose what a first capture stages: the
    analysis of every graph still checks each input exactly."""

    observed_key: tuple | None = None  # the key whose warm-up ran under the observer
    stage: set[int] = attrs.Factory(set)
    copy_back: set[int] = attrs.Factory(set)
    clean: bool = False  # the observed warm-up saw no torch op touch an input
    #: Tensors of object arguments that nodes replay cannot rebind read or write (torch ops:
    #: the warm-up's observer, or an analysis asking to stage them): keyed by their address,
    #: since nothing can stage what the region reads through an object (region_keys.region_key).
    addressed: set[int] = attrs.Factory(set)
    #: What the observed warm-up did that no graph replays (replay.effects), if anything.
    effect: effects.Effect | None = None
    #: Why keys of this structure run eagerly under grad mode ("" if nothing says so): the
    #: observed warm-up ran under grad mode, none of its tensor arguments required grad, and
    #: outputs did (weights the region reads that require grad, as module parameters do).
    autograd: str = ""


class KeyRecorder:
    """The recording of one region's keys."""

    def __init__(self, region) -> None:
        self.region = region

    def tensors_held_by_name(self) -> recording.HeldTensors:
        """The tensors the region reaches other than through its arguments: those its globals
        and closures hold (the snapshot's), and a module region's parameters and buffers
        (``forward`` reads them as attributes, which the snapshot does not follow). An
        argument that is one of them is reached both ways (recording.input_doubts)."""
        region = self.region
        named = region.snapshot.tensors_by_name() if region.snapshot is not None else jitcore.TensorsByName([], True)
        module = region.fn if isinstance(region.fn, torch.nn.Module) else getattr(region.fn, "__self__", None)
        attributes = [*module.parameters(), *module.buffers()] if isinstance(module, torch.nn.Module) else []
        watched = getattr(getattr(region.snapshot, "watch", None), "tensors", ())
        return recording.HeldTensors(named.tensors, attributes, complete=named.complete, watched=watched)

    # --- the observed warm-up -------------------------------------------------------------------
    def observed_warm_up(self, call: FlatCall, entry: Entry | None, key: tuple, device: int):
        """The first warm-up of an argument structure, run eagerly under the torch-op observer
        (:meth:`_observed_run`): what it teaches the structure's keys, and, where it did what no
        graph replays, its key refused (as the key is computed after it, with the addresses it
        taught)."""
        region = self.region
        observed = region.hints[call.spec] = Hints(observed_key=key)
        result = self._observed_run(call, entry, observed)
        if observed.effect is not None:
            try:  # (a torch setting the run changed: the key of the settings it began with)
                key = key if observed.effect.settings else region.keying.key_of(call, device)
            except RefusedKey:
                pass
            self.refuse_replays(key, observed.effect)
        return result

    def _observed_run(self, call: FlatCall, entry: Entry | None, observed: Hints):
        """An eager run of ``call`` (counted under ``entry``) that fills ``observed``: which
        tensor arguments torch ops read and write (staged, copied back, or for an object's
        tensors keyed by address), what it did that no graph replays, and whether its outputs
        require grad where no argument does."""
        region = self.region
        region.count_eager(entry)
        leaves = call.leaves
        args, kwargs = region_keys.unflatten(call.spec, region_keys.plain_leaves(leaves))
        tensors = [(i, leaf) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        observer = op_observer([region_keys.byte_range(t) for _, t in tensors])
        run = effects.RunEffects.before(call)
        with SHARED_CAPTURE_EXCLUSION, observer:
            result = region.fn(*args, **kwargs)
        observed.effect = run.after()
        read, written = {tensors[w][0] for w in observer.read}, {tensors[w][0] for w in observer.written}
        shadows = objects.shadow_tensors(call.spec, leaves)  # (an object's tensors: keyed by address)
        observed.addressed |= (read | written) & shadows
        observed.stage |= read - shadows
        observed.copy_back |= written - shadows
        observed.clean = not observer.read and not observer.written
        if torch.is_grad_enabled() and not region_keys.grad_leaves(observed.observed_key or ()):
            # no argument required grad, so outputs that do come from what the region reads
            # (its weights): its keys under grad mode would record a graph that drops them
            grads = region_keys.outputs_requiring_grad(result)
            if grads:
                shown = f"{', '.join(grads[:3])}{', ...' if len(grads) > 3 else ''}"
                observed.autograd = (
                    f"{shown} of an eager run required grad with no argument requiring it (tensors the region "
                    "reads require it: module parameters do by default)"
                )
        return result

    def refuse_replays(self, key: tuple, effect: effects.Effect) -> None:
        """``key``'s run did what no graph replays: it never records (and its capture, if it
        has one, is given up at its next call). Warned once per reason; quietly the first
        time an object's structure changes at a path (a first call's lazy initialisation: a
        key of its own, which the next calls do not share)."""
        region = self.region
        region.unreplayable.mark(key, effect.reason)
        changed = effect.changed
        if changed is not None and not region.unreplayable.structure_seen_before(changed, effect.path):
            log.info("region %s: a key runs eagerly: %s", region.name, effect.reason)
            return
        region.warn_once(effect.reason)

    # --- the first call: capture and launch ---------------------------------------------------
    def record(self, entry: Entry, key: tuple, call: FlatCall, device: int):
        """Capture the key and launch the new graph once (this call's result). The analysis
        and the replay code wait for the key's next call (see :meth:`finish`)."""
        region, session = self.region, self.region.session
        with session.lock:
            if entry.state is not WARMING and entry.state is not ANALYSING:
                # another thread recorded the key while this call waited for the lock (or its
                # capture runs on this thread): served as its state says, else eagerly
                served = region.serve_entry(entry, key, call, device)
                return region.run_eagerly(call, entry) if served is MISS else served
            region.take_snapshot()
            session.keys.record(entry)
            run = effects.RunEffects.before(call)
            started = time.perf_counter()
            try:
                capture = self._capture(entry, key, call, device)
            except CaptureBusy:
                session.keys.stop_recording(entry, "retry")
                return region.run_eagerly(call, entry)  # called inside another region's eager run
            except recording.CaptureAborted as aborted:
                return self._retry_later(entry, call, aborted)
            except recording.CaptureFailed as failure:
                if isinstance(failure, recording.SpoiledPool):
                    session.retire_pool(device)
                return self._give_up(entry, call, failure.reason)
            except BaseException:
                session.keys.stop_recording(entry, "retry")
                raise
            finally:
                session.admission.captured(time.perf_counter() - started)  # failed captures cost time too
            session.keys.capture(entry, capture)
            self._judge_captured_run(key, run)
            return self._first_launch(entry, key, capture, call.leaves)

    def _judge_captured_run(self, key: tuple, run: effects.RunEffects) -> None:
        """After a capture: a key whose run did what no graph replays (replay.effects) is
        unreplayable; its next call gives it up (its capture waits there, as any capture
        does) and runs eagerly. This call is exact: its Python ran once, its graph launches
        once. State the watch sees is refused where the key's captured run changed it twice
        (the first change re-keys the region, as any change of its globals does: a closed-over
        cache's lazy initialisation)."""
        region = self.region
        effect = run.after()
        if effect is None:
            changed = effects.watched_change(region.snapshot)
            if changed is not None and region.unreplayable.suspected_before(key, changed):
                effect = effects.Effect(effects.assignment(changed), changed)
        if effect is not None:
            self.refuse_replays(key, effect)

    def _capture(self, entry: Entry, key: tuple, call: FlatCall, device: int):
        region, session = self.region, self.region.session
        # Arguments that overlap each other are never staged by a first capture (a warm-up
        # hint): staged apart, they would stop sharing memory, which is exact only once an
        # analysis of the graph has shown that nothing writes them.
        overlapping = set() if entry.analysed_staging else {i for pair in key[3] for i in pair}
        shadows = objects.shadow_tensors(call.spec, call.leaves)
        return session.record_key(
            region.fn,
            call.spec,
            objects.recording_leaves(call.leaves, region_keys.addressed_leaves(key)),
            call.paths,
            device=device,
            pool=session.pool(device),
            stream=session.capture_stream(device),
            stage=entry.stage_hint - overlapping - shadows,
            copy_back=entry.copy_back_hint - overlapping - shadows,
            observe=not entry.observed_clean,
            storages=session.policy.polymorphic,
            held=self.tensors_held_by_name(),
            **({"shadows": shadows} if shadows else {}),
        )

    def _first_launch(self, entry: Entry, key: tuple, capture, leaves: list):
        """Launch the new capture once: its outputs are this call's result."""
        region, session = self.region, self.region.session
        stats = session.counters
        stats.records += 1
        stats.replays += 1  # the first launch of the new graph serves this call
        entry.replays_before += 1
        stats.capture_seconds += capture.seconds
        log.info(
            "region %s, key %s: recorded in %.2f ms, %.1f MiB",
            region.name,
            KeyText(key),
            capture.seconds * 1e3,
            capture.memory / 2**20,
        )
        device = capture.device
        session.stream_switch(get_backend().current_stream(device))
        generator = _cuda_generator(device)
        offset = generator.get_offset() if generator is not None else 0
        capture.graph.replay()  # torch's replay: it advances the generators the graph draws from
        if getattr(capture, "host", None) is not None:
            capture.host.launched()  # it reads the host inputs' pinned buffers until done
        entry.uses_rng = generator is not None and generator.get_offset() != offset
        entry.rng_epoch = recording.GENERATOR_EPOCH[0]
        hand_out = None  # what a replay does to the outputs in the graph's memory, and to nothing else
        if session.policy.clone_outputs:
            hand_out = torch.Tensor.clone
        elif session.policy.check_stale:
            hand_out = functools.partial(stale_guard, owner=entry)
        return recording.first_outputs(capture, leaves, hand_out)

    # --- the next call: analysis into a graph --------------------------------------------------
    def finish(self, entry: Entry, key: tuple, call: FlatCall, device: int):
        """The key's next call: analyse its capture and build the replay (or record again
        with more inputs staged, or give up), then replay."""
        region, session = self.region, self.region.session
        with session.lock:
            capture = session.keys.analyse(entry)
            unreplayable = region.unreplayable.reason(key)
            if unreplayable is not None:  # its captured run did what no graph replays
                capture.graph.reset()
                session.keys.stop_recording(entry, "give_up", unreplayable)
                return region.run_eagerly(call, entry)
            analysed = time.perf_counter()
            leaves = objects.graph_leaves(call.spec, call.leaves, region_keys.addressed_leaves(key))
            try:
                try:
                    session.analyse(capture)
                    instrumentation.steps.start()
                    graph = session.build_graph(
                        region, key, capture, call.spec, leaves, call.paths, session, len(session.lru)
                    )
                    instrumentation.steps.mark("build replay")
                finally:  # charged before a failure records again: failed analyses cost time too
                    session.admission.analysed(time.perf_counter() - analysed)
            except recording.CaptureFailed as failure:
                capture.graph.reset()
                return self._give_up(entry, call, failure.reason)
            except recording.CaptureAborted as aborted:
                capture.graph.reset()
                return self._retry_later(entry, call, aborted)
            except recording.CaptureRetry as retry:
                capture.graph.reset()
                return self._restage(entry, key, call, device, retry.args[0])
            except BaseException:  # anything else (a driver error): leave nothing half-built
                capture.graph.reset()
                session.keys.stop_recording(entry, "retry")
                raise
            session.keys.serve(entry, graph, *flat_guard(key[0], call.spec, call.leaves))
            self._note_input_choices(key, capture)
            session.compaction.after_record(entry, capture)
            return region.replay(entry, call)

    def _restage(self, entry: Entry, key: tuple, call: FlatCall, device: int, plan):
        """The analysis found inputs to stage or copy back that the capture did not: record
        again with them (the structure's hints learn them too), three captures at most.
        Tensors of object arguments among them are never staged: keyed by their address
        instead (:meth:`_address`)."""
        shadows = objects.shadow_tensors(call.spec, call.leaves)
        if (plan.needs_staging | plan.needs_copy_back) & shadows:
            return self._address(entry, call, plan, shadows)
        entry.stage_hint |= plan.needs_staging
        entry.copy_back_hint |= plan.needs_copy_back
        hints = self.region.hints.setdefault(call.spec, Hints())
        hints.stage |= plan.needs_staging
        hints.copy_back |= plan.needs_copy_back
        entry.analysed_staging = True
        entry.retries += 1
        self.region.session.counters.record_retries += 1
        if entry.retries > MAX_RESTAGES:
            return self._give_up(entry, call, "staging did not settle after three captures")
        return self.record(entry, key, call, device)

    def _address(self, entry: Entry, call: FlatCall, plan, shadows: frozenset[int]):
        """The analysis found tensors of object arguments that a node replay cannot rebind
        reads or writes: the region reads them through the object, so no staged copy can stand
        in. The structure's keys hold their addresses from now on (Hints.addressed), so this
        call has another key, recorded now, its other inputs staged as the plan says; the
        key without addresses is left (the region's keys of this structure are never it
        again: a bounded idle entry)."""
        region, session = self.region, self.region.session
        hints = region.hints.setdefault(call.spec, Hints())
        hints.addressed |= (plan.needs_staging | plan.needs_copy_back) & shadows
        hints.stage |= plan.needs_staging - shadows
        hints.copy_back |= plan.needs_copy_back - shadows
        session.counters.record_retries += 1
        session.keys.stop_recording(entry, "retry")
        return region.keyed_call_recorded(call)

    def _note_input_choices(self, key: tuple, capture) -> None:
        """The session's report of how each input of the new graph is handled."""
        name, described = self.region.name, describe_key(key)
        inputs = self.region.session.counters.inputs
        for input_range in capture.inputs:
            choice = capture.plan.choices.get(input_range.index, "unused")
            if choice == STAGED and input_range.index in capture.copied_back:
                choice = "staged+copied back"
            reason = "; ".join(capture.plan.reasons.get(input_range.index, []))
            inputs.append(InputChoice(name, described, input_range.path, choice, reason))
        host = getattr(capture, "host", None)
        for i in sorted(host.buffers) if host is not None else ():
            inputs.append(InputChoice(name, described, host.paths[i], STAGED, "a host tensor: through a pinned buffer"))

    def recapture(self, entry: Entry, pool: tuple) -> RecordedGraph:
        """Record ``entry``'s key again into ``pool``, from placeholders of its inputs."""
        region, session = self.region, self.region.session
        old = entry.graph
        leaves = old.placeholder_leaves()
        capture = session.record_key(
            region.fn,
            old.spec,
            leaves,
            old.paths,
            device=old.device,
            pool=pool,
            stream=session.capture_stream(old.device),
            stage=entry.stage_hint,
            copy_back=entry.copy_back_hint,
            storages=session.policy.polymorphic,
        )
        session.counters.capture_seconds += capture.seconds
        try:
            session.analyse(capture)
            entry.rng_epoch = recording.GENERATOR_EPOCH[0]  # registered with today's generator state
            return session.build_graph(
                region, entry.key, capture, old.spec, leaves, old.paths, session, len(session.lru)
            )
        except BaseException:
            capture.graph.reset()
            raise

    # --- failures ------------------------------------------------------------------------------
    def _retry_later(self, entry: Entry, call: FlatCall, aborted: Exception):
        """This call runs eagerly (compiling what the capture could not); the key records
        again on a later call. Recordings the analysis turned down (``RecordLater``) are
        retried ``MAX_LATER`` times at most."""
        region = self.region
        region.session.counters.record_retries += 1
        log.info("region %s, key %s: recording retried later: %s", region.name, KeyText(entry.key), aborted)
        if isinstance(aborted, recording.RecordLater):
            entry.later += 1
            if entry.later > MAX_LATER:
                return self._give_up(entry, call, f"recording kept failing: {aborted}")
        region.session.keys.stop_recording(entry, "retry")
        return region.run_eagerly(call, entry)

    def _give_up(self, entry: Entry, call: FlatCall, reason: str):
        region = self.region
        region.session.keys.stop_recording(entry, "give_up", reason)
        log.info("region %s, key %s: runs eagerly from now on: %s", region.name, KeyText(entry.key), reason)
        warn(f"region {region.name}, key {describe_key(entry.key)}: runs eagerly from now on: {reason}")
        return region.run_eagerly(call, entry)

    def refuse_unreplayable(self, entry: Entry, call: FlatCall, why: str):
        """A key whose run did what no graph replays (replay.effects), about to record: it
        runs eagerly from now on (warned where it was seen)."""
        self.region.session.keys.refuse(entry, why)
        log.info("region %s, key %s: runs eagerly from now on: %s", self.region.name, KeyText(entry.key), why)
        return self.region.run_eagerly(call, entry)

    def refuse_autograd(self, entry: Entry, call: FlatCall, why: str):
        """The key runs eagerly from now on (exactly as eager: outputs keep their ``grad_fn``),
        with one ReplayWarning per region saying why and what to do. The key holds grad mode
        and which tensors require grad, so the same shapes under ``torch.no_grad()``, or with
        tensors that do not require grad, are other keys: they record and replay as usual."""
        region = self.region
        reason = f"under grad mode {why}; a graph cannot record autograd"
        region.session.keys.refuse(entry, reason)
        log.info("region %s, key %s: runs eagerly from now on: %s", region.name, KeyText(entry.key), reason)
        if not region.said_autograd:
            region.said_autograd = True
            warn(
                f"region {region.name}: runs eagerly under grad mode: {why}, and a CUDA graph cannot record "
                "autograd (its outputs would come back without grad_fn, and gradients would be lost). Run the "
                "loop under torch.no_grad() or torch.inference_mode() to replay it"
            )
        return region.run_eagerly(call, entry)


def _cuda_generator(device: int):
    try:
        return torch.cuda.default_generators[device]
    except (IndexError, RuntimeError, AttributeError):
        return None
