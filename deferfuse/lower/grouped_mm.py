"""Grouped matrix products, ``torch._grouped_mm``, as the CPU kernel computes them.

Mixture-of-experts layers (Hugging Face's ``grouped_mm`` experts) multiply the rows routed to
each expert by that expert's weight in one call.  torch's meta kernel for ``aten._grouped_mm``
is written for CUDA and accepts bfloat16 only; the CPU kernel (``_grouped_mm_fallback`` in
aten/src/ATen/native/GroupedMMUtils.h) runs float32, bfloat16 and float16 as a loop of
``mm_out`` calls, one per group, into an uninitialised (``empty_strided``) output.  Our shape
rule gives its metadata where the meta kernel refuses (``capture.meta.infer`` asks it then).

The four layouts, with ``offs`` a 1-D int32 tensor of cumulative group *ends* (group ``g``
spans ``[offs[g-1], offs[g])``, group 0 from 0):
- 2-D ``a`` (M, K) x 3-D ``b`` (G, K, N) -> (M, N): ragged rows; the rows of group ``g``
  times ``b[g]``.  ``offs`` must have G entries.
- 3-D ``a`` (G, M, K) x 2-D ``b`` (K, N) -> (M, N): ragged columns; ``a[g]`` times the columns
  of group ``g``.  ``offs`` must have G entries.
- 2-D ``a`` (M, K) x 2-D ``b`` (K, N) -> (G, M, N), G = len(offs): ragged contraction; output
  ``g`` is ``a[:, span] @ b[span]``, zeros for an empty span.
- 3-D x 3-D: a batched matrix product (``bmm_out``); ``offs`` must be absent.
Each span is a Python-style slice of the ragged dim: a negative bound counts from the end, bounds
are clamped into [0, size], and an end before its start gives an empty group (so offsets that
are not sorted make groups that overlap or vanish; where two groups' rows or columns overlap,
the later group's product is what the output holds).  Rows (or columns) that no group covers,
such as those past the last offset, are never written: the output holds whatever memory it got.
Here they are zeros (any value is torch's).  Repeated offsets are empty groups.

What the kernel accepts (anything else raises RuntimeError): float32, bfloat16 or float16
operands of one dtype (mixed dtypes fail in ``mm``); 2 or 3 dims each; contraction sizes equal
unless both are 2-D; each operand's last two dims row- or column-major with the other stride a
multiple of 16 bytes ("strides should be multiple of 16 bytes", so a float32 row-major ``b``
needs N % 4 == 0, a bfloat16 one N % 8 == 0); ``offs`` given exactly when an operand is 2-D,
1-D and int32 (int64 is refused); no ``bias`` ("Bias not supported yet"); ``out_dtype`` absent
or ``a``'s dtype.  The output's last dim is padded to 16 bytes in its strides (float32 (10, 6)
has strides (8, 1)), as the CUDA kernel wants for its memory transfers.  Products accumulate in
float32 for half types and are rounded once, as ``mm`` does.

Autograd (``GroupedMmBackward0``) computes both gradients with ``_grouped_mm`` itself, on
transposed views: for 2-D x 3-D, ``grad_a = _grouped_mm(grad, b^T, offs)`` (2-D x 3-D) and
``grad_b = _grouped_mm(a^T, grad, offs)`` (2-D x 2-D); for 3-D x 2-D, ``grad_a =
_grouped_mm(grad, b^T, offs)`` (2-D x 2-D) and ``grad_b = _grouped_mm(a^T, grad, offs)``
(3-D x 2-D); likewise for the other two.  So the one lowering covers the backward, including the
kernel's behaviour there (``grad_a`` rows past the last offset are uninitialised too, and the
output gradient must itself have valid strides: ``y.sum().backward()`` passes an expanded
gradient and strict raises "Invalid strides/sizes").

The lowering is masked dense products: every group's product is computed over all rows (G
times the arithmetic of one product) and each row keeps its own group's.  ``lax.ragged_dot``
does the same on the CPU (XLA has no ragged kernel there: JAX expands the ragged operand into G
masked copies).  Measured on this machine's 2 cores, 4 experts, 512 rows, 256x512 weights:
float32 runs in 3.5 ms here against 3.8 ms for ``ragged_dot`` (compile 0.15 s against 0.08 s);
the weight gradient's ragged contraction takes 3.7 ms for both.  ``ragged_dot`` is faster for
bfloat16 (1.8 ms against 3.2; 1.0 against 3.6 for the contraction), as it keeps the operands in
bfloat16, but XLA's CPU runtime rejects some bfloat16 x bfloat16 -> float32 dots ("Unsupported
element type for DotThunk"), so half types are widened first.  ``ragged_dot`` also takes group
sizes, so it cannot express unsorted offsets, and it multiplies masked zeros by the other
groups' weights, so one non-finite weight would spread NaN into every row; selecting products
keeps each output element the product of its own group's operands only.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import dtypes as _dtypes
from .registry import LoweringContext, lowering, replay_on_cpu, shape_rule
from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")

aten = torch.ops.aten

_HIGHEST = "highest"
_ACCEPTED = (torch.float32, torch.bfloat16, torch.float16)
_CPP_NAMES = {torch.float32: "float", torch.bfloat16: "c10::BFloat16", torch.float16: "c10::Half"}
# c10's ScalarType names, as the kernel's dtype message prints them
_SCALAR_NAMES = {torch.float64: "Double", torch.int64: "Long", torch.int32: "Int", torch.int16: "Short",
                 torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool",
                 torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}
# The kernel pads the output's rows to this many bytes.
_ROW_ALIGNMENT = 16


# -- metadata ------------------------------------------------------------------------------------

def _check_strides(mat: torch.Tensor) -> None:
    """The kernel's layout rule: the last two dims row- or column-major, the other stride a
    multiple of 16 bytes."""
    *_, rows, cols = mat.shape
    *_, row_stride, col_stride = mat.stride()
    alignment = _ROW_ALIGNMENT // mat.element_size()
    if row_stride == 1 and col_stride >= max(1, rows):
        leading = col_stride
    elif col_stride == 1 and row_stride >= max(1, cols):
        leading = row_stride
    else:
        raise RuntimeError(f"Invalid strides/sizes, got {list(mat.stride())} for strides and "
                           f"{list(mat.shape)} for sizes")
    if leading % alignment:
        raise RuntimeError("strides should be multiple of 16 bytes")


@shape_rule(aten._grouped_mm.default)
def _grouped_mm_shapes(a, b, offs=None, bias=None, out_dtype=None):
    for name, mat in (("mat_a", a), ("mat_b", b)):
        if mat.dtype not in _ACCEPTED:
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got "
                               f"{_SCALAR_NAMES.get(mat.dtype, mat.dtype)}")
    for name, mat in (("mat_a", a), ("mat_b", b)):
        if mat.dim() not in (2, 3):
            raise RuntimeError(f"{name} has to be 2 or 3d")
    a_2d, b_2d = a.dim() == 2, b.dim() == 2
    if not (a_2d and b_2d) and a.shape[-1] != b.shape[-2]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    _check_strides(a)
    _check_strides(b)
    if (offs is not None) != (a_2d or b_2d):
        raise RuntimeError("Have to provide offsets if there is a 2d matrix, or no offset if both "
                           "matrices are 3d")
    if offs is not None:
        if offs.dim() != 1:
            raise RuntimeError("offs has to be 1D")
        if offs.dtype != torch.int32:
            raise RuntimeError("Offsets have to be int32")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    if (out_dtype or a.dtype) != a.dtype:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")
    if a_2d and b_2d:
        size = [offs.shape[0], a.shape[0], b.shape[1]]
    elif a_2d or b_2d:
        if offs.shape[0] != (b if a_2d else a).shape[0]:
            raise RuntimeError("matrix batch sizes have to match")
        size = [a.shape[0], b.shape[-1]] if a_2d else [a.shape[1], b.shape[1]]
    else:
        if a.shape[0] != b.shape[0]:
            raise RuntimeError("batched dimension has to match")
        size = [a.shape[0], a.shape[1], b.shape[2]]
    if a.dtype != b.dtype:
        # (mm's check; the kernel calls mm only for non-empty group lists, and meta.infer lets
        # the CPU kernel confirm for small inputs)
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: "
                           f"{_CPP_NAMES[a.dtype]} != {_CPP_NAMES[b.dtype]}")
    return torch.empty_strided(size, _padded_strides(size, a.dtype), dtype=a.dtype, device="meta")


def _padded_strides(size: list, dtype: torch.dtype) -> list:
    """Row-major strides with the last dim padded to 16 bytes, as the kernel allocates."""
    alignment = _ROW_ALIGNMENT // dtype.itemsize
    padded = -(-size[-1] // alignment) * alignment
    return [padded, 1] if len(size) == 2 else [size[1] * padded, padded, 1]


# -- lowering ------------------------------------------------------------------------------------

def _check_grouped_mm(ctx: LoweringContext) -> Optional[str]:
    a, b = ctx.args[:2]
    if a.dtype != b.dtype or a.dtype not in _ACCEPTED:
        return replay_on_cpu(ctx)   # (the shape rule has raised for these already)
    return None


def _acc(dtype) -> np.dtype:
    return np.dtype(np.float32) if dtype in _dtypes.HALF_TYPES else np.dtype(dtype)


def _spans(offs, size: int):
    """(starts, ends) of each group along a dim of ``size``, as ``Tensor.slice`` normalises
    them: negative bounds from the end, clamped into [0, size], an end before its start empty."""
    ends = offs.astype(jnp.int64)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int64), ends[:-1]])

    def normalised(bound):
        return jnp.clip(jnp.where(bound < 0, bound + size, bound), 0, size)

    starts, ends = normalised(starts), normalised(ends)
    return starts, jnp.maximum(ends, starts)


def _members(offs, size: int):
    """(G, size): whether each index of the ragged dim lies in each group's span."""
    starts, ends = _spans(offs, size)
    index = jnp.arange(size, dtype=jnp.int64)
    return (starts[:, None] <= index) & (index < ends[:, None])


