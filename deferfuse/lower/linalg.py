"""Linear algebra lowerings: mm, bmm, mv, dot, vdot and their add*/scaled forms, _trilinear.

torch.matmul, F.linear, einsum and tensordot are CompositeImplicit: by the time they reach the
dispatch mode they are mm/bmm/mv/dot/addmm plus views, which the core handles.

Conventions:
- float32 and float64 products use ``Precision.HIGHEST`` (no reduced-precision passes on
  accelerators); float16/bfloat16 accumulate in float32 as torch's CPU kernels do, and round once.
- On the CPU, mm, addmm, bmm and baddbmm of those four float dtypes call torch's own kernels
  inside the XLA program (host_products.py), which gives strict's bits; the rules below are
  what other platforms, integer products, and a CPU without the host kernels run.
- Integer products accumulate in int64 and wrap when cast back, which is exact: torch's integer
  gemm wraps in the output type and both are arithmetic modulo 2**bits.
- ``beta == 0`` drops ``input`` entirely (NaN and Inf in it do not propagate), as torch documents.
  ``alpha == 0`` is murkier; we follow what we measured on torch 2.13: its float32/float64 gemm
  paths skip the product (addmm, addmv, addbmm, and baddbmm above ``_BADDBMM_SMALL``), while its
  other kernels (addr, small baddbmm, the float16/bfloat16 paths) compute ``0 * product``, so a
  NaN or Inf in the product propagates.  (A large bfloat16 baddbmm skips it in torch; not modelled.)
- The meta kernels accept dtype combinations the CPU kernels reject (bool, mixed dtypes); the
  checkers replay such calls on CPU stand-ins so the user sees torch's own exception.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from . import common
from . import dtypes as _dtypes
from . import host_products
from ..ir.meta import TensorMeta
from . import xla_fixes
from .registry import LoweringContext, lowering, replay_on_cpu, shape_rule
from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")
jax_tree = lazy_import("jax.tree_util", globals(), "jax_tree")


def _per_matrix(fn, *arrays, cores: tuple = (2,)):
    """``fn`` (a jaxlib LAPACK call) over the matrices of a batch one at a time (``lax.map``),
    instead of as one batched call.  jaxlib's batched LAPACK kernels split their batch over
    XLA's intra-op thread pool (``ParallelBatchMap``) and wait for the pieces; in a process
    where torch's OpenMP threads have run, a computation with several such calls next to other
    work sometimes never got its pieces back: the flush hung (three ``cholesky_ex`` of a batch
    of 3, about one run in three on a 2-core VM; a worker of the test suite was lost to it).
    Mapped, each call factors one matrix, which runs on the calling thread.  ``cores``: how
    many trailing dims of each array make one problem."""
    cores = cores + (cores[-1],) * (len(arrays) - len(cores))
    batch = arrays[0].shape[:arrays[0].ndim - cores[0]]
    if int(np.prod(batch, dtype=np.int64)) <= 1:
        return fn(*arrays)
    flat = tuple(a.reshape((-1,) + a.shape[a.ndim - c:]) for a, c in zip(arrays, cores))
    out = lax.map(lambda xs: fn(*xs), flat)
    return jax_tree.tree_map(lambda o: o.reshape(batch + o.shape[1:]), out)

aten = torch.ops.aten

_HIGHEST = "highest"
_HALF_TYPES = _dtypes.HALF_TYPES
_I64 = np.dtype(np.int64)

# dtypes torch's CPU matmul kernels accept (bool and complex excluded: complex is not lowered)
_MATMUL_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                            torch.float16, torch.bfloat16, torch.float32, torch.float64})


# -- checks --------------------------------------------------------------------------------------


def _check_matmul(ctx: LoweringContext) -> Optional[str]:
    dtypes = {t.dtype for t in ctx.tensor_args()}
    if any(dt.is_complex for dt in dtypes):
        return "complex matmul is not lowered"
    if len(dtypes) != 1 or not dtypes <= _MATMUL_DTYPES:
        return common.raise_like_cpu(ctx)   # e.g. "expected m1 and m2 to have the same dtype"
    return None


# -- products ------------------------------------------------------------------------------------

def _acc_dtype(dtype) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype in _HALF_TYPES:
        return jnp.dtype(jnp.float32)
    if jnp.issubdtype(dtype, jnp.integer):
        return _I64
    return dtype


def _transposed(meta: Any) -> bool:
    """Whether a matrix operand is, in strict, the transpose of a row-major matrix (its last two
    dims swapped: ``w.t()`` in every ``linear``, ``k.transpose(-2, -1)`` in attention)."""
    if meta is None or len(meta.shape) < 2 or meta.shape[-1] < 2 or meta.shape[-2] < 2:
        return False
    return meta.stride[-2] == 1 and meta.stride[-1] >= meta.shape[-2]


def matmul(a, b, b_meta: Any = None):
    """jnp.matmul in torch's accumulate type (see the module docstring).  Where ``b`` (metadata
    ``b_meta``) is a transposed row-major matrix, it contracts the last dims of both operands
    (``dot_general``): XLA cancels the transposes and reads the weight as stored, where it copied
    it into the other layout on every call of a decode step (docs/performance.md, "Compiled
    generate() again")."""
    acc = _acc_dtype(a.dtype)
    if jnp.issubdtype(acc, jnp.integer):
        a, b = a.astype(acc), b.astype(acc)
    if a.ndim == b.ndim and a.ndim in (2, 3) and _transposed(b_meta):
        batch = ((0,), (0,)) if a.ndim == 3 else ((), ())
        last = a.ndim - 1
        return lax.dot_general(a, jnp.swapaxes(b, -1, -2), (((last,), (last,)), batch),
                               precision=_HIGHEST, preferred_element_type=acc)
    return jnp.matmul(a, b, precision=_HIGHEST, preferred_element_type=acc)


def _scalar(value, dtype):
    """``Scalar::to<acc_t>()``: Python or traced scalars, floats truncated for integer types."""
    return jnp.asarray(value).astype(dtype)


def _is_static(value, number) -> bool:
    return isinstance(value, (bool, int, float)) and value == number


def _scaled(term, factor, drop_when_zero: bool):
    """``factor * term``; with ``drop_when_zero``, a zero factor gives zeros even where ``term``
    is NaN or Inf."""
    if _is_static(factor, 1):
        return term
    if isinstance(factor, (bool, int, float)):
        # static: decide in Python (after the conversion: 0.5 is 0 for integer tensors)
        f = np.asarray(factor).astype(term.dtype)
        if drop_when_zero and f == 0:
            return jnp.zeros_like(term)
        return term * f
    f = _scalar(factor, term.dtype)
    if drop_when_zero:
        return jnp.where(f == 0, jnp.zeros_like(term), term * f)
    return term * f


def _add_scaled(ctx, x, product, beta, alpha, alpha_zero_skips: bool):
    """``beta * x + alpha * product`` with torch's treatment of zero factors."""
    # (float16/bfloat16 kernels always compute 0 * product)
    product = _scaled(product, alpha, alpha_zero_skips and ctx.out_dtype not in _HALF_TYPES)
    x = _scaled(x.astype(product.dtype), beta, True)
    return jnp.broadcast_to(x + product, ctx.out_shape)


@lowering(aten.mm.default, aten.bmm.default, aten.mv.default, aten.dot.default, aten.vdot.default,
          check=_check_matmul)
def mm(ctx, a, b):
    if host_products.applies(ctx):
        return host_products.product(ctx, a, b)
    # vdot conjugates its first operand, a no-op for the real dtypes lowered here.
    return matmul(a, b, ctx.args[1])


@lowering(aten.addmm.default, aten.addmv.default, check=_check_matmul)
def addmm(ctx, x, a, b, *, beta=1, alpha=1):
    if host_products.applies(ctx):
        return host_products.add_product(ctx, x, a, b, beta, alpha)
    return _add_scaled(ctx, x, matmul(a, b, ctx.args[2]), beta, alpha, alpha_zero_skips=True)


@lowering(aten.addbmm.default, check=_check_matmul)
def addbmm(ctx, x, a, b, *, beta=1, alpha=1):
    # one contraction over both the batch and the inner dim, not a bmm and then a sum
    acc = _acc_dtype(a.dtype)
    product = lax.dot_general(a.astype(acc), b.astype(acc), (((0, 2), (0, 1)), ((), ())),
                              precision=_HIGHEST, preferred_element_type=acc)
    return _add_scaled(ctx, x, product, beta, alpha, alpha_zero_skips=True)


# torch's baddbmm uses a naive loop computing ``alpha * sum`` below this many multiply-adds per
# matrix, and gemm (which skips the product when alpha == 0) above it.
_BADDBMM_SMALL = 400


@lowering(aten.baddbmm.default, check=_check_matmul)
def baddbmm(ctx, x, a, b, *, beta=1, alpha=1):
    if host_products.applies(ctx):
        return host_products.add_product(ctx, x, a, b, beta, alpha)
    _, m, k = a.shape
    return _add_scaled(ctx, x, matmul(a, b, ctx.args[2]), beta, alpha,
                       alpha_zero_skips=k * m * b.shape[2] >= _BADDBMM_SMALL)


def _check_addr(ctx: LoweringContext) -> Optional[str]:
    dtypes = {t.dtype for t in ctx.tensor_args()}
    if torch.bool in dtypes:
        return "bool addr (logical and/or) goes to its decomposition"
    return _check_matmul(ctx)


@lowering(aten.addr.default, check=_check_addr)
def addr(ctx, x, u, v, *, beta=1, alpha=1):
    acc = _acc_dtype(u.dtype)
    outer = u.astype(acc)[:, None] * v.astype(acc)[None, :]
    return _add_scaled(ctx, x, outer, beta, alpha, alpha_zero_skips=False)


# -- _trilinear (F.bilinear) ---------------------------------------------------------------------

def _check_trilinear(ctx: LoweringContext) -> Optional[str]:
    dtypes = {t.dtype for t in ctx.tensor_args()}
    if any(dt.is_complex for dt in dtypes) or dtypes & {torch.bool}:
        return "complex and bool _trilinear are not lowered"
    if len(dtypes) != 1:
        return common.raise_like_cpu(ctx)
    return None


@lowering(aten._trilinear.default, check=_check_trilinear)
def trilinear(ctx, i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """Unsqueeze each operand at its expand dims, multiply the three, sum over ``sumdim``."""
    acc = _acc_dtype(i1.dtype)

    def unsqueezed(x, dims):
        for d in sorted(dims):
            x = jnp.expand_dims(x, d)
        return x.astype(acc)
    product = unsqueezed(i1, expand1) * unsqueezed(i2, expand2) * unsqueezed(i3, expand3)
    if not sumdim:
        return product
    return product.sum(axis=tuple(sorted(set(sumdim))))


# -- factorizations and solvers ------------------------------------------------------------------
# XLA's CPU backend runs these through LAPACK (getrf, geqrf, gesdd, syevd, trsm), as torch's CPU
# kernels do, so the factors agree, including the signs of Householder reflectors and singular
# vectors, which the sweep compares raw.  Only real float32/float64 matrices are lowered; torch
# rejects integer ones (the meta kernels may not), complex ones decline.  Empty matrices decline
# (LAPACK-free shortcuts in torch that are not worth modelling).  ``check_errors=True`` declines:
# torch raises from the info it computes, which stays torch's job.
#
# Not lowered, measured: eigh's eigenvectors and SVD's singular vectors (signs differ: torch's MKL
# and jaxlib's LAPACK choose them differently).  Under a dispatch mode torch's svdvals and
# eigvalsh always ask for the vectors (isTensorSubclassLike is true while a mode is active), so
# they decline too.  (_linalg_det/_linalg_slogdet once seemed to differ on singular matrices: torch
# factors A^T for contiguous A, which _lu_det_parts now does too.)
#
# LU conventions are LAPACK's: ``A = P L U`` with 1-based int32 ``pivots`` (row i was swapped
# with row pivots[i] - 1), ``info`` = the 1-based index of the first zero pivot, or 0.

_LINALG_DTYPES = frozenset({torch.float32, torch.float64})


def _check_linalg(ctx: LoweringContext) -> Optional[str]:
    metas = ctx.tensor_args()
    if any(t.dtype.is_complex for t in metas) or any(o.dtype.is_complex for o in ctx.out if o is not None):
        return "complex linalg is not lowered"
    floats = [t for t in metas if t.dtype.is_floating_point]
    if not floats or not {t.dtype for t in floats} <= _LINALG_DTYPES:
        return common.raise_like_cpu(ctx)
    if any(0 in t.shape for t in metas) and not _all_empty(ctx):
        return "an empty operand with non-empty ones is not lowered"
    if ctx.kwargs.get("check_errors"):
        return "check_errors: torch raises from its own info"
    if ctx.kwargs.get("driver") is not None:
        return "a LAPACK driver choice is not lowered"
    return None


def _all_empty(ctx: LoweringContext) -> bool:
    return all(0 in o.shape for o in ctx.out if o is not None) or \
        all(0 in t.shape for t in ctx.tensor_args())


def _empty_call(ctx: LoweringContext):
    """The results of a call with no data in: zeros where every output is empty, else constants
    (an identity U for a 3x0 SVD, ...) computed by torch itself on empty tensors."""
    if all(0 in o.shape for o in ctx.out if o is not None):
        return tuple(jnp.zeros(o.shape, _dtypes.to_jax(o.dtype)) for o in ctx.out)
    from torch.utils._python_dispatch import _disable_current_modes

    def real(a):
        if isinstance(a, TensorMeta):
            return torch.empty(a.shape, dtype=a.dtype)
        return a
    with _disable_current_modes(), torch.no_grad():
        outs = ctx.op(*[real(a) for a in ctx.args], **{k: real(v) for k, v in ctx.kwargs.items()})
    outs = outs if isinstance(outs, tuple) else (outs,)
    return tuple(jnp.asarray(o.numpy()) for o in outs)


def _linalg_rule(rule):
    """A rule that answers calls without data (every input or every output empty) from
    _empty_call: LAPACK-free shortcuts that torch takes and jnp need not reproduce."""
    import functools

    @functools.wraps(rule)
    def wrapped(ctx, *args, **kwargs):
        if any(0 in t.shape for t in ctx.tensor_args()):
            outs = _empty_call(ctx)
            return outs if len(outs) > 1 else outs[0]
        return rule(ctx, *args, **kwargs)
    return wrapped


def _check_pivoted(ctx: LoweringContext) -> Optional[str]:
    if ctx.kwargs.get("pivot") is False:
        return "LU without pivoting is not lowered"
    return _check_linalg(ctx)


def _broadcast_batch(a, b):
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


def _lu(a):
    """(LU, 1-based int32 pivots, int32 info) as LAPACK's getrf returns them."""
    lu, pivots, _ = _per_matrix(lax.linalg.lu, a)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    zero = diag == 0
    info = jnp.where(jnp.any(zero, axis=-1), jnp.argmax(zero, axis=-1) + 1, 0).astype(jnp.int32)
    return lu, pivots.astype(jnp.int32) + 1, info


def _lu_solve(lu, pivots0, b, transpose: bool):
    """Solve ``A x = b`` (``A^T x = b`` with ``transpose``) from A's LU factors; b is (..., n, k)."""
    lu, b = _broadcast_batch(lu, b)
    n = lu.shape[-1]
    perm = lax.linalg.lu_pivots_to_permutation(jnp.broadcast_to(pivots0, lu.shape[:-2] + pivots0.shape[-1:]), n)
    solve = lax.linalg.triangular_solve
    if not transpose:
        x = jnp.take_along_axis(b, perm[..., :, None], axis=-2)
        x = solve(lu, x, left_side=True, lower=True, unit_diagonal=True)
        return solve(lu, x, left_side=True, lower=False)
    x = solve(lu, b, left_side=True, lower=False, transpose_a=True)
    x = solve(lu, x, left_side=True, lower=True, transpose_a=True, unit_diagonal=True)
    inverse = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(x, inverse[..., :, None], axis=-2)


@lowering(aten.linalg_solve_triangular.default, check=_check_linalg)
@_linalg_rule
def solve_triangular(ctx, a, b, *, upper, left=True, unitriangular=False):
    a, b = _broadcast_batch(a, b)
    return lax.linalg.triangular_solve(a, b, left_side=left, lower=not upper,
                                       unit_diagonal=unitriangular)


@lowering(aten.linalg_lu_factor_ex.default, check=_check_pivoted)
@_linalg_rule
def lu_factor_ex(ctx, a, *, pivot=True, check_errors=False):
    return _lu(a)


@lowering(aten.linalg_lu_solve.default, check=_check_linalg)
@_linalg_rule
def lu_solve(ctx, lu, pivots, b, *, left=True, adjoint=False):
    pivots0 = pivots.astype(jnp.int32) - 1
    if left:
        return _lu_solve(lu, pivots0, b, transpose=adjoint)
    # X A = B  <=>  A^T X^T = B^T;  X A^T = B  <=>  A X^T = B^T
    return jnp.swapaxes(_lu_solve(lu, pivots0, jnp.swapaxes(b, -1, -2), transpose=not adjoint), -1, -2)


@lowering(aten.linalg_inv_ex.default, check=_check_linalg)
@_linalg_rule
def inv_ex(ctx, a, *, check_errors=False):
    lu, pivots, info = _lu(a)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    return _lu_solve(lu, pivots - 1, eye, transpose=False), info


@lowering(aten._linalg_solve_ex.default, check=_check_linalg)
@_linalg_rule
def solve_ex(ctx, a, b, *, left=True, check_errors=False):
    lu, pivots, info = _lu(a)
    # torch's vector case: B is 1-D, or A's shape without its last dim
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])
    rhs = (b[..., None] if left else b[..., None, :]) if vector else b
    if left:
        x = _lu_solve(lu, pivots - 1, rhs, transpose=False)
    else:
        x = jnp.swapaxes(_lu_solve(lu, pivots - 1, jnp.swapaxes(rhs, -1, -2), transpose=True), -1, -2)
    if vector:
        x = x[..., 0] if left else x[..., 0, :]
    return jnp.broadcast_to(x, ctx.out[0].shape), lu, pivots, info


