"""What leaves the process carries strict's values (issue 42): a model trained under defer mode,
then saved, scripted, exported, copied or handed to NumPy and JAX, inside the block, on every
path (first sighting at once, replayed, compiled), compared with strict's."""

from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import pytest
import torch
from torch import nn

import deferfuse
from deferfuse import config, engine
from deferfuse.exec import diskcache


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))


def _trained(mode: str) -> nn.Module:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with deferfuse.mode(mode):
        for _ in range(3):
            x = torch.randn(8, 6, generator=g)
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


def _state_dict(m):
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    fresh = _model().eval()
    fresh.load_state_dict(torch.load(buf))
    return fresh


def _safetensors(m):
    from safetensors.torch import load, save
    fresh = _model().eval()
    fresh.load_state_dict(load(save(m.state_dict())))
    return fresh


def _script(m):
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(m), buf)
    buf.seek(0)
    return torch.jit.load(buf)


def _trace(m):
    buf = io.BytesIO()
    torch.jit.save(torch.jit.trace(m, (torch.randn(4, 6),)), buf)
    buf.seek(0)
    return torch.jit.load(buf)


def _export(m):
    dim = torch.export.Dim("b", min=1, max=64)
    ep = torch.export.export(m, (torch.randn(4, 6),), dynamic_shapes={"input": {0: dim}})
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    return torch.export.load(buf).module()


def _numpy(m):
    arrays = {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}
    fresh = _model().eval()
    fresh.load_state_dict({k: torch.from_numpy(a) for k, a in arrays.items()})
    return fresh


def _jax(m):
    import jax.dlpack
    arrays = {k: np.asarray(jax.dlpack.from_dlpack(v.detach().contiguous())) for k, v in m.state_dict().items()}
    fresh = _model().eval()
    fresh.load_state_dict({k: torch.from_numpy(a.copy()) for k, a in arrays.items()})
    return fresh


FORMATS = {"torch.save": _state_dict, "safetensors": _safetensors, "pickle": lambda m: pickle.loads(pickle.dumps(m)),
           "deepcopy": copy.deepcopy, "jit.script": _script, "jit.trace": _trace, "export": _export,
           "numpy": _numpy, "dlpack to jax": _jax}
PATHS = {
    "first sighting": dict(always_compile=False, eager_unseen_ops=True, eager_first_runs=1),
    "replay": dict(always_compile=False, eager_unseen_ops=False, eager_first_runs=1),
    "compiled": dict(always_compile=True),
    "warm disk cache": dict(always_compile=True),
}


@pytest.fixture(scope="module")
def warm_folder(tmp_path_factory):
    """A disk cache folder holding the defer training's executables."""
    folder = str(tmp_path_factory.mktemp("warm"))
    engine.clear_cache()
    diskcache.clear()
    with config.override(cache_dir=folder, background_compile=False, **PATHS["compiled"]):
        _trained("defer")
    engine.clear_cache()
    return folder


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(FORMATS))
def test_a_model_leaves_the_process_with_strict_values(name, path, warm_folder):
    engine.wait_for_compiles()
    x = torch.randn(7, 6)
    strict = _trained("strict")
    with torch.no_grad():
        expected = strict(x)
    warm = path == "warm disk cache"
    with config.override(cache_dir=warm_folder if warm else "", background_compile=False, **PATHS[path]):
        if warm:
            # (nothing in memory: the training loads each executable from the disk, as a
            # second process would)
            engine.clear_cache()
            deferfuse.reset_stats()
        model = _trained("defer")
        if warm:
            assert deferfuse.stats()["disk_cache_hits"] > 0
        with deferfuse.defer():   # (saved, scripted, exported from inside a block)
            out = FORMATS[name](model)
    with torch.no_grad():
        got = out(x)
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
