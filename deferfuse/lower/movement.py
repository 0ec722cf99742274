"""Movement lowerings: concatenation, padding, reordering, copies of views, gather/scatter,
advanced indexing, sorting.

Index tensors: torch accepts negative indices (-n..n-1) in several of these ops, so indices are
wrapped before use.  XLA cannot raise on an out-of-range index the way torch's kernels do at run
time; gathers here clamp and scatters drop such indices.  torch's shape and dtype errors are still
raised at record time by the meta inference that runs before any rule.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ir.meta import TensorMeta
from . import common
from . import views as _views
from .registry import bounds_check, lowering, replay_on_cpu, runtime_check
from .._lazy import lazy_import

jnp = lazy_import("jax.numpy", globals(), "jnp")
lax = lazy_import("jax.lax", globals(), "lax")

aten = torch.ops.aten


# -- helpers -----------------------------------------------------------------------------------
def _dim(dim: int, ndim: int) -> int:
    """A possibly negative dim as an axis; 0-d tensors accept dims 0 and -1, like torch."""
    return dim % max(ndim, 1)


def _wrap(index: jnp.ndarray, size: int, dim: int = 0, rank: Optional[int] = None) -> jnp.ndarray:
    """Negative indices count from the end; out-of-range ones raise torch's error at run time
    (XLA would clamp them; ``rank``: the indexed tensor's, where the error depends on it)."""
    bounds_check(index, size, dim, rank)
    return jnp.where(index < 0, index + size, index)


def _arg(ctx, i: int, name: str):
    """The TensorMeta (or value) of argument ``name`` at position ``i`` of the call."""
    return ctx.args[i] if i < len(ctx.args) else ctx.kwargs[name]


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _fill(value, dtype) -> jnp.ndarray:
    """A Scalar (Python int/bool or a runtime float) or a 0-d tensor, converted as torch does."""
    return jnp.asarray(value).astype(dtype)


def _as_meta_tensor(meta: TensorMeta) -> torch.Tensor:
    storage = torch.empty((meta.storage_numel,), dtype=meta.dtype, device="meta")
    return storage.as_strided(meta.shape, meta.stride, meta.offset)


def _contiguous_meta_tensor(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _meta_of(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device,
                      t.untyped_storage().nbytes() // t.element_size())


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _expandable(shape, target) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without changing it (torch's is_expandable_to)."""
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target)))


# -- concatenation and padding -----------------------------------------------------------------
@lowering(aten.cat.default)
def cat(ctx, tensors, dim=0):
    # torch still skips legacy empty 1-D tensors (shape (0,)) whatever the other tensors' rank.
    kept = [t.astype(ctx.out_dtype) for t in tensors if t.shape != (0,)]
    if not kept:
        return jnp.zeros(ctx.out_shape, ctx.out_dtype)
    return jnp.concatenate(kept, axis=_dim(dim, len(ctx.out_shape)))


@lowering(aten.stack.default)
def stack(ctx, tensors, dim=0):
    return jnp.stack([t.astype(ctx.out_dtype) for t in tensors], axis=_dim(dim, len(ctx.out_shape)))


@lowering(aten.constant_pad_nd.default)
def constant_pad_nd(ctx, x, pad, value=0):
    # lax.pad crops on negative padding, as torch does.
    config = [(lo, hi, 0) for lo, hi in common.pad_config(x.ndim, pad)]
    return lax.pad(x, _fill(value, x.dtype), config)


def _check_not_bool(ctx):
    # torch's CPU kernels are not implemented for bool, but its meta functions and decompositions
    # are: raise at record time what torch raises
    if ctx.args[0].dtype == torch.bool:
        name = ctx.op._schema.name.split("::")[-1]
        raise NotImplementedError(f'"{name}" not implemented for \'Bool\'')
    return None


@lowering(aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default,
          check=_check_not_bool)
def reflection_pad(ctx, x, padding):
    # A negative pad crops after reflecting about the original edges; padding first and cropping
    # afterwards keeps those edges.
    return common.pad_then_crop(x, padding, "reflect")


@lowering(aten.replication_pad1d.default, aten.replication_pad2d.default, aten.replication_pad3d.default,
          check=_check_not_bool)
def replication_pad(ctx, x, padding):
    return common.pad_then_crop(x, padding, "edge")


# -- reordering --------------------------------------------------------------------------------
@lowering(aten.flip.default)
def flip(ctx, x, dims):
    if x.ndim == 0 or not dims:
        return x
    return jnp.flip(x, tuple(_dim(d, x.ndim) for d in dims))


@lowering(aten.roll.default)
def roll(ctx, x, shifts, dims=()):
    if x.size == 0:
        return x
    if not dims:
        # no dims: roll the flattened tensor
        return jnp.roll(x.reshape(-1), shifts[0]).reshape(x.shape)
    return jnp.roll(x, tuple(shifts), tuple(_dim(d, x.ndim) for d in dims))


@lowering(aten.repeat.default)
def repeat(ctx, x, repeats):
    return jnp.tile(x, tuple(repeats))


@lowering(aten.tril.default)
def tril(ctx, x, diagonal=0):
    return jnp.tril(x, diagonal)


@lowering(aten.triu.default)
def triu(ctx, x, diagonal=0):
    return jnp.triu(x, diagonal)


@lowering(aten.diag_embed.default)
def diag_embed(ctx, x, offset=0, dim1=-2, dim2=-1):
    n = x.shape[-1]
    m = n + abs(offset)
    rows = jnp.arange(n) + max(-offset, 0)
    cols = jnp.arange(n) + max(offset, 0)
    square = jnp.zeros(x.shape[:-1] + (m, m), x.dtype).at[..., rows, cols].set(x)
    ndim = len(ctx.out_shape)
    return jnp.moveaxis(square, (-2, -1), (_dim(dim1, ndim), _dim(dim2, ndim)))


# -- copies of views, and the functional scatters into views -----------------------------------
# A view op is defined on the logical tensor (except as_strided), so its copy can be computed by
# applying the view op to a contiguous meta tensor of the input's shape and reading that strided
# view out of the flattened input.  torch itself supplies the view's layout.
_VIEW_OF_COPY = {
    aten._unsafe_view.default: aten.view.default,
    aten._reshape_copy.default: aten.reshape.default,
    aten.view_copy.default: aten.view.default,
    aten.alias_copy.default: aten.alias.default,
    aten.detach_copy.default: aten.detach.default,
    aten.lift_fresh_copy.default: aten.lift_fresh.default,
    aten.t_copy.default: aten.t.default,
    aten.transpose_copy.int: aten.transpose.int,
    aten.permute_copy.default: aten.permute.default,
    aten.expand_copy.default: aten.expand.default,
    aten.squeeze_copy.default: aten.squeeze.default,
    aten.squeeze_copy.dim: aten.squeeze.dim,
    aten.squeeze_copy.dims: aten.squeeze.dims,
    aten.unsqueeze_copy.default: aten.unsqueeze.default,
    aten.select_copy.int: aten.select.int,
    aten.slice_copy.Tensor: aten.slice.Tensor,
    aten.narrow_copy.default: aten.narrow.default,
    aten.diagonal_copy.default: aten.diagonal.default,
    aten.unfold_copy.default: aten.unfold.default,
    aten.unbind_copy.int: aten.unbind.int,
    aten.split_copy.Tensor: aten.split.Tensor,
    aten.split_with_sizes_copy.default: aten.split_with_sizes.default,
    aten.as_strided_copy.default: aten.as_strided.default,
}


def _check_view_copy(ctx):
    if ctx.op is aten.as_strided_copy.default and not ctx.args[0].covers_storage:
        # as_strided reads the storage, and only the viewed part of it reaches the rule
        return "as_strided_copy of a tensor that does not cover its storage"
    return None


@lowering(*_VIEW_OF_COPY, check=_check_view_copy)
def view_copy(ctx, x, *args, **kwargs):
    view_op = _VIEW_OF_COPY[ctx.op]
    if view_op is aten.as_strided.default:
        meta = ctx.args[0]
        flat, base = _views.flatten(x, meta), _as_meta_tensor(meta)
    else:
        flat, base = x.reshape(-1), _contiguous_meta_tensor(x.shape, ctx.args[0].dtype)
    views = view_op(base, *args, **kwargs)
    views = views if isinstance(views, (list, tuple)) else (views,)
    # one array per view; the caller takes a tuple for single- and multi-output ops alike
    return tuple(_views.read_view(flat, _meta_of(v)) for v in views)


@lowering(aten.view_copy.dtype, check=lambda ctx: None if ctx.args[0].dtype == ctx.out[0].dtype
          else "view_copy to another dtype reinterprets bits")
def view_copy_dtype(ctx, x, dtype):
    return x


_VIEW_OF_SCATTER = {
    aten.slice_scatter.default: aten.slice.Tensor,
    aten.select_scatter.default: aten.select.int,
    aten.diagonal_scatter.default: aten.diagonal.default,
    aten.as_strided_scatter.default: aten.as_strided.default,
}


def _check_view_scatter(ctx):
    args, kwargs = ctx.meta_args()
    view = _VIEW_OF_SCATTER[ctx.op](args[0], *args[2:], **kwargs)
    if view.shape != args[1].shape:
        # torch's meta functions for these ops skip this check, which its CPU kernels make;
        # raise it at record time rather than let the rule broadcast src
        raise RuntimeError(f"expected src to have a size equal to the slice of self. src size = "
                           f"{list(args[1].shape)}, slice size = {list(view.shape)}")
    if ctx.op is aten.as_strided_scatter.default and not ctx.out[0].covers_storage:
        return "as_strided_scatter into a result that does not cover its storage"
    return None


@lowering(*_VIEW_OF_SCATTER, check=_check_view_scatter)
def view_scatter(ctx, x, src, *args, **kwargs):
    view_op = _VIEW_OF_SCATTER[ctx.op]
    if view_op is aten.as_strided.default:
        # torch clones self (keeping its layout) and applies as_strided to the clone's storage
        out = ctx.out[0]
        flat = _views.flatten(x, out)
        view = view_op(_as_meta_tensor(out), *args, **kwargs)
        return _views.read_view(_views.write_view(flat, src, _meta_of(view)), out)
    if ctx.op is aten.slice_scatter.default or ctx.op is aten.select_scatter.default:
        block = _block_update(ctx.op, x, src, *args, **kwargs)
        if block is not None:
            return block
    view = view_op(_contiguous_meta_tensor(x.shape, ctx.args[0].dtype), *args, **kwargs)
    return _views.write_view(x.reshape(-1), src, _meta_of(view)).reshape(x.shape)


def _block_update(op, x, src, dim=0, start=None, end=None, step=1):
    """slice_scatter with step 1, and select_scatter, as one dynamic_update_slice: the generic
    strided write is a scatter of single elements, which XLA's CPU backend runs as a loop (the
    backward of a rotary embedding's ``x[..., :half]``: eight such scatters in a Llama step's
    backward).  None where the write is not one block (a step over 1)."""
    dim = _dim(dim, x.ndim)
    size = x.shape[dim]
    if op is aten.select_scatter.default:
        index = start + size if start < 0 else start    # (select_scatter(x, src, dim, index))
        return lax.dynamic_update_slice_in_dim(x, jnp.expand_dims(src, dim).astype(x.dtype), index, axis=dim)
    if step != 1:
        return None
    start = 0 if start is None else (start + size if start < 0 else start)
    start = min(max(start, 0), size)
    if src.shape[dim] == 0:
        return x
    return lax.dynamic_update_slice_in_dim(x, src.astype(x.dtype), start, axis=dim)


# -- gather and scatter along a dim ------------------------------------------------------------
def _along(index, dim: int, size: int) -> tuple:
    """The full index tuple of gather/scatter: ``index`` (wrapped) along ``dim``, and the
    position itself along every other dim."""
    return tuple(_wrap(index, size, dim) if d == dim else lax.broadcasted_iota(index.dtype, index.shape, d)
                 for d in range(index.ndim))


def _at_least_1d(*xs):
    return [x.reshape(1) if x.ndim == 0 else x for x in xs]


@lowering(aten.gather.default)
def gather(ctx, x, dim, index, sparse_grad=False):
    if index.size == 0:
        # torch accepts an empty index of any rank (a 1-D input with a (2, 0) index)
        return jnp.zeros(ctx.out_shape, x.dtype)
    x1, index1 = _at_least_1d(x, index)
    dim = _dim(dim, x.ndim)
    out = x1.at[_along(index1, dim, x1.shape[dim])].get(mode="clip")
    return out.reshape(ctx.out_shape)


def _arith_dtype(dtype):
    # bool scatter-add / multiply / sum / prod: compute in int32, the caller casts back (x != 0)
    return jnp.int32 if dtype == jnp.bool_ else dtype


def _identity(reduce: str, dtype):
    if reduce in ("sum", "mean"):
        return jnp.zeros((), dtype)
    if reduce == "prod":
        return jnp.ones((), dtype)
    low = reduce == "amax"
    if _is_float(dtype):
        return jnp.asarray(-jnp.inf if low else jnp.inf, dtype)
    if dtype == jnp.bool_:
        return jnp.asarray(not low)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if low else info.max, dtype)