@lowering(aten.linalg_qr.default, check=_check_linalg)
@_linalg_rule
def qr(ctx, a, mode="reduced"):
    if mode == "r":
        r = _per_matrix(lambda m: jnp.linalg.qr(m, mode="r"), a)
        return jnp.zeros(ctx.out[0].shape, a.dtype), r
    return tuple(_per_matrix(lambda m: tuple(jnp.linalg.qr(m, mode=mode)), a))


def _check_svdvals(ctx: LoweringContext) -> Optional[str]:
    compute_uv = ctx.args[2] if len(ctx.args) > 2 else ctx.kwargs.get("compute_uv", True)
    if compute_uv and not _all_empty(ctx):
        # measured: the singular vectors' signs of a 3x5 matrix differ from torch's gesdd
        return "singular vector signs differ from torch's LAPACK"
    return _check_linalg(ctx)


@lowering(aten._linalg_svd.default, check=_check_svdvals)
@_linalg_rule
def svd(ctx, a, full_matrices=False, compute_uv=True, *, driver=None):
    if not compute_uv:
        s = _per_matrix(lambda m: jnp.linalg.svd(m, compute_uv=False), a)
        return jnp.zeros(ctx.out[0].shape, a.dtype), s, jnp.zeros(ctx.out[2].shape, a.dtype)
    u, s, vh = _per_matrix(lambda m: tuple(jnp.linalg.svd(m, full_matrices=full_matrices)), a)
    return u, s, vh


