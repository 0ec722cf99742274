"""Matrix products and convolutions as calls into torch's own CPU kernels
(deferfuse/native/host_kernels.cc).

On XLA's CPU platform, ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` of the floating dtypes torch's
CPU gemm takes (float32, float64, bfloat16, float16) lower to an XLA FFI custom call whose
handler calls the structured CPU kernel strict runs (``at::cpu::mm_out``, ...).  ``matmul``,
``linear`` and ``einsum`` reach the dispatch mode as these ops plus views, so they follow.
``convolution`` and ``convolution_backward`` call ``at::convolution`` and
``at::convolution_backward``; their results are laid out as strict's (a channels-last input
gives a channels-last result) and transposed back to logical order in the program.

**Operands keep strict's layout.**  XLA hands a custom call row-major buffers, where strict's
kernel gets views (``x.t()`` in every weight gradient: a column-major matrix, which BLAS reads
through its transposition flag, no copy).  So each operand is passed as its *physical* array,
the logical array transposed into the order of strict's strides (largest first), with the
logical sizes and strict's strides as attributes; the handler wraps the buffer with those
strides (``at::from_blob``) and torch's kernel sees the layout strict gave it.  Where the
operand came from a transpose in the same program, XLA's simplifier cancels the two transposes
and the call reads the untransposed buffer: no copy.  Strides are part of every node's key
(capture/meta.py), so a program is never reused for operands laid out otherwise.  An operand
that is not dense in strict (a slice with gaps, an expanded dim) is passed densely in the same
order of dims; torch's kernel gives the same products on it (it copies such operands itself, or
passes the leading dimension to BLAS).

``beta`` and ``alpha`` are float64 operands of the call, not attributes: a Python float given
to a Scalar parameter is a runtime input of the program (capture/scalars.py), and torch's
kernel takes them as double Scalars.  Where the handlers are unavailable (no compiler, a failed
build: native/hostkernels.py warns once) the products lower to XLA's dots, each counted in
``stats()["host_kernel_fallbacks"]``.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from . import dtypes as dtypes_
from .. import config
from ..ir.meta import TensorMeta
from ..native import hostkernels
from ..stats import STATS
from .registry import LoweringContext
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")
jnp = lazy_import("jax.numpy", globals(), "jnp")

aten = torch.ops.aten

_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
# the dtypes torch's CPU gemm takes that the handlers wrap (integer products stay XLA's: exact)
DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})
_TARGETS = {aten.mm.default: hostkernels.TARGETS["mm"], aten.bmm.default: hostkernels.TARGETS["bmm"],
            aten.addmm.default: hostkernels.TARGETS["addmm"],
            aten.baddbmm.default: hostkernels.TARGETS["baddbmm"],
            aten.convolution.default: hostkernels.TARGETS["convolution"],
            aten.convolution_backward.default: hostkernels.TARGETS["convolution_backward"],
            _FLASH: hostkernels.TARGETS["_scaled_dot_product_flash_attention_for_cpu"],
            _FLASH_BACKWARD: hostkernels.TARGETS["_scaled_dot_product_flash_attention_for_cpu_backward"]}


def takes(op: Any, dtype: torch.dtype) -> bool:
    """Whether a handler computes ``op`` with results of ``dtype``."""
    return op in _TARGETS and dtype in DTYPES


_PRODUCTS = frozenset({aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default})


def flops(ctx: LoweringContext) -> Optional[int]:
    """The FLOPs of a matrix product (2*M*K*N, times the batch of a bmm) or of an attention
    (its two products, 2*B*H*Lq*Lk*(D + Dv); its backward's five, 2.5 times that), from the
    operands' shapes; None for a convolution (always hosted: see ``pays``)."""
    if ctx.op in (_FLASH, _FLASH_BACKWARD):
        query, key, value = ctx.args[:3] if ctx.op is _FLASH else ctx.args[1:4]
        *batch, length, depth = query.shape
        forward = 2 * int(np.prod(batch, dtype=np.int64)) * length * key.shape[-2] * (depth + value.shape[-1])
        return forward if ctx.op is _FLASH else forward * 5 // 2
    if ctx.op not in _PRODUCTS:
        return None
    a, b = ctx.args[:2] if ctx.op in (aten.mm.default, aten.bmm.default) else ctx.args[1:3]
    return 2 * int(np.prod(a.shape, dtype=np.int64)) * int(b.shape[-1])


# torch.compile's threshold where host_kernel_min_flops is left at its default (-1): float32's
# crossover measured on the decode step's shapes (docs/performance.md); defer mode's is 0
COMPILED_MIN_FLOPS = 1 << 24


def pays(ctx: LoweringContext) -> bool:
    """Whether a product is large enough for the host kernel: at least ``host_kernel_min_flops``
    FLOPs.  Below that, one call into torch's kernel (and its OpenMP team) costs more than XLA's
    own dot, which XLA also fuses with its neighbours (docs/performance.md, "Products in the
    host's kernels"), but XLA's dot sums in another order than torch's kernel: its bits are not
    strict's.  So defer mode, whose results must be strict's whichever way a product runs (a
    first sighting on torch's kernel, its twin in a program), hosts every product (the default,
    -1, means 0 there); torch.compile's graphs (compile/runtime.py) take COMPILED_MIN_FLOPS.
    Shapes alone decide, never a timing: a program's bits do not depend on the machine's
    state.  Attention is counted like its products: a decode step's (one query row against the
    cache) is XLA's, where a call into torch's flash kernel, handed to the serving thread, cost
    more than the step's other work (docs/performance.md, "Compiled generate()"); a training
    step's is torch's one kernel, where XLA's is several fusions and dots.  Convolutions are
    always hosted (small convolutions measured no worse)."""
    threshold = config.get("host_kernel_min_flops")
    if threshold <= 0:
        return True
    needed = flops(ctx)
    return needed is None or needed >= threshold


def hosted(ctx: Optional[LoweringContext]) -> bool:
    """Whether a program compiled now lowers this call (None: an internal op) to a host kernel.
    Such a product needs no ``order_compute`` tie: that tie kept XLA's dot's left-hand operand
    row-major, and an optimization barrier on the operand would stop XLA from cancelling the
    transposes that give the handler strict's layout (it copied them instead)."""
    return ctx is not None and bool(ctx.out) and takes(ctx.op, ctx.out[0].dtype) \
        and hostkernels.use_on(jax.default_backend()) and pays(ctx)


def applies(ctx: LoweringContext) -> bool:
    """Whether this call lowers to a host kernel: an op and dtype the handlers take, large
    enough to pay (``pays``), a program for the CPU, and the handlers registered (counted when
    they are not)."""
    if not ctx.out or not takes(ctx.op, ctx.out[0].dtype) or not pays(ctx):
        return False
    platform = jax.default_backend()
    if hostkernels.use_on(platform):
        STATS.host_kernel_products += 1
        return True
    if platform == hostkernels.PLATFORM and hostkernels.status().get("error"):
        STATS.host_kernel_fallbacks[str(ctx.op.overloadpacket.__name__)] += 1
    return False


def _physical_order(meta: TensorMeta) -> tuple[int, ...]:
    """The logical dims in the order strict's memory holds them: by stride, largest first.  An
    expanded dim (stride 0) goes outermost, as if materialized in place; a size-1 dim, whose
    stride says nothing, keeps its position, so an operand in natural order is not transposed."""
    moving = [d for d in range(len(meta.shape)) if meta.shape[d] != 1]
    ranked = iter(sorted(moving, key=lambda d: (-meta.stride[d] if meta.stride[d] else -np.inf, d)))
    return tuple(next(ranked) if meta.shape[d] != 1 else d for d in range(len(meta.shape)))


def _layout(meta: TensorMeta) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
    """(the physical order of dims, the logical sizes, the strides of the view over a buffer
    packed in that order): strict's strides where its layout is dense."""
    order = _physical_order(meta)
    strides = [0] * len(order)
    step = 1
    for d in reversed(order):
        strides[d] = step if meta.shape[d] != 1 else meta.stride[d]
        step *= meta.shape[d]
    return order, np.asarray(meta.shape, np.int64), np.asarray(strides, np.int64)


def operand(x: Any, meta: TensorMeta) -> tuple[Any, np.ndarray, np.ndarray]:
    """(the array to pass, the logical sizes, the strides of the view over it) for one operand:
    strict's strides where its layout is dense, the same order of dims packed where not."""
    order, sizes, strides = _layout(meta)
    physical = x if order == tuple(range(len(order))) else jnp.transpose(x, order)
    return physical, sizes, strides


def _results(metas: tuple, attributes: dict) -> tuple[list, list]:
    """The result types of a call whose results are laid out as strict's (``metas``), with the
    attributes that view them (``out<i>_sizes``, ``out<i>_strides``), and the permutation that
    takes each back to its logical order.  None in ``metas``: a result torch leaves undefined,
    an empty buffer."""
    types, inverses = [], []
    for i, meta in enumerate(metas):
        if meta is None:
            types.append(jax.ShapeDtypeStruct((0,), jnp.float32))
            inverses.append(None)
            attributes[f"out{i}_sizes"] = attributes[f"out{i}_strides"] = np.zeros((1,), np.int64)
            continue
        order, sizes, strides = _layout(meta)
        types.append(jax.ShapeDtypeStruct(tuple(meta.shape[d] for d in order), dtypes_.to_jax(meta.dtype)))
        inverses.append(tuple(np.argsort(order)))
        attributes[f"out{i}_sizes"], attributes[f"out{i}_strides"] = sizes, strides
    return types, inverses


def _logical(result: Any, inverse: Optional[tuple]) -> Any:
    return result if inverse is None or inverse == tuple(range(len(inverse))) \
        else jnp.transpose(result, inverse)


def call(ctx: LoweringContext, arrays: tuple, metas: tuple, names: tuple, factors: tuple = ()) -> Any:
    """The FFI call of ``ctx.op`` on ``arrays`` (laid out as ``metas``), its attributes named
    by ``names`` (the handler's operand names in host_kernels.cc), then ``factors`` (beta and
    alpha, static or runtime scalars) as float64 operands."""
    physical, attributes = [], {}
    for x, meta, name in zip(arrays, metas, names):
        array, sizes, strides = operand(x, meta)
        physical.append(array)
        attributes[f"{name}_sizes"] = sizes
        attributes[f"{name}_strides"] = strides
    physical += [jnp.asarray(f, np.float64) for f in factors]
    result = jax.ShapeDtypeStruct(ctx.out_shape, ctx.out_dtype)
    return jax.ffi.ffi_call(_TARGETS[ctx.op], result)(*physical, **attributes)


def product(ctx: LoweringContext, a: Any, b: Any) -> Any:
    """``mm``/``bmm`` through the host kernel."""
    return call(ctx, (a, b), ctx.args[:2], ("a", "b"))


def add_product(ctx: LoweringContext, x: Any, a: Any, b: Any, beta: Any, alpha: Any) -> Any:
    """``addmm``/``baddbmm`` through the host kernel (torch's kernel applies beta and alpha,
    with its own treatment of zeros)."""
    return call(ctx, (x, a, b), ctx.args[:3], ("c", "a", "b"), (beta, alpha))


def _ints(values: Any, n: int) -> np.ndarray:
    """An int-list argument as its ``n`` values (aten accepts one value for all dims)."""
    values = [values] if isinstance(values, int) else list(values)
    return np.asarray(values * n if len(values) == 1 else values, np.int64)


def _conv_attributes(nd: int, stride, padding, dilation, transposed, output_padding, groups) -> dict:
    return {"stride": _ints(stride, nd), "padding": _ints(padding, nd), "dilation": _ints(dilation, nd),
            "transposed": np.int64(bool(transposed)), "output_padding": _ints(output_padding, nd),
            "groups": np.int64(groups)}


def convolution(ctx: LoweringContext, x: Any, w: Any, bias: Any, stride, padding, dilation,
                transposed, output_padding, groups) -> Any:
    """``aten.convolution`` through the host kernel (torch's ``at::convolution``)."""
    x_meta, w_meta, bias_meta = ctx.args[:3]
    attributes = _conv_attributes(len(x_meta.shape) - 2, stride, padding, dilation, transposed,
                                  output_padding, groups)
    arrays = []
    for name, array, meta in (("input", x, x_meta), ("weight", w, w_meta), ("bias", bias, bias_meta)):
        if meta is None:   # (no bias: an empty operand, not viewed)
            array, sizes, strides = jnp.zeros((0,), x.dtype), np.zeros((1,), np.int64), np.zeros((1,), np.int64)
        else:
            array, sizes, strides = operand(array, meta)
        arrays.append(array)
        attributes[f"{name}_sizes"], attributes[f"{name}_strides"] = sizes, strides
    attributes["has_bias"] = np.int64(bias_meta is not None)
    types, inverses = _results(ctx.out[:1], attributes)
    (out,) = jax.ffi.ffi_call(_TARGETS[ctx.op], types)(*arrays, **attributes)
    return _logical(out, inverses[0])


def convolution_backward(ctx: LoweringContext, grad_output: Any, x: Any, w: Any, bias_sizes,
                         stride, padding, dilation, transposed, output_padding, groups,
                         output_mask) -> tuple:
    """``aten.convolution_backward`` through the host kernel; the outputs torch leaves
    undefined (``output_mask``) are absent from ``ctx.out`` and from the result."""
    g_meta, x_meta, w_meta = ctx.args[:3]
    attributes = _conv_attributes(len(x_meta.shape) - 2, stride, padding, dilation, transposed,
                                  output_padding, groups)
    arrays = []
    for name, array, meta in (("grad_output", grad_output, g_meta), ("input", x, x_meta),
                              ("weight", w, w_meta)):
        array, attributes[f"{name}_sizes"], attributes[f"{name}_strides"] = operand(array, meta)
        arrays.append(array)
    attributes["has_bias"] = np.int64(bias_sizes is not None)
    attributes["bias_sizes"] = np.asarray(list(bias_sizes) if bias_sizes is not None else [0], np.int64)
    attributes["output_mask"] = np.asarray([bool(m) for m in output_mask], np.int64)
    wanted = iter(ctx.out)
    metas = tuple(next(wanted) if m else None for m in output_mask)
    types, inverses = _results(metas, attributes)
    outs = jax.ffi.ffi_call(_TARGETS[ctx.op], types)(*arrays, **attributes)
    return tuple(_logical(o, inv) for o, inv, m in zip(outs, inverses, output_mask) if m)


def _attention_operands(ctx: LoweringContext, named: tuple, attn_mask: Any, scale: Any,
                        is_causal: Any) -> tuple[list, dict]:
    """The operands and attributes shared by the flash-attention calls: ``named`` (name, array,
    meta) in order, then the mask (an empty operand, not viewed, when absent) and the scale (a
    float64 operand: it may be a runtime scalar; 0 and ``has_scale`` 0 when absent)."""
    arrays, attributes = [], {}
    for name, array, meta in named:
        array, attributes[f"{name}_sizes"], attributes[f"{name}_strides"] = operand(array, meta)
        arrays.append(array)
    mask_meta = ctx.kwargs.get("attn_mask")
    if mask_meta is None:
        arrays.append(jnp.zeros((0,), arrays[0].dtype))
        attributes["attn_mask_sizes"] = attributes["attn_mask_strides"] = np.zeros((1,), np.int64)
    else:
        array, attributes["attn_mask_sizes"], attributes["attn_mask_strides"] = operand(attn_mask, mask_meta)
        arrays.append(array)
    arrays.append(jnp.asarray(0.0 if scale is None else scale, np.float64))
    attributes["has_mask"] = np.int64(mask_meta is not None)
    attributes["has_scale"] = np.int64(scale is not None)
    attributes["is_causal"] = np.int64(bool(is_causal))
    return arrays, attributes


def flash_attention(ctx: LoweringContext, q: Any, k: Any, v: Any, is_causal: Any, attn_mask: Any,
                    scale: Any) -> tuple:
    """``_scaled_dot_product_flash_attention_for_cpu`` through the host kernel (dropout 0,
    which the lowering's check has made sure of): (output, logsumexp) as strict lays them out."""
    q_meta, k_meta, v_meta = ctx.args[:3]
    arrays, attributes = _attention_operands(
        ctx, (("query", q, q_meta), ("key", k, k_meta), ("value", v, v_meta)), attn_mask, scale, is_causal)
    types, inverses = _results(tuple(ctx.out[:2]), attributes)
    outs = jax.ffi.ffi_call(_TARGETS[ctx.op], types)(*arrays, **attributes)
    return tuple(_logical(o, inv) for o, inv in zip(outs, inverses))


def flash_attention_backward(ctx: LoweringContext, grad_out: Any, q: Any, k: Any, v: Any, out: Any,
                             logsumexp: Any, is_causal: Any, attn_mask: Any, scale: Any) -> tuple:
    """``_scaled_dot_product_flash_attention_for_cpu_backward`` through the host kernel:
    (grad_query, grad_key, grad_value) as strict lays them out."""
    g_meta, q_meta, k_meta, v_meta, o_meta, lse_meta = ctx.args[:6]
    arrays, attributes = _attention_operands(
        ctx, (("grad_out", grad_out, g_meta), ("query", q, q_meta), ("key", k, k_meta),
              ("value", v, v_meta), ("out", out, o_meta), ("logsumexp", logsumexp, lse_meta)),
        attn_mask, scale, is_causal)
    types, inverses = _results(tuple(ctx.out[:3]), attributes)
    outs = jax.ffi.ffi_call(_TARGETS[ctx.op], types)(*arrays, **attributes)
    return tuple(_logical(o, inv) for o, inv in zip(outs, inverses))
