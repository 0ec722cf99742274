"""Programs under the settings users run with: every eager shortcut on (tests/user_defaults.py).

tests/conftest.py turns the eager shortcuts off for the rest of the suite, so the path most users
take is tested here: a ``with deferfuse.defer():`` block called several times runs its ops at
once at their first sighting, then replays its graph eagerly, replays it again while the
background thread compiles it, then runs it compiled, and the block tier may run it at once
(as strict) in between; the ``user_defaults`` fixture makes each happen at a known call.
Every call must match strict, step by step.

The first tests pin the bug that crashed a CNN trained one block per step: a backward op that
leaves an output undefined (convolution_backward's input gradient, with ``output_mask`` False for
an input that does not require grad) returns None there, which has no Value in the graph, and the
eager replay gave each later output of the op the result before it (None, or another gradient).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import deferfuse
from deferfuse import config
from oracle import assert_same
from user_defaults import forget_what_was_learned

aten = torch.ops.aten


# --------------------------------------------------------------------------- undefined outputs

def _randn(*shape: int, grad: bool = False, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(grad)


def _conv(x_grad: bool, bias: bool):
    def inputs():
        return [_randn(2, 3, 5, 5, grad=x_grad), _randn(4, 3, 3, 3, grad=True, seed=1)] + (
            [_randn(4, grad=True, seed=2)] if bias else [])
    return inputs, lambda x, w, *b: F.conv2d(x, w, *b)


def _norm(shape: tuple, channels: int, x_grad: bool, affine: bool, forward):
    def inputs():
        return [_randn(*shape, grad=x_grad)] + (
            [_randn(channels, grad=True, seed=1), _randn(channels, grad=True, seed=2)] if affine else [])
    return inputs, forward


def _layer_norm(x_grad: bool, affine: bool):
    return _norm((3, 6), 6, x_grad, affine, lambda x, *wb: F.layer_norm(x, (6,), *wb))


def _batch_norm(x_grad: bool, affine: bool):
    return _norm((4, 3, 2), 3, x_grad, affine, lambda x, *wb: F.batch_norm(x, None, None, *wb, training=True))


def _group_norm(x_grad: bool, affine: bool):
    return _norm((2, 4, 3), 4, x_grad, affine, lambda x, *wb: F.group_norm(x, 2, *wb))


def _grid_sample():
    def inputs():
        return [_randn(1, 2, 5, 5), _randn(1, 4, 4, 2, grad=True, seed=1)]
    return inputs, lambda x, grid: F.grid_sample(x, grid * 0.9, align_corners=False)


# name: (the backward op, (inputs, forward)); each backward leaves one of its outputs undefined
UNDEFINED_OUTPUTS = {
    "conv, input without grad": (aten.convolution_backward.default, _conv(x_grad=False, bias=False)),
    "conv with bias, input without grad": (aten.convolution_backward.default, _conv(x_grad=False, bias=True)),
    "conv without bias": (aten.convolution_backward.default, _conv(x_grad=True, bias=False)),
    "layer norm, input without grad": (aten.native_layer_norm_backward.default, _layer_norm(False, True)),
    "layer norm without affine": (aten.native_layer_norm_backward.default, _layer_norm(True, False)),
    "batch norm, input without grad": (aten.native_batch_norm_backward.default, _batch_norm(False, True)),
    "batch norm without affine": (aten.native_batch_norm_backward.default, _batch_norm(True, False)),
    "group norm, input without grad": (aten.native_group_norm_backward.default, _group_norm(False, True)),
    "group norm without affine": (aten.native_group_norm_backward.default, _group_norm(True, False)),
    "grid sample, input without grad": (aten.grid_sampler_2d_backward.default, _grid_sample()),
}


def _backward(forward, leaves: list) -> list:
    out = forward(*leaves)
    out.sin().sum().backward()
    return [out.detach()] + [t.grad for t in leaves if t.requires_grad]


# Where the recorded backward op runs: the first run of a graph replays it on torch's kernels;
# always_compile runs it in XLA; compute_engine="torch" runs compute-bound ops (convolutions, on
# a machine this slow even these small ones) on torch's kernels between XLA groups.
TIERS = {
    "eager replay": dict(always_compile=False, eager_first_runs=1, background_compile=False),
    "compiled": dict(always_compile=True),
    "compute on torch": dict(always_compile=False, compute_engine="torch", peak_gflops=1e-6,
                             eager_first_runs=0),
}


@pytest.fixture
def fresh():
    """Nothing learned: every graph is new, every op unseen; nothing at once but what a tier says."""
    forget_what_was_learned()
    with config.override(cache_dir="", eager_unseen_ops=False, eager_lone_ops=False, eager_blocks=False,
                         autotune_engine=False):
        yield
    forget_what_was_learned()


@pytest.mark.parametrize("case, tier", [
    (case, tier) for case in sorted(UNDEFINED_OUTPUTS) for tier in sorted(TIERS)
    # (only convolutions are compute-bound)
    if tier != "compute on torch" or case.startswith("conv")])
def test_an_undefined_output_in_each_tier(case, tier, fresh):
    _, (inputs, forward) = UNDEFINED_OUTPUTS[case]
    expected = _backward(forward, inputs())
    with config.override(**TIERS[tier]), deferfuse.defer():
        actual = _backward(forward, inputs())
    assert_same(expected, actual)


@pytest.mark.parametrize("user_defaults", ["deferred"], indirect=True)
@pytest.mark.parametrize("case", sorted(UNDEFINED_OUTPUTS))
def test_an_undefined_output_through_the_default_tiers(case, user_defaults):
    _, (inputs, forward) = UNDEFINED_OUTPUTS[case]
    expected = _backward(forward, inputs())
    for call in user_defaults.calls(4):
        with deferfuse.defer():
            actual = _backward(forward, inputs())
        assert_same(expected, actual, path=f"call {call}")


class _FirstCall(TorchDispatchMode):
    """Strict, keeping the arguments of the first call of ``op`` (cloned: autograd may free them)."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op = op
        self.args: tuple | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.op and self.args is None:
            clone = lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
            self.args = tuple(clone(a) for a in args)
            assert not kwargs
        return func(*args, **(kwargs or {}))


