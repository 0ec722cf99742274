"""The settings users run with, made deterministic: the ``user_defaults`` fixture
(tests/conftest.py) and its helpers.

tests/conftest.py turns the eager shortcuts off for the rest of the suite, so the path most users
take (every setting at its default) needs tests of its own.  ``UserDefaults`` holds those
settings and makes a test's calls of one ``with deferfuse.defer():`` block go through the tiers
at known calls, whatever this machine's load:

- the first call is every op's first sighting (``forget_what_was_learned`` forgets inferred
  metadata, sightings, lone places, executables and block places), so its ops run at once;
- a graph recorded at call k replays eagerly; at call k + 1 it replays eagerly again while the
  background thread compiles it; from call k + 2 it runs compiled: ``calls`` waits for the
  background thread after each call (``engine.wait_for_compiles``);
- the block tier (eager_blocks) times blocks on a fake clock on which every block takes one
  second, so that its choice never depends on this machine's load.  ``"measuring"``: as a new
  place does, the block runs deferred until its first steady run (nothing compiled, nothing
  new), then alternately at once (as strict) and deferred; ``"deferred"``: every call deferred,
  what a place that chose deferred runs (eager_blocks off, the one setting off the defaults).

Three more settings differ from the defaults, all for determinism: the disk cache is off (an
executable found on disk would skip the eager replays), so is autotune_engine (its engine
choice is made on this machine's timings), and the block tier has no exploration budget
(explore_share 1: a new place runs deferred from its first call, so that the tiers above happen
at known calls; tests/test_blocks.py tests the budget).
"""

from __future__ import annotations

import itertools
from typing import Iterator

from deferfuse import config
from deferfuse.capture import meta
from deferfuse import engine
from deferfuse.exec import blocks

COMPILE_TIMEOUT = 600.0   # seconds to wait for the background thread (a hung compile fails the test)


class UserDefaults:
    """The settings (``settings``, for config.override), the block tier's fake clock and the
    calls of a test's block; ``block_tier``: "deferred" or "measuring" (see above)."""

    def __init__(self, block_tier: str) -> None:
        if block_tier not in ("deferred", "measuring"):
            raise ValueError(f"block_tier: 'deferred' or 'measuring', not {block_tier!r}")
        self.block_tier = block_tier
        self.settings = {name: s.default for name, s in config.settings().items()}
        self.settings.update(cache_dir="", autotune_engine=False,
                             eager_blocks=block_tier == "measuring", explore_share=1.0)
        self._ticks = itertools.count()

    def clock(self) -> float:
        """blocks.clock: one second later at each reading (each block is timed by two)."""
        return float(next(self._ticks))

    def calls(self, n: int) -> Iterator[int]:
        """1, 2, ..., n: the test runs its block once per number; after each call, every graph
        queued for compilation is compiled."""
        for call in range(1, n + 1):
            yield call
            assert engine.wait_for_compiles(COMPILE_TIMEOUT), "the background compile did not finish"


def forget_what_was_learned() -> None:
    """Start from a clean slate: every op unseen, every graph new, every block place unmeasured
    (after waiting for the background thread: an earlier compile must not land in the test)."""
    engine.wait_for_compiles(COMPILE_TIMEOUT)
    meta.clear_cache()
    engine.clear_cache()
    blocks.forget()
