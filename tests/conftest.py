import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Hermetic runs: compiled executables go to a fresh folder, not the user's cache.
import tempfile  # noqa: E402

os.environ.setdefault("DEFERFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="deferfuse-test-cache-"))

# An op first seen at a place in the code runs at once when its inputs are computed
# (eager_unseen_ops): whether a test's ops are deferred would then depend on which tests ran
# before it in the same worker.  Tests record from the first op; tests/test_unseen_ops.py and
# the fresh-process tests that drop this variable check the default.
os.environ.setdefault("DEFERFUSE_EAGER_UNSEEN_OPS", "0")
# Likewise an op whose flushes were lone runs at once at its place in the code (eager_lone_ops):
# a test's loop would stop recording after its first lone flush.  tests/test_unseen_ops.py
# checks it.
os.environ.setdefault("DEFERFUSE_EAGER_LONE_OPS", "0")
# And a place whose defer blocks ran faster at once than deferred runs them at once (eager_blocks):
# a test's loop would stop recording after its first few runs, and whether it did would depend on
# this machine's load.  tests/test_blocks.py checks it, on a fake clock.
os.environ.setdefault("DEFERFUSE_EAGER_BLOCKS", "0")
# A choice it made is kept in the disk cache for later processes (remember_blocks): the suite's
# processes share one folder, so a place would start from another test's choice.  The tests of
# remembering (tests/test_blocks.py) turn it on.
os.environ.setdefault("DEFERFUSE_REMEMBER_BLOCKS", "0")
# And under a default defer mode, the work between two reads of a value (eager_segments), timed
# the same way: tests/test_segments.py checks it, on a fake clock.
os.environ.setdefault("DEFERFUSE_EAGER_SEGMENTS", "0")

# Hypothesis profiles: ``default`` (the normal run, well under a few minutes on 2 cores) and
# ``deep`` (``HYPOTHESIS_PROFILE=deep``, as ``make test-deep`` does).  The program suite in
# test_programs.py has six generating tests: 6 x 70 = 420 programs by default, 6 x 1100 deep.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "default",
    max_examples=70,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# The default profile is derandomized so CI is deterministic; deep explores new programs each run
# (every failure it finds becomes a pinned test in test_regressions.py).
settings.register_profile("deep", settings.get_profile("default"), max_examples=1100, derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# The settings users run with, made deterministic (tests/user_defaults.py): the eager shortcuts
# this file turns off above are on for the tests that take this fixture.
import pytest  # noqa: E402


@pytest.fixture(params=["deferred", "measuring"], ids=lambda way: f"blocks-{way}")
def user_defaults(request, monkeypatch):
    """Every setting at its default, deterministically (user_defaults.UserDefaults); parametrized
    over the two ways the block tier runs a new place (``indirect`` parametrization picks one)."""
    from user_defaults import UserDefaults, forget_what_was_learned
    from deferfuse import config
    from deferfuse.exec import blocks
    tiers = UserDefaults(request.param)
    monkeypatch.setattr(blocks, "clock", tiers.clock)
    forget_what_was_learned()
    with config.override(**tiers.settings):
        yield tiers
    forget_what_was_learned()


@pytest.fixture(autouse=True)
def _background_compiles_end_with_their_test():
    """A graph a test queued for background compilation finishes before the next test starts:
    otherwise it lands in that test's ``deferfuse.stats()`` (a compile counted after its
    ``reset_stats()``), and what a test counts would depend on which tests ran before it."""
    yield
    executables = sys.modules.get("deferfuse.exec.executables")
    if executables is not None and executables.compiles_pending():
        executables.wait_for_compiles(timeout=300)


@pytest.fixture
def always_compile():
    """Every flush compiled and run on XLA (no eager replay while a graph compiles): for tests of
    a lowering's numbers rather than of the tiers (``pytestmark = usefixtures("always_compile")``)."""
    from deferfuse import config
    with config.override(always_compile=True):
        yield
