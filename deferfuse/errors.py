"""Typed errors and the reasons deferfuse gives for flushes and fallbacks."""

from __future__ import annotations

import enum


class DeferfuseError(RuntimeError):
    """Base class of errors raised by deferfuse itself (not by the user's program)."""


class ModeError(DeferfuseError, ValueError):
    """An unknown execution mode name or value."""


class DuplicateLoweringError(DeferfuseError):
    """Two lowerings registered for the same aten overload."""


class LoweringError(DeferfuseError):
    """A lowering failed while building the XLA computation for a deferred op."""


class FlushReason(enum.Enum):
    ITEM = "item"                      # .item(), bool(), int(), float()
    TOLIST = "tolist"
    NUMPY = "numpy"                    # .numpy(), np.asarray, __array__
    REPR = "repr"                      # repr/str/print/format
    DATA_PTR = "data_ptr"
    SERIALIZE = "serialize"            # torch.save, pickle, deepcopy
    DATA_DEPENDENT = "data_dependent"  # an op whose output shape or value depends on data
    OBSERVING_OP = "observing_op"      # an op returning a Python value (torch.equal, ...)
    FALLBACK = "fallback"              # inputs of an op that runs eagerly
    CONTEXT_EXIT = "context_exit"
    SYNC = "sync"                      # deferfuse.sync()
    NODE_LIMIT = "node_limit"          # too many pending ops
    STEP = "step"                      # the end of an optimizer's step() (capture/steps.py)
    LOOP = "loop"                      # a loop with no step came round again (capture/steps.py)
    ESCAPE = "escape"                  # a deferred tensor used after its context ended
    COLLECTIVE = "collective"          # a torch.distributed collective (capture/collectives.py)
    FOREIGN_WRITE = "foreign_write"    # a write into memory torch does not own (from_numpy, ...)
    TRY_BLOCK = "try_block"            # inputs of an op that may raise, run at once inside a try
    FOREIGN_CODE = "foreign_code"      # before code that reads memory itself (torch.jit, torch.export)


class FallbackReason(enum.Enum):
    NO_LOWERING = "no_lowering"              # no lowering and no decomposition
    CHECK_FAILED = "check_failed"            # the lowering's checker declined these inputs
    NO_META = "no_meta"                      # no meta kernel, or one that rejects what the CPU kernel runs
    DATA_DEPENDENT = "data_dependent"        # output shape depends on values
    RANDOM = "random"                        # random op whose inputs' values are read
    OBSERVING = "observing"                  # op returns Python values
    UNSUPPORTED_ALIASING = "unsupported_aliasing"  # e.g. a dtype view of a storage
    INPLACE_VIEW = "inplace_view"            # metadata-mutating op on a deferred tensor
    LOWERING_FAILED = "lowering_failed"      # a lowering raised while tracing
    OPAQUE = "opaque"                        # memory the storage model cannot stand for: sparse,
                                             # nested, quantized, mkldnn, a self-dispatching subclass


class DebugCheckError(DeferfuseError):
    """A check of debug mode failed: the op would have read or written memory it should not,
    or produced values the user asked to be told about."""


class IndexBoundsError(DebugCheckError):
    """An index out of range, for ops on which torch raises RuntimeError (gather, scatter,
    index_select, index_add, embedding_bag)."""


class IndexBoundsIndexError(IndexBoundsError, IndexError):
    """An index out of range, for ops on which torch raises IndexError (embedding, indexing
    with tensors, index_put, take, index_copy, index_fill), so ``except IndexError`` still
    catches it."""


class NonFiniteError(DebugCheckError, FloatingPointError):
    """An op produced NaN or Inf from inputs that had none (debug mode with check_nans on)."""


class OverlapError(DebugCheckError):
    """An op writes memory that one of its other inputs reads (torch raises RuntimeError for
    the cases it detects)."""


# A flush that fails names the pending node whose op raised on the exception it raises (the
# attribute below), so that the node leaves the pending graph and the error is raised once.
FAILED_NODE = "deferfuse_failed_node"


def failed_node(exc: BaseException):
    """The pending node whose op raised ``exc`` in a flush, or None."""
    return getattr(exc, FAILED_NODE, None)


def mark_failed(exc: BaseException, node) -> BaseException:
    """``exc``, marked as raised by ``node``'s op (see ``failed_node``)."""
    try:
        setattr(exc, FAILED_NODE, node)
    except AttributeError:   # (an exception type with __slots__)
        pass
    return exc


def raised_again(exc: BaseException) -> BaseException:
    """A new exception of ``exc``'s type and message, for a read of a value whose op failed
    (raising the same object again would chain its old traceback)."""
    try:
        again = type(exc)(*exc.args)
    except Exception:  # noqa: BLE001 - an exception type with its own constructor
        return exc
    again.add_note("deferfuse: this value's op failed when it was computed earlier; reading "
                   "it raises that error again")
    return again


class UninitializedReadError(DebugCheckError):
    """An op read elements of memory allocated without values (``empty*``, a resize) that
    nothing had written (debug mode with check_uninitialized on)."""
