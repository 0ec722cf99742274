"""LSTM layers as they reach aten on the CPU: ``mkldnn_rnn_layer`` and its backward.

Which calls reach these ops (aten/src/ATen/native/RNN.cpp, ``use_mkldnn``, and
aten/src/ATen/native/mkldnn/RNN.cpp, ``mkldnn_rnn``): ``nn.LSTM`` on CPU tensors with oneDNN
enabled, a float32 input (bfloat16 where the CPU has bf16 support; float16 only without grad
mode and with fp16 support), at least one element, no projections (``proj_size > 0`` warns and
takes the generic path of matmuls and pointwise ops) and no packed sequence (``PackedSequence``
takes the generic path too).  float64 never reaches them.  ``nn.GRU`` and ``nn.RNN`` do not use
oneDNN at all.  ``mkldnn_rnn`` makes one call per layer and direction; the input is transposed
to time-major and made contiguous before the first layer, the two directions' outputs are
concatenated on the last dim, and dropout between layers is an ``aten.dropout`` call of its own
between the layer calls.  Under grad mode autograd saves each call's inputs and outputs and
calls ``mkldnn_rnn_layer_backward`` with them (derivatives.yaml).

What one call computes (followed here; checked against torch's kernel by experiment):
- ``input`` is read as time-major (T, N, I) whatever ``batch_first`` says: ``batch_first``,
  ``bidirectional``, ``num_layers``, ``train`` and ``batch_sizes`` do not change the values
  (they only feed the meta kernel's shape arithmetic, which gives (T, N, hidden) either way).
- ``weight0`` is ``weight_ih`` (4H, I), ``weight1`` ``weight_hh`` (4H, H), with the gates in
  the order (i, f, g, o); ``weight2`` and ``weight3`` are ``bias_ih`` and ``bias_hh`` (4H,) when
  ``has_biases``, and are ignored otherwise (the caller passes zeros shaped like the weights).
  Per step: ``gates = x_t @ W_ih^T + h @ W_hh^T + (b_ih + b_hh)``; ``c = sigmoid(f) * c +
  sigmoid(i) * tanh(g)``; ``h = sigmoid(o) * tanh(c)``; ``output[t] = h``.  ``reverse`` runs
  the steps from the last time step to the first and still writes ``output[t]`` at ``t``.
- ``hx_`` and ``cx_`` are (N, H); the outputs are ``output`` (T, N, H), ``hy``, ``cy`` in the
  input's dtype, contiguous, and ``workspace``: an opaque oneDNN buffer (uint8, its size known
  only to oneDNN; undefined without grad mode) that only torch's backward reads.  The meta
  kernel says shape (0,), and so does this lowering (zeros, that is no elements).
- ``mode`` must be 2 (LSTM): the kernel always builds an LSTM primitive and fails for others.
- The kernel wraps ``input``, ``hx_`` and ``cx_`` by their data pointers as dense time-major
  memory: a non-contiguous one is read in memory order, not by index (those calls are
  declined; ``nn.LSTM`` only passes contiguous ones).
- The backward takes the saved inputs and outputs, the gradients of ``output``, ``hy`` and
  ``cy`` (each None when undefined: it then counts as zeros; all three None gives undefined
  gradients), and the workspace, and returns float32 gradients whatever the input dtype:
  (input, weight_ih, weight_hh, bias, bias, hx, cx), the bias gradient twice (the gradient of
  ``b_ih + b_hh``; given even without biases, of shape (4H,)).  oneDNN's backward reads the
  gates from the workspace: given an empty or foreign workspace it crashes or returns garbage.

How it is lowered: the forward is one ``lax.scan`` over time (the input projection of all
steps is one product before it).  float32 and bfloat16; float16 is declined (torch's kernel
runs it only without grad mode on CPUs with fp16 support, which a cached checker cannot see).
For bfloat16 the arithmetic is float32 and, as oneDNN's kernel does (matched bit for bit by
experiment), the bias sum is rounded to bfloat16 once, and after each step both states are
rounded to it, ``h`` computed from the unrounded cell state.

The backward never reads the workspace (the forward may have run on torch's kernel and the
backward here, or the other way round): it recomputes the forward from the saved inputs with the
same step function, then runs a second ``lax.scan`` backwards over time for the gates'
gradients, and takes the weight and input gradients as products over all steps afterwards.  For
float32 that is the vjp of the forward.  It is written out rather than taken from ``jax.vjp``
because oneDNN's bfloat16 backward is not the vjp of its forward: it reads the activated gates
as stored in bfloat16, takes ``tanh`` of the rounded cell state, and rounds the gates'
gradients to bfloat16 before its products (found by experiment; this gives its float32
gradients to about 1e-6 relative, where the plain vjp is off by ~0.5%).

The forward is lowered only without grad mode (inference), where torch's kernel gives no
workspace.  Under grad mode its workspace is read by torch's backward, which crashes given any
other (SIGSEGV with an empty one; garbage with a zeroed one of the right size), and the
backward may run where deferfuse cannot lower it: ``loss.backward()`` after the defer block, at
once on first sight or as a lone op, in an eager replay, under debug mode.  So under grad mode
the checker answers ``OnTorch``: the call is recorded and placed on torch's kernel inside the
deferred graph (no flush, no fallback), and every workspace any backward meets is torch's own
(its size, which the meta kernel gets wrong, is read off the kernel: capture/meta.py).  The
recorder keys the forward's calls by grad mode (``grad_mode_keyed``) so that its cached check
sees it.  The backward is lowered in both cases (it never reads the workspace).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from . import dtypes as _dtypes
from .registry import LoweringContext, OnTorch, lowering, replay_on_cpu
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")
jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")

aten = torch.ops.aten

_HIGHEST = "highest"
_LSTM_MODE = 2
_GATES = 4
# the dtypes oneDNN's RNN takes (get_mkldnn_dtype rejects the others)
_KERNEL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
_LOWERED_DTYPES = frozenset({torch.float32, torch.bfloat16})


# -- checks --------------------------------------------------------------------------------------

def _bound_args(ctx: LoweringContext) -> dict[str, Any]:
    """The call's arguments by schema name (both ops take every argument, none defaulted)."""
    names = [a.name for a in ctx.op._schema.arguments]
    return {**dict(zip(names, ctx.args)), **ctx.kwargs}


