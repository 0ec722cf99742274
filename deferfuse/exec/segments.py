"""The segment tier: the block tier's choice, per segment, for work no ``with`` line marks.

A default defer mode (``TORCHTPU_MODE=defer``) has no blocks, and a ``with deferfuse.defer():``
block around a whole loop runs once: the work between two boundaries (a read of a value, an
optimizer step's end) stands for a block, its place for a ``with`` line, and each place gets a
``blocks.BlockChoice``, timed and chosen as a block's (exec/blocks.py).  ``Segments`` is the
tier's state for one mode (capture/mode.SegmentedDeferMode).
"""

from __future__ import annotations

from typing import Any, Optional

from .. import config
from ..errors import FlushReason
from ..stats import STATS
from . import blocks, executables
from .blocks import BLOCK_CREDIT_S, STREAK_MAX, BlockChoice

# A segment's first deferred run is expected to cost blocks.first_trial_estimate() and this many
# of its runs at once: recording a segment the first time (each new op's metadata inferred),
# replaying it and the compiles it starts cost 22-37 runs at once of a Llama step (3-5 s against
# 0.135 s, bench.loops), so a loop of big steps tries the deferred way once that fits its budget
# (~90 s of a Llama loop), not at its 70th step (the trial then cost a 100-step loop 20-60% of
# strict's time)
SEGMENT_TRIAL_RUNS = 30.0
NEW_READ_LOOK_S = 0.01   # how long a read the deferred way has not seen stays quiet (blocks.QUIET)
_FOR_GOOD = float("inf")


