"""Meta inference without importing Dynamo (deferfuse/capture/dynamo_free.py).  The fresh-process
check that a one-off script never imports torch._dynamo is in test_cache.py."""

import sys

import pytest
import torch

from deferfuse.capture import dynamo_free
from deferfuse.capture.dynamo_free import _SLOT, _UntilDynamoLoads, no_dynamo_import


def test_reference_wrappers_are_found():
    found = dynamo_free._find_wrapped()
    names = {fn.__name__ for fn, _ in found}
    # torch's elementwise references, the meta kernels of add, sub, where, ... (unary and
    # binary ones made by a factory are all named _ref)
    assert {"add", "sub", "where", "_ref"} <= names, sorted(names)
    assert len(found) > 100


def test_stand_ins_are_removed_on_the_way_out(monkeypatch):
    # as if Dynamo were not imported (in this test process it may be)
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    monkeypatch.setattr(dynamo_free, "_WRAPPED", None)
    found = dynamo_free._find_wrapped()
    before = {id(fn): getattr(fn, _SLOT, None) for fn, _ in found}
    with no_dynamo_import():
        placed = [fn for fn, _ in found if isinstance(getattr(fn, _SLOT, None), _UntilDynamoLoads)]
        assert placed, "no stand-in was placed"
        x = torch.empty(3, 4, device="meta")
        assert (x + torch.tanh(x)).shape == (3, 4)
    after = {id(fn): getattr(fn, _SLOT, None) for fn, _ in found}
    assert after == before


def test_meta_errors_pass_through():
    x = torch.empty(3, device="meta")
    y = torch.empty(4, device="meta")
    with pytest.raises(RuntimeError) as outside:
        torch.add(x, y)
    with no_dynamo_import(), pytest.raises(RuntimeError) as inside:
        torch.add(x, y)
    assert str(inside.value) == str(outside.value)


def test_stand_in_builds_dynamos_disable_once_dynamo_is_loaded():
    import torch._dynamo  # noqa: F401 - loaded, as another thread might have done

    def f(a):
        return a + 1

    stand_in = _UntilDynamoLoads(f, True)
    setattr(f, _SLOT, stand_in)
    assert stand_in(1) == 2
    disabled = getattr(f, _SLOT)
    assert disabled is not stand_in and disabled(2) == 3