# (batch norm, input without grad: torch._decomp's native_batch_norm_backward computes grad_input
# whatever output_mask says; the recorder drops what the mask leaves undefined, as strict does)
@pytest.mark.parametrize("case", sorted(UNDEFINED_OUTPUTS))
def test_a_backward_op_called_alone(case, fresh):
    """The backward op called directly, alone in its block: where it is lowered (with nothing to
    fuse) it runs on torch's kernel (lone_op_on_torch), where it is not, as its decomposition."""
    op, (inputs, forward) = UNDEFINED_OUTPUTS[case]
    first = _FirstCall(op)
    with first:
        _backward(forward, inputs())
    assert first.args is not None, f"{op} did not run"
    expected = op(*first.args)
    assert any(out is None for out in expected)
    with config.override(always_compile=False, lone_op_on_torch=True), deferfuse.defer():
        actual = op(*first.args)
    assert_same(list(expected), list(actual))


# --------------------------------------------------------------------------- training, one block per step

def _train(make_model, make_opt, data: list, tiers=None) -> tuple[list, list, list]:
    """(losses, parameters after each step, per-call stats) of a training loop whose every step
    is one call of the same defer block (``tiers``: the user_defaults fixture), or strict."""
    model = make_model()
    opt = make_opt(model.parameters())
    losses, params, stats = [], [], []
    for call in (tiers.calls(len(data)) if tiers else range(1, len(data) + 1)):
        if call > 1 and tiers:
            stats.append(deferfuse.stats())   # (with the compile that finished after the call)
        deferfuse.reset_stats()
        x, target = data[call - 1]
        with deferfuse.defer() if tiers else deferfuse.strict():
            opt.zero_grad()
            loss = F.mse_loss(model(x), target) if target.is_floating_point() else F.cross_entropy(model(x), target)
            loss.backward()
            opt.step()
        losses.append(loss.detach().clone())
        params.append([p.detach().clone() for p in model.parameters()] + (
            [x.grad.clone()] if x.requires_grad else []))
    if tiers:
        stats.append(deferfuse.stats())
    return losses, params, stats


def _tier(stats: dict) -> str:
    """How a call ran its graphs, from its stats (with the compiles that finished after it)."""
    if stats["blocks_run_at_once"]:
        return "block at once"
    if stats["eager_replays"]:
        return "replay, compiling" if stats["background_compiles"] else "replay"
    return "compiled" if stats["executions"] else "torch"


def _tiers(stats: list[dict]) -> list[str]:
    # (the first call may replay the few ops it recorded: in-place ops never run at once)
    return ["first sighting" if stats[0]["unseen_ops_run"] else _tier(stats[0])] + [_tier(s) for s in stats[1:]]