class Segments:
    """The block tier for a default defer mode (``TORCHTPU_MODE=defer``, ``set_mode("defer")``),
    where no ``with`` line marks the work (eager_segments).

    A program run under the default mode has no blocks, but its loops read values: a training
    loop prints its loss, ``generate()`` reads whether every sequence has finished, once per
    token.  The work between two such reads is a *segment*, and the place of the read that
    starts it (``.item()``, ``bool()``: aten's ``_local_scalar_dense``; a deferred tensor's
    ``format``, ``repr``, ``tolist``, ``numpy``: ``f"{loss:.4f}"``) stands for it as a
    ``with`` line stands for a block: what follows a read at that place is, run after run, the
    same code.  Each place gets a ``BlockChoice``, timed and chosen as blocks are; a segment
    that runs at once runs with nothing pending, each op on torch's kernel as it arrives (the
    recorder's ``run_at_once``), so its results are strict's.  ``generate()`` under the default
    mode was the case: every decoding step met new shapes (the KV cache grows), so it recorded,
    replayed eagerly and compiled in the background, 20 times slower than strict.

    A read is a boundary where, deferred, it had to compute its value (it flushed): an
    optimizer reading its step counter, a host scalar computed already, starts no segment.  A
    segment that ends deferred flushes everything still pending, so that its time holds all its
    work (a loss read computes the forward pass only; the backward and the optimizer's updates
    would otherwise be paid in the next segment).  Runs at once see every read; they end their
    segment at the places known as boundaries.

    The recorder calls ``observed`` after each boundary read; the segment that ended is timed,
    the next one's way is chosen."""

    __slots__ = ("choice", "started", "unsteady", "way", "created", "streak", "runs", "streak_at", "credit",
                 "trial_runs", "seed", "probe", "probe_marks", "probe_iteration")

    def __init__(self, credit: float = 0.0, trial_runs: float = SEGMENT_TRIAL_RUNS,
                 seed: Optional[tuple[float, float, int, int]] = None) -> None:
        # what a new place's choice may explore before its time has run (BlockChoice.credit) and
        # what its first deferred run is expected to cost, in its runs at once: a default mode's
        # segments start at once and try the deferred way once the budget affords a first
        # sighting; a ``with`` block's iterations (capture/mode.DeferMode.segment) ran deferred
        # already, first sightings included: they have a block's credit, no first-trial
        # estimate, and what they cost so far (``seed``: BlockChoice.loop_seed) is charged to
        # the first place they end at, so that the block and its loop share one credit
        self.credit = credit
        self.trial_runs = trial_runs
        self.seed = seed
        self.choice: Optional[BlockChoice] = None
        # a ``with`` place's first run (probing), at once: its BlockChoice; the clock and the
        # ops run at each boundary met so far, by instruction; and once a boundary came round
        # (the block holds a loop), the iteration's seconds and ops, for its place's choice
        self.probe: Optional[BlockChoice] = None
        self.probe_marks: dict = {}
        self.probe_iteration: Optional[tuple[float, int]] = None
        self.started = 0.0
        self.unsteady = 0
        self.way = False   # whether the segment running now was started at once
        self.created = blocks.clock()
        # a place settled at once (BlockChoice.settled_runs): how many more times its segment
        # may end at the same instruction (streak_at: code, offset, whether a step's end) with
        # one count each; runs: the segment's runs that the time since ``started`` holds
        self.streak = 0
        self.runs = 1
        self.streak_at: tuple = (None, -1, False)

    @classmethod
    def probing(cls, block: BlockChoice) -> "Segments":
        """The segment tier's state for the first run of the ``with`` place ``block``
        (BlockChoice.probes): it runs at once, its ops counted, until a boundary (an optimizer
        step's end, a read by the user's code) comes round at the same place: the block holds
        a loop, and its iterations are chosen for from there (``observed``), as a block's are,
        with a block's credit."""
        segments = cls(credit=BLOCK_CREDIT_S, trial_runs=0.0)
        segments.probe = block
        return segments

    def _loop_found(self, recorder: Any, place: Any, reason: FlushReason) -> bool:
        """In a block's first run (``probe``): whether the boundary at ``place`` came round,
        its iteration's time and ops then kept (probe_iteration) and the probe over.  A place
        here is its instruction (a SourceLine), not its line: at once every read is seen, and
        two on one line (``print(loss.item(), acc.item())`` in a block per step) are no loop.
        (Deferred, only the first of them computes values, so a line is a boundary's key.)"""
        key = (reason is FlushReason.STEP, place)
        now, ops = blocks.clock(), recorder.ops_at_once
        seen = self.probe_marks.get(key)
        if seen is None:
            self.probe_marks[key] = (now, ops)
            return False
        self.probe.holds_loop = True
        self.probe = None
        self.probe_marks = {}
        self.probe_iteration = (now - seen[0], ops - seen[1])
        return True

    def note_read(self, place: Any) -> None:
        """A read at ``place`` ran deferred and did not flush: no boundary."""
        key = _segment_key(place)
        if key not in blocks.READS:
            if len(blocks.READS) >= blocks.MAX_PLACES:
                blocks.READS.clear()
                blocks.QUIET.clear()
            blocks.READS.add(key)

    @staticmethod
    def known_quiet(frame: Any) -> bool:
        """Whether a read by the user's ``frame`` is one the segment running at once passes by
        (``quiet`` said so, since the tables last changed and within its time)."""
        until = blocks.QUIET.get((frame.f_code, frame.f_lasti))
        return until is not None and (until is _FOR_GOOD or blocks.clock() < until)

    @staticmethod
    def quiet(frame: Any, new: bool) -> None:
        """A read by the user's ``frame`` was found to be no boundary: one the deferred way has
        seen, or (``new``) one it has not but that may not be learned yet (``may_discover``)."""
        if len(blocks.QUIET) >= blocks.MAX_PLACES:
            blocks.QUIET.clear()
        blocks.QUIET[(frame.f_code, frame.f_lasti)] = blocks.clock() + NEW_READ_LOOK_S if new else _FOR_GOOD

    @staticmethod
    def is_new_read(place: Any) -> bool:
        """Whether the deferred way has never run a read at ``place`` (boundary or not)."""
        key = _segment_key(place)
        return key not in blocks.READS and key not in blocks.PLACES

    def discover(self, recorder: Any) -> None:
        """End the segment running at once here, untimed (it ran into code its place does not
        stand for), and run deferred until the next boundary, which the deferred way finds."""
        if self.choice is not None and self.way:
            STATS.blocks_run_at_once += 1
        self.choice = None
        self.probe = None   # (a block's first run, now deferred: untimed)
        self.streak = 0
        self.way = recorder.at_once_segment = False
        executables.allow_compiles(None)

    def may_discover(self) -> bool:
        """Before any boundary is known (no step has ended, no read has flushed), the default
        mode runs at once; whether it may now run deferred, to find its boundaries: once the
        program has run long enough that what a first deferred run costs (starting JAX, the
        first metadata inference) is within explore_share of its time."""
        share = config.get("explore_share")
        if share >= 1.0 or not config.shortcuts().segments_timed:
            return True
        expected = blocks.first_trial_estimate()
        choice = self.choice
        if choice is not None and choice.reference:
            # (the segment running at once, a training step say, measured: a first deferred
            # run of it costs SEGMENT_TRIAL_RUNS of its runs at once)
            expected += SEGMENT_TRIAL_RUNS * choice.at_once_median()
        return (blocks.clock() - self.created) * share >= expected

    @staticmethod
    def starts_segments(place: Any) -> bool:
        """Whether a read at ``place`` ends a segment (it flushed when its segment ran deferred)."""
        return _segment_key(place) in blocks.PLACES

    def observed(self, recorder: Any, place: Any, reason: FlushReason = FlushReason.SYNC) -> None:
        """A value was read at ``place`` (a SourceLine), or a step ended there (``reason``
        STEP: capture/steps.py); ``recorder``: the default mode's."""
        if self.probe is not None and not self._loop_found(recorder, place, reason):
            return   # (a block's first run, at once, counting: no loop found yet)
        if self.streak and recorder.at_once_segment and place is not None \
                and self.streak_at == (place.code, place.lasti, reason is FlushReason.STEP) \
                and config.shortcuts().segments_timed:
            # (settled at once, and ending where it ended: counted, timed with the streak's end)
            self.streak -= 1
            self.runs += 1
            STATS.blocks_run_at_once += 1
            return
        self.streak = 0
        choice = self.choice
        if not recorder.at_once_segment:
            recorder.flush_all(reason)   # (the segment's work, all of it, in its time)
        if not config.shortcuts().segments_timed:
            # (the tier is off now: torch.use_deterministic_algorithms(True), always_compile)
            self.choice = None
            self.way = recorder.at_once_segment = False
            return
        if choice is not None:
            at_once = recorder.at_once_segment
            if at_once == self.way:   # (not timed: a segment that could not run as chosen)
                steady = at_once or blocks.unsteady_count() == self.unsteady
                choice.finished(blocks.clock() - self.started, steady, at_once, self.runs)
            if at_once:
                STATS.blocks_run_at_once += 1
        # (a step's end and the reads inside the step, an optimizer's step.item(), share the
        # user's line: keyed apart, so those reads never end a segment)
        step = reason is FlushReason.STEP
        key = _segment_key(place, "step" if step else "segment")
        choice = blocks.PLACES.get(key)
        if choice is None:
            if len(blocks.PLACES) >= blocks.MAX_PLACES:
                blocks.PLACES.clear()
            what = "steps ending" if step else "reads starting segments"
            choice = blocks.PLACES[key] = BlockChoice(f"{place} ({what})", credit=self.credit,
                                                trial_runs=self.trial_runs)
            blocks.QUIET.clear()
            if self.seed is not None:
                choice.seeded(*self.seed)
            elif self.probe_iteration is not None:
                seconds, ops = self.probe_iteration
                choice.probed(ops, seconds)
        self.seed = None
        self.probe_iteration = None
        self.choice = choice
        self.way = recorder.at_once_segment = choice.runs_at_once   # (nothing pending: flushed above)
        choice.starting(self.way)
        self.unsteady = blocks.unsteady_count()
        self.runs = 1
        if self.way and place is not None:
            self.streak = choice.settled_runs()
            self.streak_at = (place.code, place.lasti, step)
        self.started = blocks.clock()


def _segment_key(place: Any, kind: str = "segment") -> tuple:
    """A read's place (a SourceLine) as a segment's key: its file, function and line, not its
    bytecode offset.  CPython 3.11 reports a call to a C function (``bool(t)``) at the call's
    own instruction until the interpreter specializes it, and at the instruction before once it
    has: the same read, run deferred (a Python-level ``__bool__``) and at once, had two offsets,
    so a segment running at once never met its end and ran at once for good, unmeasured."""
    if place is None:
        return (kind, None)
    code = place.code
    return (kind, code.co_filename, code.co_firstlineno, place.line)
