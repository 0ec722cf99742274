"""Settings: lookups, overrides and their errors."""

import threading

import pytest

from deferfuse import config


def test_unknown_setting_is_named_in_the_error():
    with pytest.raises(KeyError, match="unknown deferfuse setting 'no_such_setting'"):
        config.get("no_such_setting")
    with pytest.raises(KeyError, match="unknown deferfuse setting"):
        with config.override(no_such_setting=1):
            pass


def test_innermost_override_wins_and_is_undone():
    base = config.get("max_pending_nodes")
    outside = config.get("record_source")
    with config.override(max_pending_nodes=base + 1):
        assert config.get("max_pending_nodes") == base + 1
        with config.override(max_pending_nodes=base + 2, record_source=False):
            assert config.get("max_pending_nodes") == base + 2
            assert config.get("record_source") is False
        assert config.get("max_pending_nodes") == base + 1
        # a setting the override does not name keeps its global value
        assert config.get("record_source") is outside
    assert config.get("max_pending_nodes") == base


def test_overrides_belong_to_their_thread():
    base = config.get("max_pending_nodes")
    seen = []
    with config.override(max_pending_nodes=base + 7):
        worker = threading.Thread(target=lambda: seen.append(config.get("max_pending_nodes")))
        worker.start()
        worker.join()
    assert seen == [base]


def test_shortcuts_apply_their_override_rules_in_one_place():
    # always_compile turns every eager shortcut off
    with config.override(always_compile=True):
        s = config.shortcuts()
        assert s.always_compile and not any([s.unseen_ops_at_once, s.lone_ops_at_once, s.host_scalars_at_once,
                                            s.blocks_timed, s.segments_timed, s.lone_op_on_torch, s.tiny_graphs_replay,
                                            s.background_compile, s.autotune_engine])
        assert s.small_flush_nodes == 0 and s.eager_first_runs == 0
    # compiling at first sight: no unseen op runs at once, nothing compiles in the background
    with config.override(always_compile=False, eager_first_runs=0, eager_unseen_ops=True, background_compile=True):
        s = config.shortcuts()
        assert not s.unseen_ops_at_once and not s.background_compile
    # an op runs at once where its flush was lone only if a lone flush runs on torch's kernel
    with config.override(always_compile=False, eager_lone_ops=True, lone_op_on_torch=False):
        assert not config.shortcuts().lone_ops_at_once
    with config.override(always_compile=False, eager_lone_ops=True, lone_op_on_torch=True,
                         eager_blocks=True, eager_first_runs=2, eager_small_flush=5):
        s = config.shortcuts()
        assert s.lone_ops_at_once and s.blocks_timed and s.eager_first_runs == 2 and s.small_flush_nodes == 5


def test_the_host_kernels_threshold_is_a_compile_setting():
    """``host_kernel_min_flops`` routes products between torch's kernels and XLA's dots by
    shape: it changes compiled code, so it is part of the executable cache key."""
    setting = config.settings()["host_kernel_min_flops"]
    assert setting.type is int and setting.default == -1 and setting.affects_compile
    assert setting.parse("0") == 0 and setting.env_var == "DEFERFUSE_HOST_KERNEL_MIN_FLOPS"
    keys = set()
    for threshold in (0, 1 << 20, 1 << 24):
        with config.override(host_kernel_min_flops=threshold):
            keys.add(config.compile_key())
    assert len(keys) == 3
