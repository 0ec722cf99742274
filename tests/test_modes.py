"""The three eager modes: names, scoping, nesting, the environment variable, python -m."""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import deferfuse
from deferfuse import EagerMode
from deferfuse.capture import patches

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_torchtpu_names_are_aliases():
    assert EagerMode.DEFER_NEVER is EagerMode.STRICT
    assert EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING is EagerMode.DEBUG
    assert EagerMode.DEFER_AND_FUSE is EagerMode.DEFER


@pytest.mark.parametrize("name,expected", [
    ("strict", EagerMode.STRICT), ("DEBUG", EagerMode.DEBUG), ("Defer", EagerMode.DEFER),
    ("DEFER_AND_FUSE", EagerMode.DEFER), ("defer_never", EagerMode.STRICT),
    (EagerMode.DEFER, EagerMode.DEFER)])
def test_mode_accepts_enum_and_names(name, expected):
    with deferfuse.mode(name) as m:
        assert m is expected
        assert deferfuse.get_mode() is expected
    assert deferfuse.get_mode() is EagerMode.STRICT


def test_unknown_mode_names_allowed_values():
    with pytest.raises(deferfuse.ModeError, match="strict, debug, defer"):
        with deferfuse.mode("fast"):
            pass


def test_defer_returns_deferred_tensors_and_strict_does_not():
    x = torch.ones(3)
    with deferfuse.defer():
        y = x + 1
        assert isinstance(y, deferfuse.DeferredTensor)
        assert not deferfuse.is_materialized(y)
        with deferfuse.strict():
            z = x + 1
            assert type(z) is torch.Tensor
        w = x + 2
        assert isinstance(w, deferfuse.DeferredTensor)
    assert deferfuse.is_materialized(y)
    assert torch.equal(y, torch.full((3,), 2.0))


def test_nested_defer_is_one_context():
    x = torch.ones(2)
    with deferfuse.defer():
        with deferfuse.defer():
            y = x * 3
        assert not deferfuse.is_materialized(y) or True
        z = y + 1
    assert torch.equal(z, torch.full((2,), 4.0))


def test_exception_inside_context_leaves_clean_state():
    x = torch.ones(3)
    with pytest.raises(RuntimeError):
        with deferfuse.defer():
            x.add_(1)
            torch.ones(2) + torch.ones(3)  # shape error, raised on this line
    assert deferfuse.get_mode() is EagerMode.STRICT
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    # the mutation before the error was applied, in program order
    assert torch.equal(x, torch.full((3,), 2.0))


def test_set_mode_sets_thread_default():
    try:
        deferfuse.set_mode("defer")
        assert deferfuse.get_mode() is EagerMode.DEFER
        y = torch.ones(2) * 5
        assert isinstance(y, deferfuse.DeferredTensor)
        assert y.sum().item() == 10.0
    finally:
        deferfuse.set_mode("strict")
    assert type(torch.ones(2) * 5) is torch.Tensor


def test_set_mode_defer_python_reads_of_a_written_plain_tensor():
    """The default defer mode's dispatch mode (a SegmentedDeferMode) is found by the wrappers
    that write a plain tensor's pending contents back before Python-level reads."""
    expected = torch.zeros(3).add_(torch.ones(3) * 2)
    p = torch.zeros(3)
    try:
        # (explore_share 1: the default mode starts deferred, not at once as strict)
        with deferfuse.config.override(eager_segments=True, explore_share=1.0):
            deferfuse.set_mode("defer")
            assert type(torch.utils._python_dispatch._get_current_dispatch_mode()).__name__ == "SegmentedDeferMode"
        p.add_(torch.ones(3) * 2)
        listed, array = p.tolist(), p.numpy().copy()
    finally:
        deferfuse.set_mode("strict")
    assert listed == expected.tolist()
    assert array.tolist() == expected.tolist()