def _check_eigvalsh(ctx: LoweringContext) -> Optional[str]:
    compute_v = ctx.args[2] if len(ctx.args) > 2 else ctx.kwargs.get("compute_v", True)
    if compute_v:
        # measured: syevd's eigenvector signs differ between jaxlib's LAPACK and torch's
        return "eigenvector signs differ from torch's LAPACK"
    return _check_linalg(ctx)


@lowering(aten._linalg_eigh.default, check=_check_eigvalsh)
@_linalg_rule
def eigh(ctx, a, UPLO="L", compute_v=True):
    w, v = _per_matrix(lambda m: tuple(jnp.linalg.eigh(m, UPLO=UPLO, symmetrize_input=False)), a)
    if not compute_v:
        return w, jnp.zeros(ctx.out[1].shape, a.dtype)
    return w, v


# -- pseudo-inverse, Cholesky, triangular solves, LU unpacking, determinants ---------------------
# Every result here is unique (no sign or basis choice), so any correct LAPACK agrees with torch's
# MKL up to rounding.  The pseudo-inverse follows torch's own composition: tolerances compared in
# the promoted type of (atol, rtol, S), and singular values (eigenvalues' magnitudes with
# ``hermitian``) at or below the tolerance dropped.

def _tol_tensor(ctx, name):
    value = ctx.kwargs.get(name)
    return value if isinstance(value, TensorMeta) else None


