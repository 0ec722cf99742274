"""The block tier: a ``with deferfuse.defer():`` block that runs faster at once runs at once.

Deferring pays when fusion saves more memory passes than recording and flushing cost.  On a
block of a few ops over small tensors, or of ops that torch runs on its own kernels anyway, it
does not: recording costs ~10 µs an op, a flush ~0.1 ms, and the block ends slower than strict.
The engine choice inside a flush (eager replay against XLA, ``autotune_engine``) cannot help
there, because recording is paid before the flush sees the graph.  So the choice is made one
level up, per place in the code where a block starts (the ``with`` line):

1. its runs alternate, deferred and at once, until each way has five timed runs; a deferred run
   is timed if it ran *steady* (no compile, no cache miss, no disk-cache load, no engine
   choice made: the steady state the program will stay in), or once the place has had three
   unsteady runs (below); the first timed run is deferred;
2. a run at once runs under no deferfuse mode at all, which is strict (plain tensors out,
   torch's kernels, nothing recorded);
3. the way with the faster median wins, ties to deferred, if one way was faster in at least
   three quarters of the pairs of runs (deferred against at once); when the two overlap more
   than that, both go on alternating, up to 15 runs each, and then the medians decide (a GPT
   training step chose at once in one of three fresh processes on 5 + 5 runs, although its
   deferred runs were 1.18x faster over 30 steps).  Alternating puts both ways under the
   same load.  (Measured otherwise, in two ``make bench`` runs on a 2-core VM: three deferred
   runs, then three at once, chose deferred for a LayerNorm whose deferred runs were 18% slower
   in the table; the best of three chose deferred for an MLP block whose deferred runs were
   bimodal, 12 or 15-22 ms, against 12.5 at once.)

The choice is checked again after 64 runs, then after twice as many each time it holds (up to
4096).  A run that takes over twice, or under half, the chosen way's median (and 0.2 ms more or
less: tiny blocks jitter by 2x) twice in a row means the block changed (a helper called with
other shapes, say): the place measures again.

A place whose deferred runs do not settle is timed as it runs from its fourth unsteady run on:
what it costs unsettled is what its user pays.  ``generate()`` with a KV cache is the case in
point: the cache grows by a token at every decoding step, so each step's graph has new shapes
and every call compiles (on the background thread, which takes a core from everything else) or
replays graphs it has not run compiled; timed only when steady, such a place was never timed and
ran deferred for good, 4 to 40 times slower than strict.  A training step whose first compile
outlasts three runs is timed on its eager replays meanwhile, chooses at once if those are slower
than strict, and is measured again, compiled, at its recheck.
A block running at once is strict mode itself, so results are exactly strict's; both ways are
observationally equivalent, as every defer run is.  ``deferfuse.explain()`` lists each place's
choice and its times; ``stats()["blocks_run_at_once"]`` counts the runs.

**Remembered.**  A choice made on times is kept in the disk cache (exec/diskcache.py,
``save_choice``), keyed by the ``with`` line, its function's bytecode, deferfuse's sources,
torch's version, the CPU and the settings.  A later process starts the place from it (once per
place per process: ``forget()`` still makes places measure again), its times included, and
checks it when it would have been checked in that process (after FIRST_RECHECK runs, or as
many more as the choice held at rechecks: a recheck costs what a first deferred run costs,
imports included); a block that changed meanwhile (other shapes, a helper edited) shows as
drift against this process's own runs and measures again.  A first measurement is kept as it
goes too (a small file written after each timed run, ~0.35 ms), so that a process that ran the
block too few times to choose leaves its timed runs to the next one, which times the rest.
This is what a warm start of a block that runs at once needs: its first runs are strict's, with
no JAX imported, no executable loaded and no deferred run that records, loads and replays
(bench/warm_start.py: 0.64 s over strict's 20 calls before, 0.002 s after).  The setting
``remember_blocks`` (on by default) turns it off, as ``cache_dir=""`` does.

Only an outermost defer block is chosen for (not one inside another defer or debug block, nor
under ``TORCHTPU_MODE=defer``, whose work exec/segments.Segments times), and not with
``always_compile``.  The setting ``eager_blocks`` turns the tier off.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import sys
import time
from typing import Any, Optional

from .. import config
from ..errors import FlushReason
from ..stats import STATS, startup_seconds
from . import diskcache, executables

log = logging.getLogger("deferfuse")

SAMPLES = 5             # timed runs of each way before choosing ...
CLEAR = 0.75            # ... if one way was faster in this share of the pairs of runs, else
MAX_SAMPLES = 15        # ... both go on, up to this many runs each, and the medians decide
FIRST_RECHECK = 64      # runs after a choice before it is measured again
LAST_RECHECK = 4096     # the longest wait, reached by doubling while a choice holds
UNSTEADY_UNTIMED = 3    # unsteady deferred runs not timed (first sightings, compiles); later ones are
DRIFT = 2.0             # a run this many times off the chosen way's median is an outlier ...
DRIFT_FLOOR = 2e-4      # ... and this many seconds off it (a 0.1 ms block jitters by 2x)
MAX_PLACES = 4096      # the table is emptied past this many places
# A default mode's segment settled at once (chosen so, or waiting for the budget to try the
# deferred way) ends where it ended before up to this many times with one count each, and its
# time and choice are looked at once after them (Segments.observed): a training step of 1 ms
# read every step then pays ~1 us for the tier, not the ~15 us of timing each run
STREAK_MAX = 32

# A ``with deferfuse.defer():`` place's exploration credit: the user asked to defer there, so
# it tries the deferred way from its first run, its first compile included where that is cheap
# (a GELU chain: tens of ms), while a model step's compile (seconds) waits for the budget
BLOCK_CREDIT_S = 1.0
# ... while its first deferred run shows the rest of the exploration cheap.  Once that run is
# priced against a run at once, the credit ends (the rest waits for the budget) if it cost more
# than CHEAP_FIRST_RUNS runs at once over one (many ops over small tensors: each op's first
# sighting, its metadata inferred, ~0.7 ms an op), or if what exploring on is expected to cost
# (UNSTEADY_UNTIMED more such runs, and compiling the ops it recorded, a core's share) is over
# the credit.  Measured before (bench.loops --way step-block, 100 steps): a ResNet step per block
# spent 0.4 s on its first deferred run, 18 runs at once, then 2 s more on three deferred runs
# and a compile, 1.83x strict's 2.1 s; a Llama step's first run recorded 1,300 ops, whose
# compiles took ~2 s of a core.  A GELU chain over 2^21 floats: ~2 runs, 40 ops: it explores.
CHEAP_FIRST_RUNS = 4.0
# A first deferred run's cost over at once, per op a new ``with`` place's first run ran at once
# (BlockChoice.probes): each op's first sighting and the eager replay (bench.loops, a step per
# block: 0.14-0.34 ms an op on the zoo's steps and an MLP's, 1.9 on a GELU chain over 2^21 floats)
FIRST_RUN_OP_S = 3e-4
FIRST_TRIAL_S = 0.1     # a first deferred run's cost over at once, before one was timed ...
JAX_START_S = 0.5       # ... importing JAX and starting its client, where nothing has yet ...
SYMPY_START_S = 0.2     # ... and the first metadata inference's imports
# a background compile's share of the machine: it takes one core while the program runs on
# the others (torch's kernels use every core)
COMPILE_SHARE = 1.0 / max(1, os.cpu_count() or 1)

clock = time.perf_counter   # (tests drive the tier with a fake clock)
MEASURING = "measuring"     # a remembered record's phase while its place had not chosen yet


class Phase(enum.Enum):
    MEASURE_DEFERRED = "measuring deferred"
    MEASURE_AT_ONCE = "measuring at once"
    DEFERRED = "deferred"
    AT_ONCE = "at once"


def unsteady_count() -> int:
    """Grows whenever a flush did something a steady, warmed-up run does not."""
    s = STATS
    # (not eager_replays: a graph whose engine choice is torch's kernels replays eagerly for good;
    # an eager run of a graph not compiled yet counts a cache miss)
    return (s.compiles + s.cache_misses + s.background_compiles + s.disk_cache_hits
            + s.unseen_ops_run + s.eager_chosen)


def _median(samples: list[float]) -> float:
    ordered = sorted(samples)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _compile_share(ops: int) -> float:
    """What compiling ``ops`` ops costs the program, a core's share of the machine."""
    return executables.compile_estimate(ops) * COMPILE_SHARE if ops else 0.0