def _owners(offs, size: int):
    """(G, size): the group whose product each index of the ragged dim holds, the last group
    that covers it (the kernel writes groups in order); all False where none does."""
    members = _members(offs, size)
    later = jnp.flip(jnp.cumsum(jnp.flip(members, 0), 0, dtype=jnp.int32), 0) - members
    return members & (later == 0)


def _select(products, owners, axis: int):
    """Each index along ``axis`` of the output, from its owner's product; zeros where no group
    owns it.  ``products`` is stacked by group on dim 0."""
    out = jnp.zeros(products.shape[1:], products.dtype)
    for group in range(products.shape[0]):
        keep = jnp.expand_dims(owners[group], tuple(d for d in range(out.ndim) if d != axis))
        out = jnp.where(keep, products[group], out)
    return out


@lowering(aten._grouped_mm.default, check=_check_grouped_mm)
def grouped_mm(ctx, a, b, offs=None, bias=None, out_dtype=None):
    # half types in float32 (exact), where mm accumulates them; XLA's CPU runtime has no
    # bfloat16 x bfloat16 -> float32 dot of its own
    acc = _acc(a.dtype)
    a, b = a.astype(acc), b.astype(acc)

    def dot(lhs, rhs, dims):
        return lax.dot_general(lhs, rhs, dims, precision=_HIGHEST, preferred_element_type=acc)

    if a.ndim == 3 and b.ndim == 3:
        return dot(a, b, (((2,), (1,)), ((0,), (0,))))
    if a.ndim == 2 and b.ndim == 3:
        # every expert's product of every row: (G, M, N); each row keeps its group's
        products = jnp.moveaxis(dot(a, b, (((1,), (1,)), ((), ()))), 1, 0)
        return _select(products, _owners(offs, a.shape[0]), axis=0)
    if a.ndim == 3:
        products = dot(a, b, (((2,), (0,)), ((), ())))          # (G, M, N)
        return _select(products, _owners(offs, b.shape[1]), axis=1)
    # ragged contraction: both operands masked to each group's span (so that a non-finite
    # element outside it meets no zero), one batched product over the groups
    members = _members(offs, a.shape[1])
    lhs = jnp.where(members[:, None, :], a[None], jnp.zeros((), a.dtype))      # (G, M, K)
    rhs = jnp.where(members[:, :, None], b[None], jnp.zeros((), b.dtype))      # (G, K, N)
    return dot(lhs, rhs, (((2,), (1,)), ((0,), (0,))))