def _check_pinv(ctx: LoweringContext) -> Optional[str]:
    for name in ("atol", "rtol"):
        t = _tol_tensor(ctx, name)
        if t is not None and (t.dtype.is_complex or not t.dtype.is_floating_point):
            return common.raise_like_cpu(ctx) if t.dtype.is_complex else "a non-float tolerance is not lowered"
    return _check_linalg(ctx)


@lowering(aten.linalg_pinv.atol_rtol_tensor, check=_check_pinv)
@_linalg_rule
def pinv(ctx, a, *, atol=None, rtol=None, hermitian=False):
    m, n = a.shape[-2:]
    f64 = jnp.float64
    if atol is None:
        atol = jnp.zeros((), f64)
    if rtol is None:
        default = jnp.asarray(float(np.finfo(_dtypes.to_jax(ctx.args[0].dtype)).eps) * max(m, n), f64)
        # torch: an explicit atol > 0 without rtol means rtol = 0
        rtol = default if ctx.kwargs.get("atol") is None else jnp.where(atol > 0, jnp.zeros((), f64), default)
    if hermitian:
        s, u = _per_matrix(lambda m: tuple(jnp.linalg.eigh(m, UPLO="L", symmetrize_input=False)), a)
        s_abs = jnp.abs(s)
        top = jnp.max(s_abs, axis=-1, keepdims=True)
    else:
        u, s, vh = _per_matrix(lambda m: tuple(jnp.linalg.svd(m, full_matrices=False)), a)
        s_abs = s
        top = s[..., :1]
    tol = jnp.maximum(atol[..., None], rtol[..., None] * top)
    keep = s_abs > tol
    s_inv = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0).astype(a.dtype)
    ut = jnp.swapaxes(u, -1, -2)
    if hermitian:
        out = jnp.matmul(u * s_inv[..., None, :], ut, precision=_HIGHEST)
    else:
        out = jnp.matmul(jnp.swapaxes(vh, -1, -2) * s_inv[..., None, :], ut, precision=_HIGHEST)
    return jnp.broadcast_to(out, ctx.out_shape)