def _share_faster(a: list[float], b: list[float]) -> float:
    """The share of pairs (x from a, y from b) with x faster than y, ties counting half: 1.0
    when every run of ``a`` beat every run of ``b`` (the Mann-Whitney statistic over n*m)."""
    wins = sum((x < y) + 0.5 * (x == y) for x in a for y in b)
    return wins / (len(a) * len(b))


class BlockChoice:
    """What one place in the code chose, and the times it chose from."""

    __slots__ = ("place", "phase", "deferred", "at_once", "unsteady", "runs", "recheck",
                 "outliers", "choices", "last", "median", "unsettled", "held", "disk_place",
                 "remembered", "own", "elapsed", "spent", "trial", "reference", "compiled_seen",
                 "compiling", "credit", "unpriced", "startup", "trial_runs", "holds_loop", "marks",
                 "seeded_runs", "first_ops", "probed_ops", "recalled", "pricing")

    def __init__(self, place: str, disk_place: Optional[str] = None, credit: float = 0.0,
                 trial_runs: float = 0.0) -> None:
        self.place = place
        # whether a run of the block held a loop (of optimizer steps, or of reads that computed
        # values): its iterations are chosen for by the segment tier (Recorder.step_ended and
        # read_ended, capture/mode.DeferMode.segment), not the block as a whole
        self.holds_loop = False
        # a deferred run's start and the ends of the loop iterations seen in it so far, each as
        # (clock, startup_seconds, ops recorded): what its loop's iterations cost before the
        # segment tier took them (loop_seed)
        self.marks: list[tuple[float, float, int]] = []
        # a first deferred run's expected cost over at once, in runs at once, beyond
        # first_trial_estimate() (segments.SEGMENT_TRIAL_RUNS for a default mode's segments)
        self.trial_runs = trial_runs
        # exploration the place may spend before any time has run there: a ``with defer()``
        # block asks for deferral, so it tries it at once (BLOCK_CREDIT_S); a default mode's
        # segment asks for nothing
        self.credit = credit
        self.unpriced: Optional[float] = None   # a deferred run's time, not yet compared
        self.seeded_runs = (0.0, 1)   # (seconds, runs) of deferred runs before the place was known (seeded)
        self.first_ops = 0   # the ops the place's first deferred run recorded (while not priced)
        self.probed_ops = 0  # the ops its first run ran at once (probes), 0 before it
        self.pricing = False  # whether its first deferred run waits to be priced on a warm run at once
        # where an earlier process's price of the place's first deferred run was taken
        # (remember): the ops its first run ran, and the credit before; the price holds if this
        # process's first run runs as many (probed)
        self.recalled: Optional[tuple[int, float]] = None
        self.startup = startup_seconds()        # the process's one-off costs when a run started
        # the exploration budget: trying the deferred way may cost at most explore_share of
        # the time this place has run (elapsed); spent is what the deferred runs cost over
        # running at once (reference: recent runs at once) and the compiles they queued; trial
        # is what the last deferred run cost over at once, the estimate for the next
        self.elapsed = 0.0
        self.spent = 0.0
        self.trial: Optional[float] = None
        self.reference: list[float] = []
        self.compiled_seen = executables.compile_seconds()
        self.compiling = False   # whether compiles were pending when the current run started
        self.disk_place = disk_place   # the place's stable text, where its choice is kept on disk
        self.remembered = False        # whether the choice in force came from an earlier process
        self.own: list[float] = []     # ... and this process's first runs of it
        self.recheck = FIRST_RECHECK
        self.choices = 0
        self.last: Optional[Phase] = None   # the previous choice, while it is being rechecked
        self.unsettled = False   # whether the last choice was made on deferred runs that never settled
        self._measure_again()

    def _measure_again(self) -> None:
        # (what the choice being rechecked was made on, kept in case it holds without timing)
        self.held = (self.deferred, self.at_once, self.median, self.unsteady) if self.last else None
        self.remembered = False
        self.phase = Phase.MEASURE_DEFERRED
        self.median: Optional[float] = None   # the chosen way's, once chosen on times
        self.deferred: list[float] = []
        self.at_once: list[float] = []
        self.unsteady = 0
        self.runs = 0
        self.outliers = 0

    @property
    def runs_at_once(self) -> bool:
        """Whether the next run runs at once: as chosen, or while measuring, when it is the at
        once run's turn or the deferred one's is not affordable yet (``may_try``)."""
        phase = self.phase
        if phase is Phase.MEASURE_DEFERRED:
            return self.pricing or not self.may_try()
        return phase is Phase.AT_ONCE or phase is Phase.MEASURE_AT_ONCE

    def probes(self) -> bool:
        """Whether the next run is a new ``with`` place's first, run at once under a mode that
        counts its ops and finds a loop in it (Segments.probing), so that its first deferred
        run is priced before it runs (``probed``; run first, a ResNet step per block's cost 0.5
        s, 20 runs at once), and a loop in it is found at once (a Llama fine-tune in one block
        ran its first two steps deferred, 2.2 s).  Only with a budget (explore_share below 1)
        and the segment tier on, which the probe needs."""
        new = self.recalled is not None or (self.credit > 0.0 and self.trial is None
                                            and self.unpriced is None)
        return (new and not self.reference and self.last is None
                and config.get("explore_share") < 1.0 and config.shortcuts().segments_timed)

    def probed(self, ops: int, seconds: Optional[float] = None) -> None:
        """The place's first run ran at once, ``ops`` ops (and took ``seconds``, where finished()
        did not time it: a loop's iteration, Segments.observed): its first deferred run is
        priced, as an earlier process measured it where that process's first run ran as many
        ops (``recalled``: the same script with another model must not start from this one's
        price), else on the next run, at once too (``_price``): a first run is cold (an MLP
        step's took 16 ms, its next ones 1.5)."""
        if seconds is not None:
            self._account(seconds, True)
        self.probed_ops = ops
        recalled, self.recalled = self.recalled, None
        if recalled is not None:
            if recalled[0] == ops:
                return
            self.trial, self.credit, self.first_ops = None, recalled[1], 0   # (other work)
        self.pricing = True

    def _price(self, run: float) -> None:
        """After a probe, a warm run at once of ``run`` seconds: the first deferred run is
        expected to cost FIRST_RUN_OP_S an op its probe ran over it; where exploring on would
        not be cheap (CHEAP_FIRST_RUNS), the credit ends and the deferred way waits for the
        budget."""
        self.pricing = False
        first = self.probed_ops * FIRST_RUN_OP_S
        if not self._explores_cheap(first, run, self.probed_ops):
            # (the next trial compiles what it records: _trial_cost; a cheap place's first
            # deferred run compiles nothing, and records its own ops: finished)
            self.credit, self.trial, self.first_ops = 0.0, first, self.probed_ops

    def _explores_cheap(self, first: float, run: float, ops: int) -> bool:
        """Whether exploring on, after a first deferred run that cost ``first`` over a run at
        once of ``run`` seconds, is cheap enough for the credit (CHEAP_FIRST_RUNS): more such
        runs until one is timed, and compiling the ``ops`` they record, within it."""
        return first <= CHEAP_FIRST_RUNS * run \
            and UNSTEADY_UNTIMED * first + _compile_share(ops) <= self.credit

    def at_once_median(self) -> float:
        """What a run at once takes: the median of the recent ones (0 before any)."""
        return _median(self.reference) if self.reference else 0.0

    def may_try(self) -> bool:
        """Whether a deferred run fits the exploration budget: what trying the deferred way has
        cost so far, and what the next run is expected to cost over a run at once, within
        explore_share of the time this place has run."""
        share = config.get("explore_share")
        if share >= 1.0:
            return True
        if self.unpriced is not None:
            return False   # (the last deferred run is priced against a run at once first)
        return self.spent + self._trial_cost() <= share * self.elapsed + self.credit

    def _trial_cost(self) -> float:
        """What the next deferred run is expected to cost over a run at once: the last one's
        cost, or before any, a first trial's estimate and ``trial_runs`` runs at once; and
        until a deferred run has been timed, compiling what the first one recorded, a core's
        share (a ``with`` place's first run compiles nothing: its next one does; GPT-2's step
        per block, priced at its first run's 0.3 s, tried again at its 55th step, and that run
        and its compile cost ~3 s)."""
        expected = self.trial
        if expected is None:
            expected = first_trial_estimate()
            expected += self.trial_runs * self.at_once_median()
        if not self.deferred:
            expected += _compile_share(self.first_ops)   # (its first deferred run's ops)
        return expected

    def starting(self, at_once: bool) -> None:
        """A run starts, ``at_once`` or deferred.  It will be timed at once only if no compile is
        pending meanwhile; run deferred, it may start compiles only as far as the budget allows
        (``executables.allow_compiles``): a compile is a bet that the compiled way will pay, and
        a choice made on eager replays has not shown it yet."""
        self.compiling = executables.compiles_pending()
        self.startup = startup_seconds()
        self.marks = [] if at_once else [(clock(), self.startup, STATS.ops_recorded)]
        allowance = None
        if not at_once and config.get("explore_share") < 1.0:
            left = config.get("explore_share") * self.elapsed + self.credit - self.spent - (self.trial or 0.0)
            allowance = max(0.0, left) / COMPILE_SHARE
            if self.credit and self.trial is None:
                # (a ``with`` place's first deferred run compiles nothing, even the graphs it
                # meets twice, a model's layers: whether its credit goes on is not known yet,
                # CHEAP_FIRST_RUNS; a Llama step's first run queued 3 compiles, ~2 s of a core)
                allowance = 0.0
        executables.allow_compiles(allowance)

    def finished(self, seconds: float, steady: bool, at_once: Optional[bool] = None, runs: int = 1) -> None:
        """A run of the block ended without an exception, after ``seconds``; ``steady`` says
        whether a deferred run compiled nothing (runs at once are always steady); ``at_once``:
        how it ran (by default, as its phase says); ``runs``: how many runs at once of a
        settled place the time holds (``settled_runs``), each then timed at their mean."""
        phase = self.phase
        if at_once is None:
            at_once = phase is Phase.AT_ONCE or phase is Phase.MEASURE_AT_ONCE
        executables.allow_compiles(None)
        # (a process's one-off costs, paid during this run, are no cost of this place's)
        seconds = max(0.0, seconds - (startup_seconds() - self.startup))
        if not at_once and self.trial is None and self.marks:
            self.first_ops = max(0, STATS.ops_recorded - self.marks[0][2])
        if runs > 1:
            self.elapsed += seconds * (runs - 1) / runs
            seconds /= runs
        self._account(seconds, at_once)
        if phase is Phase.MEASURE_DEFERRED and at_once:
            return   # (waiting for the budget: a run at once, counted as a reference only)
        if phase is Phase.MEASURE_AT_ONCE and (self.compiling or executables.compiles_pending()):
            return   # (a compile took a core meanwhile: not timed; the next runs at once again)
        if phase is Phase.MEASURE_DEFERRED:
            if not steady:
                self.unsteady += 1
                if self.last is Phase.AT_ONCE and self.unsettled and self.held is not None:
                    # a recheck of a place that chose at once because its deferred runs never
                    # settled: they still do not, and each costs what it cost then (a compile
                    # on the background thread, a replay): the choice holds on what it was made on
                    self.deferred, self.at_once, _, self.unsteady = self.held
                    self._choose(Phase.AT_ONCE)
                    return
            if steady or self.unsteady > UNSTEADY_UNTIMED:
                self.deferred.append(seconds)
                self._measured()
        elif phase is Phase.MEASURE_AT_ONCE:
            self.at_once.append(seconds)
            self._measured()
        else:
            self.runs += runs
            if self.runs >= self.recheck:
                self._measure_again()
            elif steady and self.remembered and self.median is None:
                # a remembered choice is watched for drift against this process's own runs: an
                # earlier process's times may not hold here (its allocator tuned by XLA's
                # start, say); and a process's first runs are slower, in strict too (6, 3, 2,
                # then 1-2 ms in bench/warm_start.py): the first UNSTEADY_UNTIMED are skipped
                self.own.append(seconds)
                if len(self.own) >= UNSTEADY_UNTIMED + SAMPLES:
                    self.median = _median(self.own[UNSTEADY_UNTIMED:])
            elif steady:
                self._watch_for_drift(seconds)

    def iteration_ended(self) -> None:
        """A deferred run of this block reached the end of a loop iteration (an optimizer step's
        end, a read that computed values), its work flushed."""
        if self.marks:
            self.marks.append((clock(), startup_seconds(), STATS.ops_recorded))

    def loop_seed(self) -> Optional[tuple[float, float, int, int]]:
        """What this run of the block cost before its loop's iterations went to the segment tier
        (Segments' ``seed``): its deferred seconds up to the iteration before the last, the
        last iteration's, both without the process's one-off costs, the iterations, and the
        ops an iteration recorded; None before an iteration ended."""
        marks = self.marks
        if len(marks) < 2:
            return None
        (start, startup0, ops0), (before, startup1, _), (now, startup2, ops) = marks[0], marks[-2], marks[-1]
        last = max(0.0, (now - before) - (startup2 - startup1))
        runs = len(marks) - 1
        return (max(0.0, (now - start) - (startup2 - startup0) - last), last, runs,
                max(0, ops - ops0) // runs)

    def settled_runs(self) -> int:
        """How many runs at once may follow the next without being timed one by one (at most
        STREAK_MAX): while the choice is at once and its recheck is further away, or while the
        deferred way waits for the budget and the runs at once that earn it are more.  0 while
        measuring, or while a remembered choice times this process's own first runs."""
        phase = self.phase
        if phase is Phase.AT_ONCE:
            if self.remembered and self.median is None:
                return 0
            return max(0, min(STREAK_MAX, self.recheck - self.runs - 2))
        if phase is not Phase.MEASURE_DEFERRED or self.unpriced is not None or self.pricing \
                or not self.reference:
            return 0
        share = config.get("explore_share")
        if share >= 1.0 or share <= 0.0:
            return 0
        run = _median(self.reference)
        # (the seconds at once still to run before a deferred run fits: may_try)
        short = (self.spent + self._trial_cost() - self.credit) / share - self.elapsed
        if run <= 0.0 or short <= 0.0:
            return 0
        return max(0, min(STREAK_MAX, int(short / run) - 2))

    def seeded(self, spent: float, last: float, runs: int, ops: int) -> None:
        """Start from ``runs`` deferred runs of this place that ran before it was known (a
        ``with`` block's first loop iterations): ``spent`` seconds of them, and a last one of
        ``last`` seconds, priced against the next run at once, ``ops`` recorded by each; their
        time counts as exploration, first sightings and compiles included.  (A Llama fine-tune
        in one block spent 2.2 s on its first two steps, then 2.4 s more on deferred trials its
        credit still allowed.)"""
        self.elapsed += spent + last
        self.spent += spent
        self.unpriced = last
        self.seeded_runs = (spent, max(1, runs))
        self.first_ops = ops

    def _account(self, seconds: float, at_once: bool) -> None:
        """The budget's books after a run: its time, and what a deferred run (with the compiles
        finished since the last run, a share of them: they took one core of the machine's)
        cost over the recent runs at once."""
        self.elapsed += seconds
        compiled = executables.compile_seconds()
        self.spent += (compiled - self.compiled_seen) * COMPILE_SHARE
        self.compiled_seen = compiled
        if at_once:
            if self.pricing and self.reference:
                self._price(seconds)
                self.reference.clear()   # (the probe's run was cold: no reference)
            self.reference.append(seconds)
            if len(self.reference) > SAMPLES:
                del self.reference[0]
            if self.unpriced is not None:   # (a deferred run that had nothing to compare with)
                self._charge(self.unpriced - seconds, seconds)
                self.unpriced = None
        elif self.reference:
            median = _median(self.reference)
            self._charge(seconds - median, median)
        else:
            self.unpriced = seconds   # (priced at the first run at once: may_try waits for it)

    def _charge(self, excess: float, run: float) -> None:
        """A deferred run cost ``excess`` seconds over a run at once of ``run`` seconds."""
        excess = max(0.0, excess)
        self.spent += excess
        if self.trial is None and self.credit:
            # the place's first deferred runs, priced: each cost ``first`` over a run at once;
            # what exploring on would cost: more such runs until one is timed, and compiling
            # what they record (CHEAP_FIRST_RUNS)
            before, runs = self.seeded_runs
            first = (excess + max(0.0, before - (runs - 1) * run)) / runs
            if not self._explores_cheap(first, run, self.first_ops):
                self.credit = 0.0
                self.trial = excess
                if self.last is None:
                    # (kept, so that a later process starts the place at once, waiting for
                    # the budget, instead of paying its first deferred run again)
                    self._save(MEASURING)
        self.trial = excess

    def _measured(self) -> None:
        """After a timed run: the next goes the other way.  Once both ways have SAMPLES runs,
        and as many each, the way with the faster median wins (ties to deferred) if one way
        was faster in at least CLEAR of the pairs of runs; otherwise both go on, up to
        MAX_SAMPLES each, and then the medians decide."""
        deferred, at_once = self.deferred, self.at_once
        n = len(at_once)
        if n >= SAMPLES and len(deferred) == n:
            share = _share_faster(at_once, deferred)
            if n >= MAX_SAMPLES or share >= CLEAR or share <= 1 - CLEAR:
                faster = _median(at_once) < _median(deferred)
                self._choose(Phase.AT_ONCE if faster else Phase.DEFERRED)
                return
        self.phase = Phase.MEASURE_AT_ONCE if n < len(deferred) else Phase.MEASURE_DEFERRED
        if self.last is None:
            # a first measurement (not a recheck of a choice, which stays on record meanwhile):
            # kept as it goes, so that a process running the block too few times to choose
            # leaves its runs to the next one (a script run again and again, 10 calls each)
            self._save(MEASURING)

    def _choose(self, phase: Phase, save: bool = True) -> None:
        # a choice that held when measured again is checked half as often
        self.recheck = min(2 * self.recheck, LAST_RECHECK) if phase is self.last else FIRST_RECHECK
        self.last = phase
        self.phase = phase
        if self.deferred:   # (a choice made on samples, not one that held at a recheck)
            self.unsettled = self.unsteady > UNSTEADY_UNTIMED
        samples = self.at_once if phase is Phase.AT_ONCE else self.deferred
        self.median = _median(samples) if samples else None
        self.runs = 0
        self.outliers = 0
        self.choices += 1
        self.remembered = not save
        if save and self.deferred:
            self._save(phase.value)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("block at %s: %s", self.place, self.describe())

    def _save(self, phase: str) -> None:
        if self.disk_place is not None and config.get("remember_blocks"):
            diskcache.save_choice(self.disk_place, {
                "phase": phase, "deferred": self.deferred, "at_once": self.at_once,
                "unsteady": self.unsteady, "recheck": self.recheck, "trial": self.trial,
                "credit": self.credit, "first_ops": self.first_ops, "probed_ops": self.probed_ops})

    def remember(self, record: dict) -> bool:
        """Start from ``record``, a choice an earlier process saved for this place, or the runs
        it timed before it could choose; False (and nothing changed) when the record holds
        neither."""
        phase = {Phase.AT_ONCE.value: Phase.AT_ONCE, Phase.DEFERRED.value: Phase.DEFERRED,
                 MEASURING: None}.get(record.get("phase"), False)
        deferred, at_once, unsteady = record.get("deferred"), record.get("at_once"), record.get("unsteady")
        if phase is False or not isinstance(unsteady, int) or not all(
                isinstance(samples, list) and (samples or phase is None)
                and len(samples) <= MAX_SAMPLES
                and all(isinstance(x, float) and x >= 0 for x in samples)
                for samples in (deferred, at_once)):
            return False
        if phase is None:
            # runs timed before the earlier process could choose: this one times the rest
            # (its own unsteady runs counted afresh: first sightings and loads are per process)
            if len(at_once) not in (len(deferred), len(deferred) - 1):
                return False
            self.deferred, self.at_once = list(deferred), list(at_once)
            self.phase = Phase.MEASURE_AT_ONCE if len(at_once) < len(deferred) else Phase.MEASURE_DEFERRED
            trial, credit = record.get("trial"), record.get("credit")
            ops, probed = record.get("first_ops"), record.get("probed_ops")
            if isinstance(trial, float) and isinstance(credit, float) and isinstance(ops, int) \
                    and isinstance(probed, int) and trial >= 0 and 0 <= credit <= self.credit \
                    and ops >= 0 and probed >= 0:
                # (its first deferred run, priced: what the next is expected to cost, and whether
                # the credit went on; a place whose credit ended runs at once from its first
                # run, which checks that it runs as many ops: probed)
                self.recalled = (probed, self.credit)
                self.trial, self.credit, self.first_ops = trial, credit, ops
            return True
        self.deferred, self.at_once, self.unsteady = list(deferred), list(at_once), unsteady
        self._choose(phase, save=False)
        self.median = None   # (set from this process's first runs: see finished())
        recheck = record.get("recheck")
        if isinstance(recheck, int):   # (a choice that held at its rechecks: checked as seldom)
            self.recheck = min(max(recheck, FIRST_RECHECK), LAST_RECHECK)
        return True

    def _watch_for_drift(self, seconds: float) -> None:
        median = self.median
        if median is None:
            return
        if (seconds > DRIFT * median or seconds * DRIFT < median) \
                and abs(seconds - median) > DRIFT_FLOOR:
            self.outliers += 1
            if self.outliers >= 2:
                self.last = None
                self._measure_again()
        else:
            self.outliers = 0

    def describe(self) -> str:
        def ms(samples: list[float]) -> str:
            return f"{_median(samples) * 1e3:.3g} ms" if samples else "-"
        why = (f"deferred {ms(self.deferred)}, at once {ms(self.at_once)} "
               f"(medians of {len(self.deferred)} and {len(self.at_once)} runs)")
        if self.unsteady > UNSTEADY_UNTIMED:
            why += f"; {self.unsteady} deferred runs compiled or met new graphs"
        if self.remembered:
            why += ", remembered from an earlier process"
        if self.phase is Phase.MEASURE_DEFERRED and self.trial is not None and not self.may_try():
            if self.unsteady or self.deferred or not self.probed_ops:
                last = f"the last cost {self.trial * 1e3:.3g} ms over a run at once"
            else:   # (priced, never run: _price)
                last = (f"the first is expected to cost {self.trial * 1e3:.3g} ms over a run at "
                        f"once (its first run, at once, ran {self.probed_ops} ops)")
            why += f"; the next deferred run waits for the exploration budget (explore_share): {last}"
        if self.phase in (Phase.DEFERRED, Phase.AT_ONCE):
            return f"{self.phase.value}: {why}; checked again in {self.recheck - self.runs} runs"
        return f"{self.phase.value}: {why}"


PLACES: dict[Any, BlockChoice] = {}
# the segment tier's tables (exec/segments.py)
READS: set = set()   # segment keys of reads that ran deferred without flushing (no boundaries)
# (code, offset) of reads by the user's code that a segment at once may pass by (every step's
# ``loss.item()``), known without taking the place: no boundary, until when (reads the deferred
# way has seen: for good; new ones while the program may not run deferred to learn what they
# are: until segments.NEW_READ_LOOK_S later).  Emptied when a table changes so that one could
# become a boundary.
QUIET: dict = {}


def first_trial_estimate() -> float:
    """What a place's first deferred run is expected to cost over a run at once, before it has
    had one: its ops' metadata inferred, its graph replayed, and in a process that has not yet,
    importing JAX (0.4 s here) and what torch's meta kernels import (sympy: 0.2 s)."""
    return FIRST_TRIAL_S + (0.0 if "jax" in sys.modules else JAX_START_S) \
        + (0.0 if "sympy" in sys.modules else SYMPY_START_S)



_LOOKED_UP: set = set()   # places whose remembered choice this process asked the disk for


def choice_at(frame: Any) -> BlockChoice:
    """The choice for the block whose ``with`` statement runs in ``frame``."""
    key = (frame.f_code, frame.f_lineno)
    found = PLACES.get(key)
    if found is None:
        if len(PLACES) >= MAX_PLACES:
            PLACES.clear()
        code = frame.f_code
        disk_place = _disk_place(code, frame.f_lineno)
        found = BlockChoice(f"{code.co_filename}:{frame.f_lineno}", disk_place, BLOCK_CREDIT_S)
        if key not in _LOOKED_UP and config.get("remember_blocks"):
            # (once per process: forget() makes places measure again)
            if len(_LOOKED_UP) >= MAX_PLACES:
                _LOOKED_UP.clear()   # (it holds code objects: bounded as the table is)
            _LOOKED_UP.add(key)
            record = diskcache.load_choice(disk_place)
            if record is not None:
                found.remember(record)
        PLACES[key] = found
    return found


def _disk_place(code: Any, line: int) -> str:
    """A ``with`` line as a text that another process running the same code spells the same
    way: its file, function, line, and a hash of the function's bytecode and names."""
    digest = hashlib.sha256(code.co_code + repr(code.co_names).encode()).hexdigest()[:16]
    return f"{code.co_filename}:{code.co_qualname}:{code.co_firstlineno}:{line}:{digest}"


def choices() -> list[BlockChoice]:
    return list(PLACES.values())


def forget() -> None:
    """Every place measures again (reset_stats() does not call this; tests do)."""
    PLACES.clear()
    READS.clear()
    QUIET.clear()


def describe_all() -> Optional[str]:
    known = [c for c in PLACES.values() if c.choices or c.phase is not Phase.MEASURE_DEFERRED
             or c.deferred]
    if not known:
        return None
    lines = [f"defer blocks by place (eager_blocks): {STATS.blocks_run_at_once} block run(s) at "
             f"once since the last reset_stats()"]
    lines += [f"  {c.place}: {c.describe()}" for c in known]
    return "\n".join(lines)