def _scatter_reduce(x, where, src, reduce: str, include_self: bool):
    """``reduce`` of ``src`` into ``x`` at the index tuple ``where`` (torch's scatter_reduce)."""
    dtype = _arith_dtype(x.dtype) if reduce in ("sum", "prod", "mean") else x.dtype
    x, src = x.astype(dtype), src.astype(dtype)
    if not include_self:
        touched = jnp.zeros(x.shape, jnp.bool_).at[where].set(True)
        x = jnp.where(touched, _identity(reduce, dtype), x)
    if reduce == "sum":
        return x.at[where].add(src)
    if reduce == "prod":
        return x.at[where].multiply(src)
    if reduce == "amax":
        return x.at[where].max(src)
    if reduce == "amin":
        return x.at[where].min(src)
    # mean: torch divides by the number of values reduced (self included), at least 1; integer
    # tensors round down
    total = x.at[where].add(src)
    count = jnp.zeros(x.shape, dtype).at[where].add(jnp.ones_like(src))
    count = jnp.maximum(count + (1 if include_self else 0), 1)
    return total / count if _is_float(dtype) else jnp.floor_divide(total, count)


_SCATTER_REDUCE = {"add": "sum", "multiply": "prod", "sum": "sum", "prod": "prod",
                   "mean": "mean", "amax": "amax", "amin": "amin"}