def _cholesky_left_looking(a):
    """(factor, info) as LAPACK's unblocked potf2 (lower) leaves them, which is what torch's MKL
    returns for a matrix that is not positive-definite: the columns before the failing one
    factored, the failing pivot's diagonal holding ``a_jj - L_j L_j^T`` (not its square root),
    everything after it untouched; ``info`` the 1-based order of the first failing minor."""
    n = a.shape[-1]
    idx = jnp.arange(n)
    work = jnp.tril(a)
    info = jnp.zeros(a.shape[:-2], jnp.int32)

    def body(j, state):
        work, info = state
        before = idx < j
        lj = jnp.where(before, work[..., j, :], 0)                         # L[j, :j]
        ajj = work[..., j, j] - jnp.sum(lj * lj, axis=-1)
        running = info == 0
        ok = running & (ajj > 0)                                           # NaN fails
        root = jnp.sqrt(jnp.where(ok, ajj, 1))
        below = jnp.where(before[None, :], work, 0)
        col = (work[..., :, j] - jnp.matmul(below, lj[..., :, None], precision=_HIGHEST)[..., 0]) / root[..., None]
        col = jnp.where(idx > j, col, 0)
        col = jnp.where(idx == j, jnp.where(ok, root, ajj)[..., None], col)
        new = jnp.where(ok[..., None], col, jnp.where((idx == j) & running[..., None], ajj[..., None], work[..., :, j]))
        work = work.at[..., :, j].set(new)
        info = jnp.where(running & ~ok, j + 1, info).astype(jnp.int32)
        return work, info
    return lax.fori_loop(0, n, body, (work, info))


def _cholesky(a, upper: bool):
    """torch's cholesky_ex: (L or U, int32 info).  ``upper`` reads only A's upper triangle."""
    if upper:
        a = jnp.swapaxes(a, -1, -2)
    fast = _per_matrix(lambda m: lax.linalg.cholesky(m, symmetrize_input=False), a)

    def good(_):
        return jnp.tril(fast), jnp.zeros(a.shape[:-2], jnp.int32)

    def bad(_):   # some matrix is not positive-definite: torch's partial factors and info
        return _cholesky_left_looking(a)
    factor, info = lax.cond(jnp.all(jnp.isfinite(fast)), good, bad, None)
    return (jnp.swapaxes(factor, -1, -2) if upper else factor), info


# Measured on torch 2.13 (MKL): up to this order the factor of a matrix that is not
# positive-definite is potf2's (see _cholesky_left_looking); above it MKL's blocked potrf leaves
# another partial factor, which we do not model, so those calls decline.
_CHOLESKY_UNBLOCKED_MAX = 128


def _check_cholesky_ex(ctx: LoweringContext) -> Optional[str]:
    if ctx.args[0].shape[-1] > _CHOLESKY_UNBLOCKED_MAX:
        return "cholesky_ex above order 128: MKL's partial factor of a non-positive-definite matrix is not modelled"
    return _check_linalg(ctx)


@lowering(aten.linalg_cholesky_ex.default, check=_check_cholesky_ex)
@_linalg_rule
def cholesky_ex(ctx, a, *, upper=False, check_errors=False):
    return _cholesky(a, upper)


def _linalg_error(info, name: str):
    from .registry import runtime_check
    runtime_check(info > 0, torch.linalg.LinAlgError,
                  f"{name}: The factorization could not be completed because the input is not "
                  "positive-definite (the leading minor of order {value} is not positive-definite).",
                  info)


@lowering(aten.cholesky.default, check=_check_linalg)
@_linalg_rule
def cholesky(ctx, a, upper=False):
    factor, info = _cholesky(a, upper)
    _linalg_error(info, "cholesky")
    return factor


def _triangle(t, upper: bool):
    return jnp.triu(t) if upper else jnp.tril(t)


@lowering(aten.cholesky_inverse.default, check=_check_linalg)
@_linalg_rule
def cholesky_inverse(ctx, factor, upper=False):
    from .registry import runtime_check
    n = factor.shape[-1]
    diag = jnp.diagonal(factor, axis1=-2, axis2=-1)
    zero = diag == 0
    runtime_check(jnp.any(zero, axis=-1), torch.linalg.LinAlgError,
                  "cholesky_inverse: The diagonal element {value} is zero, the inversion could not "
                  "be completed because the input matrix is singular.",
                  jnp.argmax(zero, axis=-1) + 1)
    eye = jnp.broadcast_to(jnp.eye(n, dtype=factor.dtype), factor.shape)
    inv = lax.linalg.triangular_solve(factor, eye, left_side=True, lower=not upper)
    if upper:    # A = U^T U: A^-1 = U^-1 U^-T
        return jnp.matmul(inv, jnp.swapaxes(inv, -1, -2), precision=_HIGHEST)
    return jnp.matmul(jnp.swapaxes(inv, -1, -2), inv, precision=_HIGHEST)    # A = L L^T


@lowering(aten.cholesky_solve.default, check=_check_linalg)
@_linalg_rule
def cholesky_solve(ctx, b, factor, upper=False):
    factor, b = _broadcast_batch(factor, b)
    solve = lax.linalg.triangular_solve
    # A = L L^T (lower) or U^T U (upper): solve with the first factor, then its transpose
    y = solve(factor, b, left_side=True, lower=not upper, transpose_a=upper)
    return solve(factor, y, left_side=True, lower=not upper, transpose_a=not upper)


