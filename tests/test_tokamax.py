"""deferfuse.kernels.tokamax: Google's tokamax kernels as torch ops (the extra deferfuse[tokamax]),
each against the same math in torch ops, forward and gradients, strict and deferred; a zoo model
with attn_implementation="tokamax" trains as strict SDPA does.

Skipped where tokamax is not installed, except the test of what a missing tokamax says.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import deferfuse
from deferfuse.kernels import tokamax as tk
from oracle import seeded_randn
from zoo_training import assert_trains_as

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_TOKAMAX = importlib.util.find_spec("tokamax") is not None
needs_tokamax = pytest.mark.skipif(not HAVE_TOKAMAX, reason="tokamax is not installed (pip install 'deferfuse[tokamax]')")

MODES = {"strict": contextlib.nullcontext, "defer": deferfuse.defer}

pytestmark = pytest.mark.usefixtures("always_compile")


def _compare(mode, op, reference, args, kwargs=None, rtol=1e-5, atol=1e-5):
    """``op(*args, **kwargs)`` under ``mode`` against ``reference`` in strict torch: the output
    and the gradients of its float tensor arguments, through a random weighting of the output."""
    kwargs = kwargs or {}

    def leaves():
        return [a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                for a in args]

    want_args = leaves()
    want = reference(*want_args, **kwargs)
    weight = seeded_randn(*want.shape, seed=99).to(want.dtype)
    (want * weight).sum().backward()
    got_args = leaves()
    deferfuse.reset_stats()
    with MODES[mode]():
        got = op(*got_args, **kwargs)
        (got * weight).sum().backward()
    assert deferfuse.stats()["fallbacks"] == {}
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    for g, w in zip(got_args, want_args):
        if isinstance(g, torch.Tensor) and g.requires_grad:
            torch.testing.assert_close(g.grad, w.grad, rtol=rtol, atol=atol)


# -- torch references: the same math in torch ops ---------------------------------------------

def attention_torch(query, key, value, bias=None, mask=None, query_seq_lengths=None, key_value_seq_lengths=None, *,
                    scale=None, is_causal=False, local_window_size=None, logits_soft_cap=None):
    """(B, T, N, H) layout, grouped-query heads (no query_seq_lengths: rows past them are unspecified)."""
    assert query_seq_lengths is None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        logits = logits + bias
    if logits_soft_cap is not None:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    t, s = logits.shape[-2:]
    rows, cols = torch.arange(t)[:, None], torch.arange(s)[None, :]
    keep = torch.ones(t, s, dtype=torch.bool)
    if is_causal:
        keep = keep & (cols <= rows)
    if local_window_size is not None:
        before, after = local_window_size
        keep = keep & (cols >= rows - before) & (cols <= rows + after)
    if mask is not None:
        keep = keep & mask
    if key_value_seq_lengths is not None:
        keep = keep & (torch.arange(s) < key_value_seq_lengths[:, None, None, None])
    logits = logits.masked_fill(~keep, torch.finfo(logits.dtype).min)
    return (logits.softmax(-1) @ v).transpose(1, 2)


def layer_norm_torch(x, scale, offset, *, axis=-1, epsilon=1e-6, scale_offset=0.0, subtract_mean=True):
    if subtract_mean:
        x = x - x.mean(axis, keepdim=True)
    y = x * torch.rsqrt(x.square().mean(axis, keepdim=True) + epsilon)
    shape = [1] * x.dim()
    shape[axis] = x.shape[axis]
    if scale is not None:
        y = y * (scale + scale_offset).reshape(shape)
    if offset is not None:
        y = y + offset.reshape(shape)
    return y


def glu_torch(x, weights, *, activation=None):
    acts = {None: lambda t: t, "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
            "relu": F.relu, "sigmoid": torch.sigmoid}
    return acts[activation](x @ weights[:, 0]) * (x @ weights[:, 1])


def ragged_dot_torch(lhs, rhs, group_sizes):
    rows, start = [], 0
    for g, n in enumerate(group_sizes.tolist()):
        rows.append(lhs[start:start + n] @ rhs[g])
        start += n
    rows.append(lhs.new_zeros(lhs.shape[0] - start, rhs.shape[-1]))
    return torch.cat(rows)


def lce_torch(x, labels, weights, *, reduction="sum"):
    return F.cross_entropy(x @ weights, labels, reduction=reduction)


# -- the ops ------------------------------------------------------------------------------------

@needs_tokamax
@pytest.mark.parametrize("mode", MODES)
def test_dot_product_attention_equals_torch(mode):
    q, k, v = seeded_randn(2, 8, 4, 16), seeded_randn(2, 8, 2, 16, seed=1), seeded_randn(2, 8, 2, 16, seed=2)
    _compare(mode, tk.dot_product_attention, attention_torch, (q, k, v), dict(is_causal=True))
    bias, mask = seeded_randn(2, 1, 8, 8, seed=3), seeded_randn(2, 4, 8, 8, seed=4) > -1
    lengths = torch.tensor([8, 5])
    _compare(mode, tk.dot_product_attention, attention_torch, (q, k, v, bias, mask, None, lengths),
             dict(scale=0.3, logits_soft_cap=5.0))
    window = dict(local_window_size=[2, 1])
    _compare(mode, lambda *a, **kw: tk.dot_product_attention(*a, None, None, None, **window, **kw),
             lambda *a, **kw: attention_torch(*a, local_window_size=(2, 1), **kw), (q, k, v))


@needs_tokamax
@pytest.mark.parametrize("mode", MODES)
def test_layer_norm_and_rms_norm_equal_torch(mode):
    x, scale, offset = seeded_randn(3, 5, 16), seeded_randn(16, seed=1), seeded_randn(16, seed=2)
    _compare(mode, tk.layer_norm, layer_norm_torch, (x, scale, offset), dict(epsilon=1e-5))
    _compare(mode, tk.layer_norm, layer_norm_torch, (x, scale, None),
             dict(subtract_mean=False, scale_offset=1.0))
    _compare(mode, tk.layer_norm, layer_norm_torch, (x, seeded_randn(5, seed=3), None), dict(axis=1))


@needs_tokamax
@pytest.mark.parametrize("mode", MODES)
def test_gated_linear_unit_equals_torch(mode):
    x, weights = seeded_randn(2, 6, 16), seeded_randn(16, 2, 8, seed=1)
    for activation in ("silu", "gelu", None):
        _compare(mode, tk.gated_linear_unit, glu_torch, (x, weights), dict(activation=activation))
    _compare(mode, lambda *a: tk.gated_linear_unit(*a, activation="relu", precision="highest"),
             lambda *a: glu_torch(*a, activation="relu"), (x, weights))


@needs_tokamax
@pytest.mark.parametrize("mode", MODES)
def test_ragged_dot_equals_torch(mode):
    lhs, rhs = seeded_randn(12, 16), seeded_randn(3, 16, 8, seed=1)
    for sizes in ([3, 0, 7], [4, 4, 4]):       # rows past the groups' sum are zero
        _compare(mode, tk.ragged_dot, ragged_dot_torch, (lhs, rhs, torch.tensor(sizes)))
    with MODES[mode]():
        wide = tk.ragged_dot(lhs, rhs, torch.tensor([4, 4, 4]), preferred_element_type=torch.float64)
    assert wide.dtype == torch.float64
    torch.testing.assert_close(wide, ragged_dot_torch(lhs.double(), rhs.double(), torch.tensor([4, 4, 4])))


@needs_tokamax
@pytest.mark.parametrize("mode", MODES)
def test_linear_softmax_cross_entropy_loss_equals_torch(mode):
    x, weights, labels = seeded_randn(10, 16), seeded_randn(16, 11, seed=1), torch.arange(10) % 11
    for reduction in ("sum", "mean"):
        _compare(mode, tk.linear_softmax_cross_entropy_loss, lce_torch, (x, labels, weights),
                 dict(reduction=reduction), rtol=1e-4)


@needs_tokamax
def test_sin_layer_norm_add_sum_is_one_xla_execution_with_no_fallback():
    x, scale = seeded_randn(16, 32), seeded_randn(32, seed=1)
    deferfuse.reset_stats()
    with deferfuse.defer():
        total = (tk.layer_norm(torch.sin(x), scale, None) + 1).sum()
    stats = deferfuse.stats()
    torch.testing.assert_close(total, (layer_norm_torch(torch.sin(x), scale, None) + 1).sum())
    assert stats["executions"] == 1 and stats["fallbacks"] == {} and stats["eager_replays"] == 0, stats


@needs_tokamax
def test_opcheck_passes_for_every_op():
    x = seeded_randn(4, 16).requires_grad_()
    q, k = seeded_randn(1, 4, 2, 8).requires_grad_(), seeded_randn(1, 4, 1, 8, seed=1).requires_grad_()
    calls = [
        (tk.dot_product_attention, (q, k, k), {"is_causal": True}),
        (tk.layer_norm, (x, seeded_randn(16, seed=1).requires_grad_(), None), {}),
        (tk.gated_linear_unit, (x, seeded_randn(16, 2, 8, seed=1).requires_grad_()), {"activation": "silu"}),
        (tk.ragged_dot, (x, seeded_randn(3, 16, 8, seed=1).requires_grad_(), torch.tensor([1, 2, 1])), {}),
        (tk.linear_softmax_cross_entropy_loss, (x, torch.tensor([0, 3, 1, 2]), seeded_randn(16, 5, seed=1)), {}),
    ]
    for op, args, kwargs in calls:
        assert set(torch.library.opcheck(op.op, args, kwargs).values()) == {"SUCCESS"}, op


@needs_tokamax
@pytest.mark.parametrize("mode", MODES)
def test_bad_input_names_the_op_and_leaves_nothing_pending(mode):
    x, weights = seeded_randn(2, 16), seeded_randn(16, 2, 8, seed=1)
    with MODES[mode]():
        with pytest.raises(ValueError, match=r"tokamax::gated_linear_unit.*unknown activation 'nope'.*silu"):
            tk.gated_linear_unit(x, weights, activation="nope")
        after = x * 2
    torch.testing.assert_close(after, x * 2)


# -- transformers --------------------------------------------------------------------------------

@needs_tokamax
def test_hf_attention_takes_boolean_and_additive_masks_as_sdpa():
    q, k, v = seeded_randn(2, 4, 6, 8), seeded_randn(2, 2, 6, 8, seed=1), seeded_randn(2, 2, 6, 8, seed=2)   # SDPA's layout
    keep = seeded_randn(2, 1, 6, 6, seed=3) > -0.5
    additive = torch.zeros(2, 1, 6, 6).masked_fill(~keep, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    for mask, causal in ((keep, None), (additive, None), (None, True)):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=bool(causal), scale=0.5,
                                              enable_gqa=True).transpose(1, 2)
        got, weights = tk.hf_attention(module, q, k, v, mask, scaling=0.5, is_causal=causal)
        assert weights is None
        torch.testing.assert_close(got, want)


@needs_tokamax
def test_tiny_llama_with_tokamax_attention_trains_as_strict_sdpa():
    name = tk.register_with_transformers()
    assert name == "tokamax"
    assert_trains_as("tokamax", "sdpa")


# -- a missing tokamax ---------------------------------------------------------------------------

def test_importing_the_module_imports_neither_tokamax_nor_jax():
    code = ("import sys, deferfuse.kernels.tokamax as tk; "
            "print(tk.layer_norm.op, 'tokamax' in sys.modules, 'jax' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == ["tokamax.layer_norm.default", "False", "False"]


def test_a_missing_tokamax_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokamax", None)      # (import tokamax raises ImportError)
    with pytest.raises(ImportError, match=r"pip install 'deferfuse\[tokamax\]'"):
        tk.register_with_transformers("tokamax_missing")
    for mode in MODES.values():
        with mode(), pytest.raises(ImportError, match=r"tokamax::layer_norm.*pip install 'deferfuse\[tokamax\]'"):
            tk.layer_norm(seeded_randn(3, 7, seed=5), None, None, epsilon=0.125)   # (a shape and eps no test traced)