def _check_layer(ctx: LoweringContext, call: dict[str, Any], weights: tuple,
                 saved: tuple = ()) -> Optional[str]:
    """What the forward and the backward decline alike, so that a lowered forward is never
    followed by a declined backward (torch's would read the lowered forward's empty
    workspace).  ``saved``: the forward's outputs, which the backward's kernel wraps too."""
    x, hx, cx = call["input"], call["hx_"], call.get("cx_", call.get("cx_tmp"))
    w_ih, w_hh, b_ih, b_hh = weights
    has_biases, hidden = call["has_biases"], call["hidden_size"]
    if call["mode"] != _LSTM_MODE:
        return f"mode {call['mode']}: torch's oneDNN kernel builds only LSTMs (mode 2)"
    bias_dtype = torch.promote_types(b_ih.dtype, b_hh.dtype) if has_biases else w_ih.dtype
    wrapped = {t.dtype for t in (x, hx, cx, w_ih, w_hh, *saved)} | {bias_dtype}
    if not wrapped <= _KERNEL_DTYPES:
        # get_mkldnn_dtype raises while the kernel wraps the tensors, before it reads any data
        return replay_on_cpu(ctx)
    if len(wrapped) > 1:
        return "mixed dtypes"
    if x.dtype not in _LOWERED_DTYPES:
        # (whether torch's kernel runs it depends on the CPU and on grad mode, which the
        # checker's cache does not see)
        return f"{x.dtype}: torch's kernel takes it only without grad mode, on CPUs with fp16"
    if len(x.shape) != 3 or 0 in x.shape or hidden <= 0:
        return "an input that is not (T, N, I) with elements"
    _, batch, features = x.shape
    gates = _GATES * hidden
    expected = [(w_ih, (gates, features)), (w_hh, (gates, hidden)), (hx, (batch, hidden)),
                (cx, (batch, hidden))]
    if has_biases:
        expected += [(b_ih, (gates,)), (b_hh, (gates,))]
    if any(tuple(t.shape) != shape for t, shape in expected):
        return "shapes that torch's kernel does not check"
    if not all(t.is_contiguous for t in (x, hx, cx)):
        return "a non-contiguous input or state, which torch's kernel reads in memory order"
    return None