@lowering(aten.triangular_solve.default, check=_check_linalg)
@_linalg_rule
def triangular_solve(ctx, b, a, upper=True, transpose=False, unitriangular=False):
    a, b = _broadcast_batch(a, b)
    x = lax.linalg.triangular_solve(a, b, left_side=True, lower=not upper, transpose_a=transpose,
                                    unit_diagonal=unitriangular)
    return x, a


def _permutation_matrix(pivots, m: int, dtype):
    """P of ``A = P L U`` from getrf's 1-based int32 pivots."""
    perm = lax.linalg.lu_pivots_to_permutation(pivots - 1, m)
    # row i of P^T A is row perm[i] of A, so P[perm[i], i] = 1
    return (perm[..., None, :] == jnp.arange(m)[:, None]).astype(dtype)


def _lu_triangles(lu):
    """(L, U) of ``A = P L U`` from getrf's packed LU: L unit lower m x k, U upper k x n."""
    m, n = lu.shape[-2:]
    k = min(m, n)
    lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    return lower, jnp.triu(lu[..., :k, :])


def _check_lu_unpack(ctx: LoweringContext) -> Optional[str]:
    data, pivots = ctx.args[0], ctx.args[1]
    if data.dtype.is_complex:
        return "complex linalg is not lowered"
    if data.dtype not in _LINALG_DTYPES:
        return "lu_unpack of non-float data is not lowered"
    if pivots.dtype != torch.int32:
        return common.raise_like_cpu(ctx)
    if any(0 in t.shape for t in ctx.tensor_args()) and not _all_empty(ctx):
        return "an empty operand with non-empty ones is not lowered"
    return None


@lowering(aten.lu_unpack.default, check=_check_lu_unpack)
@_linalg_rule
def lu_unpack(ctx, lu, pivots, unpack_data=True, unpack_pivots=True):
    from .registry import runtime_check
    m = lu.shape[-2]
    p_meta, l_meta, u_meta = ctx.out
    outs = []
    if unpack_pivots and 0 not in p_meta.shape:
        runtime_check((pivots < 1) | (pivots > m), RuntimeError,
                      "pivots passed to lu_unpack must be between 1 and LU.size(-2) inclusive."
                      "Did you properly pass the result of lu_factor?")
        p = _permutation_matrix(jnp.clip(pivots.astype(jnp.int32), 1, m), m, lu.dtype)
        outs.append(jnp.broadcast_to(p, p_meta.shape))
    else:
        outs.append(jnp.zeros(p_meta.shape, lu.dtype))
    if unpack_data and 0 not in l_meta.shape + u_meta.shape:
        outs += list(_lu_triangles(lu))
    else:
        outs += [jnp.zeros(l_meta.shape, lu.dtype), jnp.zeros(u_meta.shape, lu.dtype)]
    return tuple(outs)


def _lu_det_parts(ctx, a):
    # torch factors A^T when A is contiguous (det A^T = det A; it saves LAPACK a copy), and
    # returns that LU, which det's backward reads
    if ctx.args[0].to_meta_tensor().is_contiguous():
        a = jnp.swapaxes(a, -1, -2)
    lu, pivots, _ = _lu(a)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(pivots != jnp.arange(1, a.shape[-1] + 1, dtype=jnp.int32), axis=-1)
    perm_sign = jnp.where(swaps % 2 == 1, -1, 1).astype(a.dtype)
    return lu, pivots, diag, perm_sign


@lowering(aten._linalg_det.default, check=_check_linalg)
@_linalg_rule
def det(ctx, a):
    lu, pivots, diag, perm_sign = _lu_det_parts(ctx, a)
    return perm_sign * jnp.prod(diag, axis=-1), lu, pivots


@lowering(aten._linalg_slogdet.default, check=_check_linalg)
@_linalg_rule
def slogdet(ctx, a):
    lu, pivots, diag, perm_sign = _lu_det_parts(ctx, a)
    sign = perm_sign * jnp.prod(jnp.sign(diag), axis=-1)
    logabsdet = jnp.sum(jnp.log(jnp.abs(diag)), axis=-1)
    return sign, logabsdet, lu, pivots


# -- linalg.lu, Householder products, matrix exponential -----------------------------------------
# householder_product runs LAPACK's orgqr through jaxlib, as torch's CPU kernel does.  ormqr
# applies the reflectors one at a time (LAPACK's orm2r) instead of forming Q.  matrix_exp is
# torch's own algorithm (Bader, Blanes and Casas's optimized Taylor polynomials, with scaling and
# squaring above the last threshold), not jax.scipy's Padé approximant, so that the two agree to
# rounding whatever the norm of the matrix.

def _cpu_check(ctx: LoweringContext) -> Optional[str]:
    """Raise the CPU kernel's exception for a call that only it rejects (None if it runs)."""
    replay_on_cpu(ctx)
    return None


def _check_linalg_lu(ctx: LoweringContext) -> Optional[str]:
    if ctx.kwargs.get("pivot", True) is False:
        # torch: "linalg.lu_factor: LU without pivoting is not implemented on the CPU"
        return common.raise_like_cpu(ctx)
    return _check_linalg(ctx)


@lowering(aten.linalg_lu.default, check=_check_linalg_lu)
@_linalg_rule
def linalg_lu(ctx, a, *, pivot=True):
    lu, pivots, _ = _lu(a)
    return (_permutation_matrix(pivots, a.shape[-2], a.dtype),) + _lu_triangles(lu)


