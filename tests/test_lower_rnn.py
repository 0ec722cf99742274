"""nn.LSTM's oneDNN layer ops (deferfuse/lower/rnn.py) against strict PyTorch.

On the CPU a float32 or bfloat16 nn.LSTM without projections reaches aten as one
mkldnn_rnn_layer call per layer and direction, and mkldnn_rnn_layer_backward under autograd;
float64, proj_size > 0 and nn.GRU take the generic path of matmuls and pointwise ops.
test_which_ops pins this, so that each case below is known to exercise what it says.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import deferfuse
from oracle import assert_same, ops_of, run_both
from oracle import check as _check
from oracle import lowered as _lowered

aten = torch.ops.aten
LAYER = aten.mkldnn_rnn_layer.default
LAYER_BACKWARD = aten.mkldnn_rnn_layer_backward.default


def lowered(fn, *inputs):
    """Compared with strict at torch.testing's default tolerances for the dtype; nothing fell
    back to eager torch (the forward layer under grad mode is recorded and placed on torch's
    kernel inside the graph, not a fallback: lower/rnn.py).  Decompositions are allowed, but not
    of the layer ops: the gradients of h0 and c0 go through select_backward (mkldnn_rnn takes
    each layer's state as ``hx[index]``), which deferfuse decomposes."""
    deferfuse.reset_stats()
    out = _check(fn, *inputs)
    assert out is not None, "strict raised: nothing was compared"
    stats = deferfuse.stats()
    assert not stats["fallbacks"], f"fell back: {stats['fallbacks']}"
    assert not {str(LAYER), str(LAYER_BACKWARD)} & set(stats["decompositions"])
    return out


def fully_lowered(fn, *inputs):
    """As ``lowered``, and nothing fell back at all (no grad mode: the forward is lowered too)."""
    out = _lowered(fn, *inputs, compared=True, decompositions=True)
    assert not {str(LAYER), str(LAYER_BACKWARD)} & set(deferfuse.stats()["decompositions"])
    return out


def make_lstm(dtype=torch.float32, seed=0, **options):
    torch.manual_seed(seed)
    return torch.nn.LSTM(3, 5, **options).to(dtype)


def lstm_inputs(lstm, steps=6, batch=2, states=False, seed=1):
    """(input, and with ``states`` h0, c0), all requiring grad, for ``lstm``'s layout."""
    g = torch.Generator().manual_seed(seed)
    dtype = lstm.weight_ih_l0.dtype
    shape = (batch, steps, 3) if lstm.batch_first else (steps, batch, 3)
    if batch is None:
        shape = (steps, 3)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    if not states:
        return (x,)
    layers = lstm.num_layers * (2 if lstm.bidirectional else 1)
    state_shape = (layers, 5) if batch is None else (layers, batch, 5)
    h0, c0 = (torch.randn(state_shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
              for _ in range(2))
    return x, h0, c0


def forward_and_grads(lstm):
    """The outputs of ``lstm`` and the gradients of a loss over all three of them with respect to
    the input, the states given and every weight.  The loss weights the outputs unevenly, so
    each gradient of output, hy and cy reaches the backward."""
    def run(x, *states):
        out, (hy, cy) = lstm(x, tuple(states)) if states else lstm(x)
        loss = (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sin().sum() \
            + (hy * 0.5).sum() + cy.square().sum()
        return (out, hy, cy, *torch.autograd.grad(loss, [x, *states, *lstm.parameters()]))
    return run


# -- which ops reach aten ------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:LSTM with projections")
def test_which_ops():
    (x,) = lstm_inputs(make_lstm())
    reached = ops_of(forward_and_grads(make_lstm(num_layers=2, bidirectional=True)), x)
    assert {LAYER, LAYER_BACKWARD} <= reached
    for other in (make_lstm(torch.float64), make_lstm(proj_size=2)):
        assert not {LAYER, LAYER_BACKWARD} & ops_of(forward_and_grads(other), *lstm_inputs(other))
    gru = torch.nn.GRU(3, 5)
    assert not {LAYER, LAYER_BACKWARD} & ops_of(lambda x: gru(x)[0].sum().backward(), x)


# -- forward and backward ------------------------------------------------------------------------

CASES = {
    "one-layer": dict(),
    "two-layers-bidirectional-batch-first": dict(num_layers=2, bidirectional=True, batch_first=True),
    "bidirectional-states": dict(bidirectional=True, states=True),
    "no-bias-two-layers-states": dict(num_layers=2, bias=False, states=True),
    "one-step": dict(steps=1, states=True),
    "batch-of-one-batch-first": dict(batch=1, batch_first=True, states=True),
    "unbatched": dict(batch=None, states=True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_lstm(case):
    case = dict(case)
    shapes = {k: case.pop(k) for k in ("steps", "batch", "states") if k in case}
    lstm = make_lstm(**case)
    lowered(forward_and_grads(lstm), *lstm_inputs(lstm, **shapes))


def test_lstm_bfloat16():
    lstm = make_lstm(torch.bfloat16, num_layers=2, bidirectional=True)
    lowered(forward_and_grads(lstm), *lstm_inputs(lstm, states=True))


def test_lstm_without_grad():
    lstm = make_lstm(num_layers=2)
    (x,) = lstm_inputs(lstm)

    def run(x):
        with torch.no_grad():
            out, (hy, cy) = lstm(x)
        return out, hy, cy
    fully_lowered(run, x.detach())


def test_long_sequence():
    # a scan, not an unrolled loop: 128 steps compile as fast as a few
    lstm = make_lstm()
    lowered(forward_and_grads(lstm), *lstm_inputs(lstm, steps=128, states=True))


def test_forward_on_torch_backward_lowered():
    # the backward recomputes what it needs: it never reads the forward's workspace
    lstm = make_lstm(bidirectional=True)
    (x,) = lstm_inputs(lstm)
    out, (hy, cy) = lstm(x)
    expected = torch.autograd.grad(out.sum() + cy.sum(), [x, *lstm.parameters()], retain_graph=True)
    deferfuse.reset_stats()
    with deferfuse.config.override(always_compile=True), deferfuse.defer():
        actual = torch.autograd.grad(out.sum() + cy.sum(), [x, *lstm.parameters()])
    assert_same(expected, actual)
    assert not deferfuse.stats()["fallbacks"], deferfuse.stats()["fallbacks"]


@pytest.mark.parametrize("backward_in_the_block", [False, True])
def test_backward_after_the_block(backward_in_the_block):
    """The forward under defer, ``loss.backward()`` outside the block or in a later one (torch's
    backward would read a lowered forward's workspace: NaN, or SIGSEGV)."""
    lstm = make_lstm(num_layers=2, bidirectional=True)
    (x,) = lstm_inputs(lstm)
    out, (hy, cy) = lstm(x)
    expected = torch.autograd.grad(out.sin().sum() + cy.sum(), [x, *lstm.parameters()])
    for settings in (dict(always_compile=True), {}):
        with deferfuse.config.override(**settings):
            with deferfuse.defer():
                out, (hy, cy) = lstm(x)
                loss = out.sin().sum() + cy.sum()
            with deferfuse.defer() if backward_in_the_block else deferfuse.strict():
                actual = torch.autograd.grad(loss, [x, *lstm.parameters()])
        assert_same(expected, actual)


def test_direct_calls():
    # each gradient of output, hy and cy may be undefined (None); the bias gradient comes
    # twice, also without biases
    g = torch.Generator().manual_seed(2)
    shapes = [(4, 2, 3), (20, 3), (20, 5), (20,), (20,), (2, 5), (2, 5), (4, 2, 5)]
    x, w_ih, w_hh, b_ih, b_hh, h, c, grad = (torch.randn(shape, generator=g) for shape in shapes)

    def run(x, w_ih, w_hh, b_ih, b_hh, h, c, grad):
        results = []
        for reverse, has_biases in ((False, True), (True, False)):
            biases = (b_ih, b_hh) if has_biases else (torch.zeros_like(w_ih), torch.zeros_like(w_hh))
            out, hy, cy, workspace = LAYER(x, w_ih, w_hh, *biases, h, c, reverse, [], 2, 5, 1,
                                           has_biases, False, False, True)
            for grads in ((grad, None, None), (None, h, None), (None, None, c), (grad, h, c)):
                results.append(LAYER_BACKWARD(x, w_ih, w_hh, *biases, h, c, out, hy, cy, *grads,
                                              reverse, 2, 5, 1, has_biases, True, False, [], False,
                                              workspace))
            results.append((out, hy, cy))
        return results
    lowered(run, x, w_ih, w_hh, b_ih, b_hh, h, c, grad)


def test_invalid_calls_raise_torchs_error():
    def layer(mode):
        return lambda x, w_ih, w_hh, b, h: LAYER(x, w_ih, w_hh, b, b, h, h, False, [], mode, 5, 1,
                                                 True, False, False, False)
    shapes = [(4, 2, 3), (20, 3), (20, 5), (20,), (2, 5)]
    inputs = [torch.zeros(shape, dtype=torch.float64) for shape in shapes]
    # get_mkldnn_dtype: unsupported data type (raised at record time, by the checker's replay)
    expected, actual, _, _ = run_both(layer(2), *inputs)
    assert expected is None and actual is None
    # a GRU's shapes, mode 3: declined (oneDNN builds only LSTM primitives; torch's kernel raises)
    gru = [t.float()[:15] if t.shape[0] == 20 else t.float() for t in inputs]
    expected, actual, _, _ = run_both(layer(3), *gru)
    assert expected is None and actual is None


# -- what takes the generic path still gives strict's results ------------------------------------

@pytest.mark.filterwarnings("ignore:LSTM with projections")
def test_float64_and_projections():
    for lstm in (make_lstm(torch.float64, num_layers=2, bidirectional=True), make_lstm(proj_size=2)):
        deferfuse.reset_stats()
        inputs = lstm_inputs(lstm, states=lstm.proj_size == 0)
        expected, actual, _, _ = run_both(forward_and_grads(lstm), *inputs)
        assert_same(expected, actual)
        assert not deferfuse.stats()["fallbacks"], deferfuse.stats()["fallbacks"]


def test_gru():
    torch.manual_seed(0)
    gru = torch.nn.GRU(3, 5, num_layers=2, bidirectional=True)
    (x,) = lstm_inputs(make_lstm())

    def run(x):
        out, hy = gru(x)
        return (out, hy, *torch.autograd.grad(out.sin().sum() + hy.sum(), [x, *gru.parameters()]))
    deferfuse.reset_stats()
    expected, actual, _, _ = run_both(run, x)
    assert_same(expected, actual)
    assert not deferfuse.stats()["fallbacks"], deferfuse.stats()["fallbacks"]


# -- a small sequence model, trained -------------------------------------------------------------

class Tagger(torch.nn.Module):
    """A two-layer bidirectional LSTM with dropout between its layers, and a linear head."""

    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(4, 6, num_layers=2, bidirectional=True, batch_first=True, dropout=0.25)
        self.head = torch.nn.Linear(12, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out)


def train_tagger(defer: bool, steps: int = 3, calls=None):
    """(losses, model, optimizer) of ``steps`` AdamW steps; ``calls``: the user_defaults
    fixture's, each step one call of the same defer block."""
    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 7, 4, generator=g), torch.randint(0, 3, (2, 7), generator=g))
            for _ in range(steps)]
    torch.manual_seed(2)   # the dropout masks
    losses = []
    for x, target in (data if calls is None else (data[call - 1] for call in calls(steps))):
        with deferfuse.defer() if defer else deferfuse.strict():
            opt.zero_grad()
            loss = F.cross_entropy(model(x).reshape(-1, 3), target.reshape(-1))
            loss.backward()
            opt.step()
        losses.append(loss.item())
    return losses, model, opt


def test_lstm_tagger_trains():
    strict = train_tagger(defer=False)
    deferfuse.reset_stats()
    with deferfuse.config.override(always_compile=True):
        deferred = train_tagger(defer=True)
    # (the forward layers under grad mode run on torch's kernel inside the graph: lower/rnn.py)
    assert not deferfuse.stats()["fallbacks"], deferfuse.stats()["fallbacks"]
    assert_trained_alike(strict, deferred)


def assert_trained_alike(strict, deferred):
    (losses, model, opt), (losses_d, model_d, opt_d) = strict, deferred
    assert_same(torch.tensor(losses), torch.tensor(losses_d), path="losses")
    assert_same(list(model.parameters()), list(model_d.parameters()), path="parameters")
    assert_same([s["exp_avg_sq"] for s in opt.state.values()],
                [s["exp_avg_sq"] for s in opt_d.state.values()], path="optimizer state")


def test_lstm_tagger_trains_with_the_default_settings(user_defaults):
    """Every setting at its default (first sightings at once, eager replays while compiling,
    compiled runs, the block tier measuring or deferred), one defer block per step: strict's
    losses, parameters and optimizer state, and no fallback."""
    strict = train_tagger(defer=False, steps=5)
    deferfuse.reset_stats()
    deferred = train_tagger(defer=True, steps=5, calls=user_defaults.calls)
    assert not deferfuse.stats()["fallbacks"], deferfuse.stats()["fallbacks"]
    assert_trained_alike(strict, deferred)


@pytest.mark.parametrize("backward_mode", ["debug", "retain-graph-twice"])
def test_backward_of_a_deferred_forward_under_grad(backward_mode):
    """The forward layer recorded under grad mode (torch's kernel, inside the graph) and its
    backward run where deferfuse does not lower it: under debug mode, or twice over a kept graph
    (once deferred, once strict).  Every gradient is strict's."""
    lstm = make_lstm(num_layers=2, bidirectional=True)
    x, h0, c0 = lstm_inputs(lstm, states=True)
    params = [x, h0, c0, *lstm.parameters()]

    def loss_of(out, hy, cy):
        return out.sin().sum() + hy.sum() + cy.square().sum()
    expected = torch.autograd.grad(loss_of(*_flat(lstm(x, (h0, c0)))), params)
    with deferfuse.defer():
        loss = loss_of(*_flat(lstm(x, (h0, c0))))
    if backward_mode == "debug":
        with deferfuse.debug():
            actual = [torch.autograd.grad(loss, params)]
    else:
        with deferfuse.defer():
            first = torch.autograd.grad(loss, params, retain_graph=True)
        actual = [first, torch.autograd.grad(loss, params)]
    for grads in actual:
        assert_same(expected, grads)


def _flat(result):
    out, (hy, cy) = result
    return out, hy, cy