def _check_forward(ctx: LoweringContext) -> Optional[str]:
    call = _bound_args(ctx)
    reason = _check_layer(ctx, call, (call["weight0"], call["weight1"], call["weight2"], call["weight3"]))
    if reason is None and torch.is_grad_enabled():
        # (the recorder keys this op by grad mode: grad_mode_keyed below)
        return OnTorch("under grad mode: torch's backward reads this call's workspace, which only "
                       "torch's forward writes, and it may run where deferfuse does not (after the "
                       "defer block)")
    return reason


def _check_backward(ctx: LoweringContext) -> Optional[str]:
    call = _bound_args(ctx)
    grads = {"grad_output": call["output"], "grad_hy": call["hx_"], "grad_cy": call["cx_tmp"]}
    if all(call[name] is None for name in grads):
        return "no gradient given: torch's kernel returns undefined gradients"
    reason = _check_layer(ctx, call, (call["weight1"], call["weight2"], call["weight3"], call["weight4"]),
                          saved=(call["output"], call["hy_"], call["cy_"]))
    if reason is not None:
        return reason
    if any(call[name] is not None and tuple(call[name].shape) != tuple(like.shape)
           for name, like in grads.items()):
        return "gradients shaped unlike the outputs"
    return None


# -- the layer -----------------------------------------------------------------------------------

def _compute_dtype(dtype) -> np.dtype:
    return np.dtype(np.float32) if dtype in _dtypes.HALF_TYPES else np.dtype(dtype)


def _rounded(x, dtype):
    """``x`` rounded to ``dtype`` when that is a half type (reduce_precision: XLA may drop a
    pair of converts); unchanged otherwise."""
    if dtype not in _dtypes.HALF_TYPES:
        return x
    if np.dtype(dtype).name == "bfloat16":
        return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
    return lax.reduce_precision(x, exponent_bits=5, mantissa_bits=10)


def _dot(a, b, spec: str):
    return jnp.einsum(spec, a, b, precision=_HIGHEST, preferred_element_type=a.dtype)


def _bias(b_ih, b_hh, has_biases: bool, gates: int, dtype, acc):
    """``b_ih + b_hh`` as the kernel forms it (in the input dtype), widened to ``acc``."""
    if not has_biases:
        return jnp.zeros((gates,), acc)
    return _rounded(b_ih.astype(acc) + b_hh.astype(acc), dtype)


def _steps(x, w_ih, w_hh, bias, h0, c0, *, reverse: bool, dtype):
    """Runs the layer over time-major ``x`` (every argument in the compute dtype; ``dtype`` is
    the call's, for half-type rounding).  Returns ((hy, cy), per step: (h, c, gates)), where
    ``gates`` are the activated (i, f, g, o) stacked on a leading axis of 4."""
    projected = _dot(x, w_ih, "tni,gi->tng") + bias

    def step(carry, projected_t):
        h, c = carry
        gates = projected_t + _dot(h, w_hh, "ni,gi->ng")
        i, f, g, o = jnp.split(gates, _GATES, axis=-1)
        i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
        c = f * c + i * g
        # h from the unrounded cell state; both states kept in the input dtype between steps
        h, c = _rounded(o * jnp.tanh(c), dtype), _rounded(c, dtype)
        return (h, c), (h, c, jnp.stack([i, f, g, o]))

    return lax.scan(step, (h0, c0), projected, reverse=reverse)