def _scatter(x, dim, index, src, reduce=None, include_self=True):
    if index.size == 0:
        return x
    x1, index1 = _at_least_1d(x, index)
    dim = _dim(dim, x.ndim)
    where = _along(index1, dim, x1.shape[dim])
    if hasattr(src, "ndim") and src.ndim:
        # src may be larger than index: only its leading corner is scattered
        src = src[tuple(slice(0, n) for n in index1.shape)]
    src = jnp.broadcast_to(jnp.asarray(src), index1.shape)
    if reduce is None:
        out = x1.at[where].set(src.astype(x.dtype))
    else:
        out = _scatter_reduce(x1, where, src, _SCATTER_REDUCE[reduce], include_self)
    return out.reshape(x.shape)


@lowering(aten.scatter.src, aten.scatter.value)
def scatter(ctx, x, dim, index, src):
    return _scatter(x, dim, index, _fill(src, x.dtype))


@lowering(aten.scatter.reduce, aten.scatter.value_reduce)
def scatter_reduce_legacy(ctx, x, dim, index, src, *, reduce):
    return _scatter(x, dim, index, _fill(src, x.dtype), reduce)


@lowering(aten.scatter_add.default)
def scatter_add(ctx, x, dim, index, src):
    return _scatter(x, dim, index, src, "sum")