def _check_householder(ctx: LoweringContext) -> Optional[str]:
    reason = _check_linalg(ctx)
    if reason == "an empty operand with non-empty ones is not lowered" and 0 not in ctx.args[0].shape:
        return None     # no reflectors: Q is the first columns of the identity
    return reason if reason is not None else _cpu_check(ctx)


@lowering(aten.linalg_householder_product.default, check=_check_householder)
@_linalg_rule
def householder_product(ctx, a, tau):
    # (no reflectors: _linalg_rule asks torch for the identity columns)
    return _per_matrix(lax.linalg.householder_product, a, tau, cores=(2, 1))


def _check_ormqr(ctx: LoweringContext) -> Optional[str]:
    reason = _check_linalg(ctx)
    return reason if reason is not None else _cpu_check(ctx)


@lowering(aten.ormqr.default, check=_check_ormqr)
@_linalg_rule
def ormqr(ctx, a, tau, other, left=True, transpose=False):
    """``op(Q) C`` (``left``) or ``C op(Q)``, Q = H_0 ... H_{k-1}, H_i = I - tau_i v_i v_i^T with
    v_i the i-th column of ``a`` below the diagonal and 1 on it; op transposes with ``transpose``."""
    k = tau.shape[-1]
    m = a.shape[-2]
    rows = jnp.arange(m)
    # H_i is symmetric: Q C applies H_{k-1} first, Q^T C applies H_0 first; C Q applies H_0
    # first, C Q^T H_{k-1} first
    forward = transpose == left

    def body(j, c):
        i = j if forward else k - 1 - j
        col = lax.dynamic_index_in_dim(a, i, axis=-1, keepdims=False)          # (..., m)
        v = jnp.where(rows == i, jnp.ones((), a.dtype), jnp.where(rows > i, col, 0))
        t = lax.dynamic_index_in_dim(tau, i, axis=-1, keepdims=True)         # (..., 1)
        if left:
            w = jnp.einsum("...m,...mn->...n", v, c, precision=_HIGHEST)
            return c - (t * v)[..., :, None] * w[..., None, :]
        w = jnp.einsum("...nm,...m->...n", c, v, precision=_HIGHEST)
        return c - (t[..., None] * w[..., :, None]) * v[..., None, :]
    return lax.fori_loop(0, k, body, other)


# -- geqrf ---------------------------------------------------------------------------------------
# aten.geqrf has no meta kernel; its shape rule reproduces the CPU kernel's outputs: ``a`` as a
# batch of column-major matrices (at::native::batched_matrix_contiguous_strides with f_contig, the
# layout LAPACK writes), ``tau`` (..., min(m, n)) contiguous.  The lowering is jaxlib's LAPACK
# geqrf (through jnp.linalg.qr(mode="raw"), which runs lax.linalg's geqrf primitive and transposes),
# the same routine as torch's, so the packed reflectors and taus agree to rounding (measured:
# <= 3e-15 in float64 on 40x30).  Integer and half inputs: the CPU kernel's NotImplementedError.

_GEQRF_DTYPES = frozenset({torch.float32, torch.float64, torch.complex64, torch.complex128})


def _f_contiguous_strides(shape) -> list[int]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    if len(shape) >= 2:
        strides[-1], strides[-2] = max(shape[-2], 1), 1
    return strides


@shape_rule(aten.geqrf.default)
def geqrf_shape(a):
    if a.dim() < 2:
        raise RuntimeError("torch.geqrf: input must have at least 2 dimensions.")
    if a.dtype not in _GEQRF_DTYPES:
        # NotImplementedError means "only the kernel can say": it runs, and raises its own
        # NotImplementedError ('"geqrf_cpu" not implemented for ...')
        raise NotImplementedError(f"geqrf_cpu: {a.dtype}")
    shape = tuple(a.shape)
    qr = torch.empty_strided(shape, _f_contiguous_strides(shape), dtype=a.dtype, device="meta")
    tau = torch.empty(shape[:-2] + (min(shape[-2], shape[-1]),), dtype=a.dtype, device="meta")
    return qr, tau


@lowering(aten.geqrf.default, check=_check_linalg)
@_linalg_rule
def geqrf(ctx, a):
    # (empty inputs: _linalg_rule answers with empty outputs)
    h, tau = _per_matrix(lambda m: tuple(jnp.linalg.qr(m, mode="raw")), a)   # lax.linalg's geqrf, transposed
    return jnp.swapaxes(h, -1, -2), tau


# Bader, Blanes and Casas's polynomials as torch evaluates them (aten LinearAlgebra.cpp): the
# norm thresholds of degrees 1, 2, 4, 8, 12 and 18, and the coefficients of degrees 12 and 18.
_MEXP_THETAS = {
    np.dtype(np.float32): (1.192092800768788e-07, 5.978858893805233e-04, 5.116619363445086e-02,
                             5.800524627688768e-01, 1.461661507209034e+00, 3.010066362817634e+00),
    np.dtype(np.float64): (2.220446049250313e-16, 2.580956802971767e-08, 3.397168839976962e-04,
                             4.991228871115323e-02, 2.996158913811580e-01, 1.090863719290036e+00),
}
_MEXP_B12 = ((9.0198e-16, 0.46932117595418237389, -0.20099424927047284052, -0.04623946134063071740),
             (5.31597895759871264183, 1.19926790417132231573, 0.01179296240992997031, 0.01108844528519167989),
             (0.18188869982170434744, 0.05502798439925399070, 0.09351590770535414968, 0.00610700528898058230),
             (-2.0861320e-13, -0.13181061013830184015, -0.02027855540589259079, -0.00675951846863086359))