@lowering(aten.mkldnn_rnn_layer.default, check=_check_forward, grad_mode_keyed=True)
def mkldnn_rnn_layer(ctx, input, weight0, weight1, weight2, weight3, hx_, cx_, reverse, batch_sizes,
                     mode, hidden_size, num_layers, has_biases, bidirectional, batch_first, train):
    dtype = input.dtype
    acc = _compute_dtype(dtype)
    bias = _bias(weight2, weight3, has_biases, weight0.shape[0], dtype, acc)
    (hy, cy), (output, _, _) = _steps(*(t.astype(acc) for t in (input, weight0, weight1)), bias,
                                      *(t.astype(acc) for t in (hx_, cx_)), reverse=reverse, dtype=dtype)
    # (lowered only without grad mode, where torch's kernel gives no workspace: capture/meta.py
    # corrects the meta kernel's empty one to None)
    return output, hy, cy


@lowering(aten.mkldnn_rnn_layer_backward.default, check=_check_backward)
def mkldnn_rnn_layer_backward(ctx, input, weight1, weight2, weight3, weight4, hx_, cx_tmp, output, hy_,
                              cy_, grad_output, grad_hy, grad_cy, reverse, mode, hidden_size, num_layers,
                              has_biases, train, bidirectional, batch_sizes, batch_first, workspace):
    """float32 gradients of (input, weight_ih, weight_hh, bias, bias, hx, cx).  Recomputes the
    forward from the saved inputs (never reads ``workspace``), then runs the steps backwards."""
    dtype = input.dtype
    acc = _compute_dtype(dtype)
    x, w_ih, w_hh, h0, c0 = (t.astype(acc) for t in (input, weight1, weight2, hx_, cx_tmp))
    bias = _bias(weight3, weight4, has_biases, weight1.shape[0], dtype, acc)
    _, (hs, cs, gates) = _steps(x, w_ih, w_hh, bias, h0, c0, reverse=reverse, dtype=dtype)
    # the states each step started from
    if reverse:
        h_prev = jnp.concatenate([hs[1:], h0[None]])
        c_prev = jnp.concatenate([cs[1:], c0[None]])
    else:
        h_prev = jnp.concatenate([h0[None], hs[:-1]])
        c_prev = jnp.concatenate([c0[None], cs[:-1]])
    # oneDNN's reduced-precision backward reads the activated gates as the forward stored them,
    # in the input dtype, and rounds the gates' gradients to it before its products
    gates = _rounded(gates, dtype)
    d_out = jnp.zeros(x.shape[:2] + (w_hh.shape[1],), acc) if grad_output is None else grad_output.astype(acc)
    d_hy = jnp.zeros_like(h0) if grad_hy is None else grad_hy.astype(acc)
    d_cy = jnp.zeros_like(c0) if grad_cy is None else grad_cy.astype(acc)

    def step(carry, per_step):
        d_h_next, d_c_next = carry
        d_out_t, (i, f, g, o), c_before, c_t = per_step
        d_h = d_out_t + d_h_next
        tanh_c = jnp.tanh(c_t)
        d_c = d_c_next + d_h * o * (1 - tanh_c * tanh_c)
        d_gates = jnp.concatenate([d_c * g * i * (1 - i), d_c * c_before * f * (1 - f),
                                   d_c * i * (1 - g * g), d_h * tanh_c * o * (1 - o)], axis=-1)
        d_gates = _rounded(d_gates, dtype)
        return (_dot(d_gates, w_hh, "ng,gi->ni"), d_c * f), d_gates

    (d_h0, d_c0), d_gates = lax.scan(step, (d_hy, d_cy), (d_out, gates, c_prev, cs),
                                     reverse=not reverse)
    d_x = _dot(d_gates, w_ih, "tng,gi->tni")
    d_w_ih = _dot(d_gates, x, "tng,tni->gi")
    d_w_hh = _dot(d_gates, h_prev, "tng,tni->gi")
    d_bias = jnp.sum(d_gates, axis=(0, 1))
    return d_x, d_w_ih, d_w_hh, d_bias, d_bias, d_h0, d_c0