def _check_reduce_dtype(ctx):
    # torch's CPU kernels lack these; declined, torch raises eagerly
    dtype, reduce = ctx.args[0].dtype, _arg(ctx, 4, "reduce")
    if dtype == torch.bool and reduce == "mean":
        return "mean of bool"
    if dtype.is_complex and reduce in ("amax", "amin"):
        return "complex values have no order"
    return None


@lowering(aten.scatter_reduce.two, check=_check_reduce_dtype)
def scatter_reduce(ctx, x, dim, index, src, reduce, *, include_self=True):
    return _scatter(x, dim, index, src, reduce, include_self)


# -- indexing with index tensors ---------------------------------------------------------------
def _is_mask(meta) -> bool:
    return isinstance(meta, TensorMeta) and meta.dtype in (torch.bool, torch.uint8)


def _index_tuple(x, indices) -> tuple:
    """aten's ``Tensor?[]`` indices as a numpy-style index: None is a full slice.  numpy and torch
    share the rule for where the broadcast index dims go (in place if the index tensors are
    adjacent, first otherwise), so jnp's indexing applies as is."""
    return tuple(slice(None) if ix is None else _wrap(ix, x.shape[d], d) for d, ix in enumerate(indices))


def _integer_indices(indices) -> "str | None":
    if any(_is_mask(ix) for ix in indices):
        return "boolean mask index (data-dependent shape)"
    return None