_MEXP_B18 = ((0., -1.00365581030144618291e-01, -8.02924648241156932449e-03, -8.92138498045729985177e-04, 0.),
             (0., 3.97849749499645077844e-01, 1.36783778460411720168e+00, 4.98289622525382669416e-01,
              -6.37898194594723280150e-04),
             (-1.09676396052962061844e+01, 1.68015813878906206114e+00, 5.71779846478865511061e-02,
              -6.98210122488052056106e-03, 3.34975017086070470649e-05),
             (-9.04316832390810593223e-02, -6.76404519071381882256e-02, 6.75961301770459654925e-02,
              2.95552570429315521194e-02, -1.39180257516060693404e-05),
             (0., 0., -9.23364619367118555360e-02, -1.69364939002081722752e-02, -1.40086798182036094347e-05))


def _combine(mats, coeffs, dtype):
    """sum_j coeffs[j] * mats[j], the coefficients rounded to ``dtype`` first (as torch's are)."""
    out = None
    for c, x in zip(coeffs, mats):
        term = x * np.asarray(c, dtype)
        out = term if out is None else out + term
    return out


def _mexp_taylor(a, degree: int):
    dt = a.dtype
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=dt), a.shape)
    if degree == 1:
        return eye + a
    a2 = matmul(a, a)
    if degree == 2:
        return eye + a + a2 / np.asarray(2, dt)
    if degree == 4:
        return _combine((eye, a, a2, matmul(a2, _combine((eye, a, a2), (1 / 2, 1 / 6, 1 / 24), dt))),
                        (1, 1, 0, 1), dt)
    if degree == 8:
        sqrt_177 = float(np.asarray(0.1330413469565007072504e+2, dt))
        x3 = float(np.asarray(2 / 3, dt))
        x1, x2 = x3 * ((1 + sqrt_177) / 88), x3 * ((1 + sqrt_177) / 352)
        x4 = (-271 + 29 * sqrt_177) / (315 * x3)
        x5 = (-11 + 11 * sqrt_177) / (1260 * x3)
        x6 = (-99 + 11 * sqrt_177) / (5040 * x3)
        x7 = (89 - sqrt_177) / (5040 * x3)
        y2 = (857 - 58 * sqrt_177) / 630
        a4 = matmul(a2, _combine((a, a2), (x1, x2), dt))
        a8 = matmul(_combine((a2, a4), (x3, 1), dt), _combine((eye, a, a2, a4), (x4, x5, x6, x7), dt))
        return _combine((eye, a, a2, a4, a8), (1, 1, y2, 0, 1), dt)
    a3 = matmul(a, a2)
    if degree == 12:
        b = [_combine((eye, a, a2, a3), row, dt) for row in _MEXP_B12]
        b2 = b[2] + matmul(b[3], b[3])
        return b[0] + matmul(b[1] + b2, b2)
    a6 = matmul(a3, a3)
    b = [_combine((eye, a, a2, a3, a6), row, dt) for row in _MEXP_B18]
    b3 = b[3] + matmul(b[0], b[4])
    return b[1] + matmul(b[2] + b3, b3)


def _mexp_scale_square(a, norm, theta):
    """Degree 18 on ``a / 2**s``, squared ``s`` times, ``s = max(0, ceil(log2(norm / theta)))``."""
    s = jnp.maximum(jnp.ceil(jnp.log2(norm / np.asarray(theta, a.dtype))), 0)
    s = jnp.where(jnp.isfinite(s), s, 0)
    scaled = a * jnp.power(np.asarray(2, a.dtype), -s)[..., None, None]
    steps = s.astype(jnp.int32)

    def square(i, x):
        return jnp.where((i < steps)[..., None, None], matmul(x, x), x)
    return lax.fori_loop(0, jnp.max(steps, initial=0), square, _mexp_taylor(scaled, 18))


def _check_matrix_exp(ctx: LoweringContext) -> Optional[str]:
    a = ctx.args[0]
    if a.dtype == torch.float32 and len(a.shape) >= 2 and a.shape[-1] > 1 and a.shape[-1] == a.shape[-2]:
        # measured: a batch of 5x5 float32 matrices of 1-norm ~27 (4 squarings) differs from torch
        # by 2e-3 relative, as much as torch differs from the float64 result: the squarings amplify
        # each side's rounding (MKL's or torch's plain loops vs XLA's fused multiply-adds)
        return "float32 matrix_exp: the squarings amplify rounding past float32 tolerances"
    return _check_linalg(ctx)


@lowering(aten.linalg_matrix_exp.default, check=_check_matrix_exp)
@_linalg_rule
def matrix_exp(ctx, a):
    n = a.shape[-1]
    if n == 1:
        return xla_fixes.exp(a)
    thetas = _MEXP_THETAS[jnp.dtype(a.dtype)]
    flat = a.reshape((-1, n, n))
    norm = jnp.max(jnp.sum(jnp.abs(flat), axis=-2), axis=-1)       # the 1-norm
    if flat.shape[0] > 1:
        # torch takes the degree-18 path for every matrix of a batch
        return _mexp_scale_square(flat, norm, thetas[-1]).reshape(a.shape)
    # one matrix: the lowest degree whose threshold bounds the norm (degree 18 from the degree-12
    # threshold on, that one included); a NaN norm gives NaN
    t = [np.asarray(x, a.dtype) for x in thetas]
    nrm = norm[0]
    index = jnp.where(nrm <= t[0], 0, jnp.where(nrm <= t[1], 1, jnp.where(nrm <= t[2], 2, jnp.where(
        nrm <= t[3], 3, jnp.where(nrm < t[4], 4, jnp.where(nrm >= t[4], 5, 6))))))
    branches = [lambda x, d=d: _mexp_taylor(x, d) for d in (1, 2, 4, 8, 12)]
    branches.append(lambda x: _mexp_scale_square(x, norm, thetas[-1]))
    branches.append(lambda x: jnp.full_like(x, jnp.nan))
    return lax.switch(index, branches, flat).reshape(a.shape)
