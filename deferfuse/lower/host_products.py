"""Matrix products as calls into torch's own CPU kernels (deferfuse/native/host_kernels.cc).

On XLA's CPU platform, ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` of the floating dtypes torch's
CPU gemm takes (float32, float64, bfloat16, float16) lower to an XLA FFI custom call whose
handler calls the structured CPU kernel strict runs (``at::cpu::mm_out``, ...).  ``matmul``,
``linear`` and ``einsum`` reach the dispatch mode as these ops plus views, so they follow.

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

from typing import Any

import numpy as np
import torch

from ..ir.meta import TensorMeta
from ..native import hostkernels
from ..stats import STATS
from .registry import LoweringContext
from .._lazy import lazy_import

jax = lazy_import("jax", globals(), "jax")
jnp = lazy_import("jax.numpy", globals(), "jnp")

aten = torch.ops.aten

# the dtypes torch's CPU gemm takes that the handlers wrap (integer products stay XLA's: exact)
DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})
_TARGETS = {aten.mm.default: hostkernels.TARGETS["mm"], aten.bmm.default: hostkernels.TARGETS["bmm"],
            aten.addmm.default: hostkernels.TARGETS["addmm"],
            aten.baddbmm.default: hostkernels.TARGETS["baddbmm"]}


def takes(op: Any, dtype: torch.dtype) -> bool:
    """Whether a handler computes ``op`` with results of ``dtype``."""
    return op in _TARGETS and dtype in DTYPES


def hosted(op: Any, dtype: torch.dtype) -> bool:
    """Whether a program compiled now lowers ``op`` (results of ``dtype``) to a host kernel.
    Such a product needs no ``order_compute`` tie: that tie kept XLA's dot's left-hand operand
    row-major, and an optimization barrier on the operand would stop XLA from cancelling the
    transposes that give the handler strict's layout (it copied them instead)."""
    return takes(op, dtype) and hostkernels.use_on(jax.default_backend())


def applies(ctx: LoweringContext) -> bool:
    """Whether this call lowers to a host kernel: an op and dtype the handlers take, a program
    for the CPU, and the handlers registered (counted when they are not)."""
    if not takes(ctx.op, ctx.out[0].dtype):
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


def operand(x: Any, meta: TensorMeta) -> tuple[Any, np.ndarray, np.ndarray]:
    """(the array to pass, the logical sizes, the strides of the view over it) for one operand:
    strict's strides where its layout is dense, the same order of dims packed where not."""
    order = _physical_order(meta)
    physical = x if order == tuple(range(len(order))) else jnp.transpose(x, order)
    strides = [0] * len(order)
    step = 1
    for d in reversed(order):
        strides[d] = step if meta.shape[d] != 1 else meta.stride[d]
        step *= meta.shape[d]
    return physical, np.asarray(meta.shape, np.int64), np.asarray(strides, np.int64)


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