@lowering(aten.index.Tensor, aten._unsafe_index.Tensor,
          check=lambda ctx: _integer_indices(_arg(ctx, 1, "indices")))
def index(ctx, x, indices):
    return x.at[_index_tuple(x, indices)].get(mode="clip")


@lowering(aten._unsafe_masked_index.default,
          check=lambda ctx: _integer_indices(_arg(ctx, 2, "indices")))
def unsafe_masked_index(ctx, x, mask, indices, fill):
    # indices under a False mask may be out of range; clipping keeps the gather defined
    return jnp.where(mask, x.at[_index_tuple(x, indices)].get(mode="clip"), _fill(fill, x.dtype))


@lowering(aten._unsafe_masked_index_put_accumulate.default,
          check=lambda ctx: _integer_indices(_arg(ctx, 2, "indices")))
def unsafe_masked_index_put_accumulate(ctx, x, mask, indices, values):
    bounded = tuple(slice(None) if ix is None else jnp.clip(_wrap(ix, x.shape[d]), 0, x.shape[d] - 1)
                    for d, ix in enumerate(indices))
    dtype = _arith_dtype(x.dtype)
    return x.astype(dtype).at[bounded].add(jnp.where(mask, values, 0).astype(dtype))


def _single_mask(indices):
    """(position, meta) of the one boolean mask among ``indices`` and no other index tensor."""
    tensors = [(d, ix) for d, ix in enumerate(indices) if ix is not None]
    if len(tensors) == 1 and tensors[0][1].dtype == torch.bool:
        return tensors[0]
    return None


def _check_index_put(ctx):
    x, indices, values = ctx.args[0], _arg(ctx, 1, "indices"), _arg(ctx, 2, "values")
    accumulate = ctx.args[3] if len(ctx.args) > 3 else ctx.kwargs.get("accumulate", False)
    if any(isinstance(ix, TensorMeta) and ix.dtype == torch.uint8 for ix in indices):
        return "uint8 mask index (deprecated)"
    mask = _single_mask(indices)
    # torch turns x[mask] = one-element tensor into masked_fill, which converts the value;
    # everywhere else its kernel (not its meta function) insists on equal dtypes
    masked_fill = mask is not None and not accumulate and _numel(values.shape) == 1
    if values.dtype != x.dtype and not masked_fill:
        raise RuntimeError(f"Index put requires the source and destination dtypes match, got {x.dtype} "
                           f"for the destination and {values.dtype} for the source.")
    if not any(_is_mask(ix) for ix in indices):
        # values that do not broadcast are declined, so that torch raises its own error eagerly
        args, _ = ctx.meta_args()
        if not _expandable(values.shape, aten.index.Tensor(args[0], args[1]).shape):
            return "values do not broadcast to the indexed shape"
        return None
    if mask is None:
        return "boolean mask mixed with other indices"
    pos, mask = mask
    k = len(mask.shape)
    if tuple(x.shape[pos:pos + k]) != tuple(mask.shape):
        return "mask shape differs from the indexed dims"
    # x[mask] has shape x.shape[:pos] + (nnz,) + x.shape[pos+k:]; values constant along nnz do
    # not depend on how many elements the mask selects
    selected = tuple(x.shape[:pos]) + (1,) + tuple(x.shape[pos + k:])
    if not (masked_fill or _expandable(values.shape, selected)):
        return "values differ between the selected elements (data-dependent), or do not broadcast"
    return None


@lowering(aten.index_put.default, aten._unsafe_index_put.default, check=_check_index_put)
def index_put(ctx, x, indices, values, accumulate=False):
    dtype = _arith_dtype(x.dtype) if accumulate else x.dtype
    x, values = x.astype(dtype), values.astype(dtype)
    mask = _single_mask(_arg(ctx, 1, "indices"))
    if mask is None:
        where = _index_tuple(x, indices)
        return x.at[where].add(values) if accumulate else x.at[where].set(values)
    # x[mask] = v, with v the same for every selected element, is a select
    pos, k = mask[0], len(mask[1].shape)
    mask = indices[pos].reshape((1,) * pos + indices[pos].shape + (1,) * (x.ndim - pos - k))
    if values.size == 1:
        values = values.reshape(())
    # values line up with x[mask]'s shape x.shape[:pos] + (nnz,) + x.shape[pos+k:]: put the k
    # mask dims where the nnz dim was
    values = values.reshape((1,) * (x.ndim - k + 1 - values.ndim) + values.shape)
    values = values.reshape(values.shape[:pos] + (1,) * k + values.shape[pos + 1:])
    values = jnp.broadcast_to(values, x.shape)
    return x + jnp.where(mask, values, 0) if accumulate else jnp.where(mask, values, x)