def _expected_tiers(tiers, calls: int, compiled_from: int = 4) -> list[str]:
    """How each call runs: its graphs compiled from call ``compiled_from`` (later than call 4
    where an op is first reached at call 2: the parts of a decomposition, run at once at call 1
    as one op, say)."""
    runs = ["first sighting", "replay"] + ["replay, compiling"] * (compiled_from - 3)
    runs += ["compiled"] * (calls - compiled_from + 1)
    if tiers.block_tier == "measuring":
        # the first steady run (compiled) is timed, then the tier alternates
        runs[compiled_from::2] = ["block at once"] * len(runs[compiled_from::2])
    return runs


def _assert_trained_alike(strict, defer, tiers, calls: int, compiled_from: int = 4, **tol) -> None:
    (losses, params, _), (d_losses, d_params, stats) = strict, defer
    for call, (expected, actual) in enumerate(zip(zip(losses, params), zip(d_losses, d_params)), 1):
        assert_same(expected, actual, path=f"call {call} (loss, parameters)", **tol)
    assert _tiers(stats) == _expected_tiers(tiers, calls, compiled_from), stats


def _cnn(bias: bool):
    def make() -> nn.Module:
        torch.manual_seed(0)
        # (ReLU before the batch norm: a convolution's bias right before one has a gradient of
        # rounding noise, which Adam's normalization turns into steps of +-lr either way)
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=bias), nn.ReLU(), nn.BatchNorm2d(4),
                             nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 3 * 3, 5, bias=bias))
    return make


def _images(calls: int, input_grad: bool) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 3, 6, 6, generator=g).requires_grad_(input_grad),
             torch.randint(0, 5, (2,), generator=g)) for _ in range(calls)]


OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
}
CALLS = 6   # first sighting, replay, replay while compiling, compiled x 3 (or at once between)


@pytest.mark.parametrize("user_defaults", ["deferred"], indirect=True)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("input_grad", [False, True], ids=["input", "input-with-grad"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_cnn_training(bias, input_grad, optimizer, user_defaults):
    strict = _train(_cnn(bias), OPTIMIZERS[optimizer], _images(CALLS, input_grad))
    defer = _train(_cnn(bias), OPTIMIZERS[optimizer], _images(CALLS, input_grad), user_defaults)
    _assert_trained_alike(strict, defer, user_defaults, CALLS)


@pytest.mark.parametrize("user_defaults", ["measuring"], indirect=True)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_cnn_training_with_blocks_at_once_between(optimizer, user_defaults):
    strict = _train(_cnn(True), OPTIMIZERS[optimizer], _images(CALLS, False))
    defer = _train(_cnn(True), OPTIMIZERS[optimizer], _images(CALLS, False), user_defaults)
    _assert_trained_alike(strict, defer, user_defaults, CALLS)


class _Attention(nn.Module):
    """A pre-norm causal self-attention block written by hand, on scaled_dot_product_attention."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, width))


def _encoder_layer() -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True).train()


def _attention() -> nn.Module:
    torch.manual_seed(0)
    return _Attention()


def _sequences(calls: int) -> list:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)) for _ in range(calls)]


def _adamw_for_attention(params):
    # (eps 1e-3: the gradient of the keys' bias is rounding noise, softmax being invariant to a
    # shift of every score of a query, and at the default eps Adam turns it into steps of +-lr)
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


# (the hand-written block's layer norm reads the input, which needs no gradient: its backward,
# with a partial output_mask, has no lowering and is recorded as its decomposition from call 2)
@pytest.mark.parametrize("model, compiled_from", [(_encoder_layer, 4), (_attention, 4)],
                         ids=["encoder-layer", "sdpa-by-hand"])
def test_transformer_training(model, compiled_from, user_defaults):
    strict = _train(model, _adamw_for_attention, _sequences(CALLS))
    defer = _train(model, _adamw_for_attention, _sequences(CALLS), user_defaults)
    _assert_trained_alike(strict, defer, user_defaults, CALLS, compiled_from, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- the background thread

def test_a_background_compile_keeps_the_settings_of_the_block_that_queued_it(tmp_path, fresh):
    """config.override holds for its thread: the compile thread read the process-wide values
    instead, and saved the executable of a block run with another cache_dir (or none) there."""
    from deferfuse import engine
    x = torch.randn(13, 7)
    deferfuse.reset_stats()
    with config.override(cache_dir=str(tmp_path), always_compile=False, eager_first_runs=1,
                         background_compile=True):
        for _ in range(2):   # a replay, then a replay while the compile thread compiles it
            with deferfuse.defer():
                y = (x * 1.25).sin() + x
        assert engine.wait_for_compiles(600)
    torch.testing.assert_close(y, (x * 1.25).sin() + x)
    assert deferfuse.stats()["background_compiles"] >= 1
    assert any(tmp_path.iterdir()), "the executable was not saved in the block's cache_dir"