def _run(args, env_extra=None, cwd=None):
    env = dict(os.environ)
    env.pop("TORCHTPU_MODE", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


SCRIPT = textwrap.dedent("""
    import sys, torch
    import deferfuse
    y = torch.arange(4.0) * 2
    print(__name__, sys.argv[1:], deferfuse.get_mode().value, type(y).__name__, y.sum().item())
    if sys.argv[1:] == ["fail"]:
        raise KeyError("from the script")
    sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
""")


def test_environment_variable_selects_mode(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    out = _run([str(script)], {"TORCHTPU_MODE": "DEFER_AND_FUSE"})
    assert out.returncode == 0, out.stderr
    assert "defer DeferredTensor 12.0" in out.stdout


def test_bad_environment_variable_is_a_clear_error(tmp_path):
    out = _run(["-c", "import deferfuse"], {"TORCHTPU_MODE": "turbo"})
    assert out.returncode != 0
    assert "TORCHTPU_MODE='turbo'" in out.stderr and "strict, debug, defer" in out.stderr


def test_python_m_runs_script_like_python(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    out = _run(["-m", "deferfuse", "--mode", "defer", str(script), "7"], cwd=REPO)
    assert out.returncode == 7, out.stderr
    assert out.stdout.startswith("__main__ ['7'] defer DeferredTensor 12.0")
    out = _run(["-m", "deferfuse", str(script), "fail"], cwd=REPO)
    assert out.returncode == 1
    assert "KeyError: 'from the script'" in out.stderr
    assert f'File "{script}", line 7' in out.stderr
    assert "runpy" not in out.stderr
    out = _run(["-m", "deferfuse", "--mode", "strict", str(script)], cwd=REPO)
    assert "strict Tensor 12.0" in out.stdout


def test_python_m_gives_the_script_the_main_module_python_gives(tmp_path):
    """Run by a relative path from its folder: ``__file__`` absolute (and so warning locations
    and tracebacks), ``__builtins__`` the module, ``sys.argv[0]`` as typed, the same names in
    ``__main__``; runpy.run_path gave a relative ``__file__`` and a dict of builtins."""
    (tmp_path / "s.py").write_text(textwrap.dedent("""
        import sys, warnings
        main = sys.modules["__main__"]
        print(__file__, type(__builtins__).__name__, sys.argv[0], main.__spec__, main.__package__,
              type(main.__loader__).__name__, sorted(k for k in vars(main) if k.startswith("__")))
        warnings.warn("where am I")
    """))
    env = {"PYTHONPATH": REPO}
    strict = _run(["s.py"], env, cwd=tmp_path)
    defer = _run(["-m", "deferfuse", "s.py"], env, cwd=tmp_path)
    assert strict.returncode == defer.returncode == 0, defer.stderr
    assert defer.stdout == strict.stdout
    assert strict.stdout.startswith(f"{tmp_path / 's.py'} module s.py None None SourceFileLoader")
    assert f"{tmp_path / 's.py'}:6: UserWarning: where am I" in defer.stderr


@pytest.mark.parametrize("segments", ["default", "off"])
def test_python_m_prints_what_python_prints_on_stderr(tmp_path, segments):
    """A training loop logging at INFO whose scheduler reads a loss that requires grad with
    float(): torch's C++ warning names the caller's line (deferfuse's read wrapper was named), and JAX's
    INFO records of the backends it probed ("Unable to initialize backend 'tpu'") are not
    printed where deferfuse started JAX."""
    (tmp_path / "s.py").write_text(textwrap.dedent("""
        import logging, torch
        logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
        w = torch.ones(3, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1)
        for step in range(3):
            loss = (w * step).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            plateau.step(loss)   # (float(loss) in torch's code: the warning names that line)
            logging.info("loss %.2f", loss)
    """))
    env = {"PYTHONPATH": REPO, "DEFERFUSE_ALWAYS_COMPILE": "1"}
    if segments == "off":
        env["DEFERFUSE_EAGER_SEGMENTS"] = "0"
    strict = _run(["s.py"], env, cwd=tmp_path)
    defer = _run(["-m", "deferfuse", "s.py"], dict(env, TORCHTPU_MODE="defer"), cwd=tmp_path)
    assert strict.returncode == defer.returncode == 0, defer.stderr
    assert "lr_scheduler.py" in strict.stderr and "UserWarning: Converting a tensor with requires_grad" in strict.stderr
    assert defer.stderr == strict.stderr


@pytest.mark.parametrize("name", sorted(patches.SILENT_READS))
def test_reads_that_catch_no_warnings_are_silent_in_strict(name):
    """The read wrappers give torch's warnings the caller's location by catching them, except
    for the reads that never warn (a training loop's ``loss.item()``, every step): that they do
    not is torch's behaviour, checked here, so that a torch which starts to warn is noticed."""
    loss = (torch.ones(3, requires_grad=True) * 2).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        getattr(torch._C.TensorBase, name)(loss)
        getattr(loss, name)()


def test_defer_block_freezes_older_objects_out_of_full_collections():
    import gc
    assert gc.get_freeze_count() == 0
    with deferfuse.defer():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        # (not frozen again by the inner block; a frozen object that dies meanwhile, freed by
        # another thread, leaves the count: in a full run it fell by three)
        with deferfuse.defer():
            assert frozen - 64 <= gc.get_freeze_count() <= frozen
        assert frozen - 64 <= gc.get_freeze_count() <= frozen
    assert gc.get_freeze_count() == 0
    with deferfuse.config.override(gc_freeze=False), deferfuse.defer():
        assert gc.get_freeze_count() == 0


def test_freeze_bookkeeping_is_reentrant_on_one_thread():
    # a collection may run a finalizer that closes a defer block (an abandoned generator) while
    # this thread is inside the bookkeeping; it must not wait for itself
    import threading
    from deferfuse.modes import _GC_FREEZE

    def nested():
        with _GC_FREEZE.lock:
            _GC_FREEZE.enter()
            _GC_FREEZE.exit()

    worker = threading.Thread(target=nested, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert _GC_FREEZE.depth == 0


def test_defer_block_leaves_a_users_own_freeze_alone():
    import gc
    # (a process's first defer block sets things up once, dropping objects that were frozen: run
    # alone, this test saw the count fall by two)
    with deferfuse.defer():
        pass
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with deferfuse.defer():
            pass
        # neither frozen more (the count would grow) nor unfrozen (it would fall to zero); a
        # frozen object that dies meanwhile leaves the count, so it may fall by a few
        assert count - 64 <= gc.get_freeze_count() <= count
    finally:
        gc.unfreeze()


def test_garbage_from_before_a_defer_block_is_collected_after_it():
    import gc
    import weakref

    class Cycle:
        pass

    a = Cycle()
    a.self = a
    alive = weakref.ref(a)
    with deferfuse.defer():
        del a
        gc.collect()
    gc.collect()
    assert alive() is None


def test_torch_compile_inside_defer_does_not_trace_the_recorder():
    # The recorder's __torch_dispatch__ is marked for Dynamo to skip (instead of torch's
    # per-call wrapper): a compiled function called under defer must still run the recorder
    # untraced, give strict's result, and make Dynamo warn about nothing of ours.
    code = textwrap.dedent("""
        import warnings, torch, deferfuse
        @torch.compile(backend="eager")
        def f(x):
            return (x * 2).sin() + 1
        x = torch.linspace(-3, 3, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with deferfuse.defer():
                y = f(x) * 3
            y = y.clone()
        assert torch.equal(y, ((x * 2).sin() + 1) * 3), (y, x)
        dynamo = [str(w.message)[:200] for w in caught if "Dynamo" in str(w.message)]
        assert not dynamo, dynamo
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO}, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_young_collections_are_rarer_inside_a_defer_block_and_restored_after():
    import gc
    before = gc.get_threshold()
    with deferfuse.config.override(gc_young_threshold=50_000):
        with deferfuse.defer():
            inside = gc.get_threshold()
            with deferfuse.defer():   # nested: unchanged, restored only by the outermost
                assert gc.get_threshold() == inside
        assert gc.get_threshold() == before
    assert inside == (50_000, *before[1:])
    with deferfuse.config.override(gc_young_threshold=0):
        with deferfuse.defer():
            assert gc.get_threshold() == before


def test_a_threshold_changed_inside_the_block_is_left_as_set():
    import gc
    before = gc.get_threshold()
    try:
        with deferfuse.defer():
            gc.set_threshold(1234, *before[1:])
        assert gc.get_threshold() == (1234, *before[1:])
    finally:
        gc.set_threshold(*before)