def _along_dim(x, dim: int, index) -> tuple:
    """The index tuple selecting ``index`` (a 0-d or 1-d index tensor) along ``dim``."""
    return (slice(None),) * dim + (_wrap(index.reshape(-1), x.shape[dim], dim, x.ndim),)


def _check_vector_index(ctx):
    if len(_arg(ctx, 2, "index").shape) > 1:
        # the meta function lets a 2-d index through; torch's kernel raises
        raise IndexError("index_select(): Index is supposed to be a vector")
    return None


@lowering(aten.index_select.default, check=_check_vector_index)
def index_select(ctx, x, dim, index):
    x1, = _at_least_1d(x)
    dim = _dim(dim, x.ndim)
    return x1.at[_along_dim(x1, dim, index)].get(mode="clip").reshape(ctx.out_shape)


def _index_update(x, dim, index, update):
    """(x as at least 1-d, where, update shaped to match) for the index_* ops."""
    x1, = _at_least_1d(x)
    dim = _dim(dim, x.ndim)
    where = _along_dim(x1, dim, index)
    if hasattr(update, "ndim") and update.ndim:
        update = update.reshape(x1.shape[:dim] + (index.size,) + x1.shape[dim + 1:])
    return x1, where, update


def _check_index_source(ctx):
    """torch's checks of index_add / index_reduce that their meta functions skip."""
    x, dim, index, source = ctx.args[0], ctx.args[1], ctx.args[2], ctx.args[3]
    name = ctx.op._schema.name.split("::")[-1]
    dim = _dim(dim, len(x.shape))
    numel = _numel(index.shape)
    if source.dtype != x.dtype:
        raise RuntimeError(f"{name}_(): self ({x.dtype}) and source ({source.dtype}) must have the same "
                           f"scalar type")
    if len(index.shape) > 1:
        raise IndexError(f"{name}_(): Index is supposed to be a vector, but got dim: {len(index.shape)}")
    if numel != (source.shape[dim] if source.shape else 1):
        raise RuntimeError(f"{name}_(): Number of indices ({numel}) should be equal to source.size(dim)")
    if (len(x.shape) != len(source.shape)
            or x.shape[:dim] + x.shape[dim + 1:] != source.shape[:dim] + source.shape[dim + 1:]):
        raise RuntimeError(f"source tensor shape must match self tensor shape, excluding the specified "
                           f"dimension. Got self.shape = {list(x.shape)} source.shape = {list(source.shape)}")
    return None


@lowering(aten.index_add.default, check=_check_index_source)
def index_add(ctx, x, dim, index, source, *, alpha=1):
    dtype = _arith_dtype(x.dtype)
    x1, where, source = _index_update(x.astype(dtype), dim, index, source.astype(dtype))
    if not (isinstance(alpha, (bool, int)) and alpha == 1):
        source = source * _fill(alpha, dtype)
    return x1.at[where].add(source).reshape(x.shape)


def _require_same_dtype(ctx, source):
    # torch's kernel checks this, its meta function does not
    x = ctx.args[0]
    if source.dtype != x.dtype:
        name = ctx.op._schema.name.split("::")[-1]
        raise RuntimeError(f"{name}_(): self and source expected to have the same dtype, but got "
                           f"{x.dtype} and {source.dtype}")


@lowering(aten.index_copy.default, check=lambda ctx: _require_same_dtype(ctx, _arg(ctx, 3, "source")))
def index_copy(ctx, x, dim, index, source):
    x1, where, source = _index_update(x, dim, index, source.astype(x.dtype))
    return x1.at[where].set(source).reshape(x.shape)


