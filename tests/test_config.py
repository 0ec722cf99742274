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