@lowering(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(ctx, x, dim, index, value):
    x1, where, _ = _index_update(x, dim, index, None)
    return x1.at[where].set(_fill(value, x.dtype)).reshape(x.shape)


@lowering(aten.index_reduce.default, check=lambda ctx: _check_index_source(ctx) or _check_reduce_dtype(ctx))
def index_reduce(ctx, x, dim, index, source, reduce, *, include_self=True):
    x1, where, source = _index_update(x, dim, index, source)
    return _scatter_reduce(x1, where, source, reduce, include_self).reshape(x.shape)


@lowering(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(ctx, x, mask, value):
    return jnp.where(mask, _fill(value, x.dtype), x)


def _check_masked_scatter(ctx):
    from . import dtypes as _dtypes
    if any(not _dtypes.is_supported(m.dtype) for m in ctx.tensor_args()):
        return "dtype has no JAX equivalent"
    if all(m.device.type == "cpu" for m in ctx.tensor_args()):
        replay_on_cpu(ctx, empty=True)   # torch's dtype errors (non-bool mask), on the user's line
    return None


@lowering(aten.masked_scatter.default, check=_check_masked_scatter)
def masked_scatter(ctx, x, mask, source):
    # the k-th True of the (broadcast) mask, in row-major order, takes source.flatten()[k]
    shape = ctx.out_shape
    flat = jnp.broadcast_to(x, shape).reshape(-1)
    m = jnp.broadcast_to(mask, shape).reshape(-1)
    src = source.reshape(-1)
    position = jnp.cumsum(m.astype(jnp.int64)) - 1
    runtime_check(m & (position >= src.shape[0]), RuntimeError,
                  "Number of elements of source < number of ones in mask")
    if src.shape[0] == 0:
        values = jnp.zeros_like(flat)
    else:
        values = src[jnp.clip(position, 0, src.shape[0] - 1)].astype(flat.dtype)
    return jnp.where(m, values, flat).reshape(shape)


@lowering(aten.masked_scatter_backward.default, check=_check_masked_scatter)
def masked_scatter_backward(ctx, grad_output, mask, sizes):
    # the gradient at the k-th True of the mask goes to source.flatten()[k]; the rest of the
    # source gets zeros
    g = grad_output.reshape(-1)
    m = jnp.broadcast_to(mask, grad_output.shape).reshape(-1)
    numel = _numel(ctx.out_shape)
    position = jnp.where(m, jnp.cumsum(m.astype(jnp.int64)) - 1, numel)
    out = jnp.zeros((numel,), g.dtype).at[position].set(g, mode="drop")
    return out.reshape(ctx.out_shape)


@lowering(aten.take.default)
def take(ctx, x, index):
    if x.size == 0:
        return jnp.zeros(ctx.out_shape, x.dtype)  # only an empty index passes torch's checks
    return x.reshape(-1).at[_wrap(index, x.size)].get(mode="clip")


def _check_put(ctx):
    index, source = ctx.args[1], ctx.args[2]
    _require_same_dtype(ctx, source)
    if _numel(index.shape) != _numel(source.shape):
        raise IndexError("put_(): Expected source and index to have the same number of elements, but got "
                         f"source.numel() = {_numel(source.shape)}, index.numel() = {_numel(index.shape)}")
    return None


@lowering(aten.put.default, check=_check_put)
def put(ctx, x, index, source, accumulate=False):
    dtype = _arith_dtype(x.dtype) if accumulate else x.dtype
    flat, where = x.astype(dtype).reshape(-1), _wrap(index.reshape(-1), x.size)
    source = source.astype(dtype).reshape(-1)
    return (flat.at[where].add(source) if accumulate else flat.at[where].set(source)).reshape(x.shape)


# -- sorting -----------------------------------------------------------------------------------
def _sort_ascending(x, axis: int):
    """(values, int64 indices), stable, NaN last, -0.0 equal to 0.0, as torch orders."""
    key = x
    if _is_float(x.dtype):
        # one NaN and one zero, so the total order lax.sort uses on floats agrees with torch's
        key = jnp.where(jnp.isnan(x), jnp.nan, jnp.where(x == 0, 0, x).astype(x.dtype))
    elif x.dtype == jnp.bool_:
        key = x.astype(jnp.uint8)
    positions = lax.broadcasted_iota(jnp.int64, x.shape, axis)
    _, values, indices = lax.sort((key, x, positions), dimension=axis, is_stable=True, num_keys=1)
    return values, indices


def _sort(x, dim: int, descending: bool):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    axis = _dim(dim, x.ndim)
    if not descending:
        return _sort_ascending(x, axis)
    # Descending and stable: sort the reversed tensor ascending and reverse the result, so equal
    # elements keep their original order and NaN (the largest) comes first.
    values, indices = _sort_ascending(jnp.flip(x, axis), axis)
    return jnp.flip(values, axis), x.shape[axis] - 1 - jnp.flip(indices, axis)


def _check_sortable(ctx):
    # declined, torch raises its own errors eagerly (sort and topk have no decomposition)
    dtype = ctx.args[0].dtype
    if dtype.is_complex:
        return "complex values have no order"
    if dtype == torch.bool and ctx.op is aten.topk.default:
        return "torch's CPU topk does not support bool"
    return None


@lowering(aten.sort.default, check=_check_sortable)
def sort(ctx, x, dim=-1, descending=False):
    # torch's unstable sort leaves the order of equal elements unspecified; a stable one is valid
    return _sort(x, dim, descending)


@lowering(aten.sort.stable, check=_check_sortable)
def sort_stable(ctx, x, *, stable=None, dim=-1, descending=False):
    return _sort(x, dim, descending)


@lowering(aten.topk.default, check=_check_sortable)
def topk(ctx, x, k, dim=-1, largest=True, sorted=True):
    # sorted=False leaves the order unspecified in torch; sorted order is one valid answer
    values, indices = _sort(x, dim, largest)
    if x.ndim == 0:
        return values, indices
    axis = _dim(dim, x.ndim)
    return lax.slice_in_dim(values, 0, k, axis=axis), lax.slice_in_dim(indices, 0, k, axis=axis)


def _searchsorted(ctx, sequence, values, right, side, sorter):
    """torch's binary search, step by step: with NaN in the sequence, any other bisection order
    would give different answers."""
    dtype = ctx.promoted_dtype
    sequence, values = sequence.astype(dtype), jnp.asarray(values).astype(dtype)
    upper = right or side == "right"
    n = sequence.shape[-1]
    batched = sequence.ndim > 1

    def at(positions):
        positions = jnp.clip(positions, 0, max(n - 1, 0))
        if sorter is not None:
            positions = (jnp.take_along_axis(sorter, positions, -1) if batched else sorter[positions])
        return jnp.take_along_axis(sequence, positions, -1) if batched else sequence[positions]

    start = jnp.zeros(values.shape, jnp.int64)
    end = jnp.full(values.shape, n, jnp.int64)
    if n == 0:
        return start
    for _ in range(n.bit_length()):
        active = start < end
        mid = start + ((end - start) >> 1)
        mid_value = at(mid)
        go_right = ~(mid_value > values) if upper else ~(mid_value >= values)
        start = jnp.where(active & go_right, mid + 1, start)
        end = jnp.where(active & ~go_right, mid, end)
    return start


def _check_searchsorted(ctx):
    if any(m.dtype.is_complex or m.dtype == torch.bool for m in ctx.tensor_args()):
        return "complex or bool values"  # torch raises eagerly
    if ctx.kwargs.get("side") not in (None, "left", "right"):
        return "unknown side"  # torch raises eagerly
    sorter = ctx.kwargs.get("sorter")
    if sorter is not None and sorter.dtype != torch.int64:
        return "sorter is not int64"  # torch raises eagerly
    if ctx.op in (aten.bucketize.Tensor, aten.bucketize.Scalar) and len(ctx.args[1].shape) != 1:
        # torch's kernel checks this, its meta function does not, its decomposition neither
        raise RuntimeError(f"boundaries tensor must be 1 dimension, but got dim({len(ctx.args[1].shape)})")
    return None


@lowering(aten.searchsorted.Tensor, aten.searchsorted.Scalar, check=_check_searchsorted)
def searchsorted(ctx, sequence, values, *, out_int32=False, right=False, side=None, sorter=None):
    return _searchsorted(ctx, sequence, values, right, side, sorter)


@lowering(aten.bucketize.Tensor, aten.bucketize.Scalar, check=_check_searchsorted)
def bucketize(ctx, values, boundaries, *, out_int32=False, right=False):
    return _searchsorted(ctx, boundaries, values, right, None, None)


def _repeat_interleave_check(ctx):
    # the recorder fills in output_size after checking it against the repeats (capture/sized.py)
    return None if ctx.kwargs.get("output_size") is not None else "output size unknown until run"


@lowering(aten.repeat_interleave.Tensor, check=_repeat_interleave_check)
def repeat_interleave(ctx, repeats, *, output_size=None):
    """Each index i of ``repeats`` repeated repeats[i] times (checked nonnegative and summing to
    ``output_size`` before recording)."""
    return jnp.repeat(jnp.arange(repeats.shape[0], dtype=jnp.int64), repeats,
                      total_repeat_length=output_size)

