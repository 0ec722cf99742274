"""The pending graph: immutable nodes, the values they produce, and storage states.

A ``Node`` is one recorded op.  Its ``args``/``kwargs`` hold ``Value``s where the op took tensors,
``RuntimeScalar``s where it took a Python float that may change between runs, and plain Python
values elsewhere.  Record order is a topological order, so ``Node.id`` sorts a subgraph.

``StorageState`` is the memory model.  torch's aliasing lives in storages: every view, in-place
op and ``out=`` write touches a storage through (size, stride, offset).  We model each storage as
a flat 1-D value; reading a tensor is a strided read of that value, writing is a strided write
that produces the next flat value.  The common cases stay cheap: a tensor that is the whole
storage (``TensorMeta.covers_storage``) keeps its logical value as the storage contents, and a
tensor whose storage has not changed since its value was computed reads that value directly.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Optional

import torch

from .meta import TensorMeta

_node_ids = itertools.count()


class InternalOp:
    """An op of our own (graph inputs and the storage model), not an aten overload."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"deferfuse.{self.name}"


INPUT = InternalOp("input")                  # a leaf: value.result is a torch tensor
READ_VIEW = InternalOp("read_view")          # (flat, TensorMeta) -> strided read
WRITE_VIEW = InternalOp("write_view")        # (flat, value, TensorMeta) -> new flat
FLATTEN = InternalOp("flatten")              # (value, TensorMeta) -> flat in memory order
CAST = InternalOp("cast")                    # (value, torch.dtype) -> value
AS_REAL = InternalOp("as_real")              # (complex flat,) -> its real and imaginary parts,
                                             # interleaved: the memory as the real dtype
BITS = InternalOp("bits")                    # (value, conj, neg) -> what a tensor with those
                                             # lazy bits reads: -conj(value) with both
VALUE_CHECK = InternalOp("value_check")      # (condition, error type, message) -> condition:
                                             # raises error(message) where it does not hold


class RuntimeScalar:
    """Marks a Python float that is passed to the compiled computation at run time."""

    __slots__ = ("value",)

    def __init__(self, value: float) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"RuntimeScalar({self.value!r})"


class Value:
    """One output of a node: metadata now, data (``result``) once computed."""

    __slots__ = ("node", "index", "meta", "result", "__weakref__")

    def __init__(self, node: "Node", index: int, meta: TensorMeta) -> None:
        self.node = node
        self.index = index
        self.meta = meta
        self.result: Optional[torch.Tensor] = None

    def __repr__(self) -> str:
        state = "computed" if self.result is not None else "pending"
        return f"Value({self.node.op}#{self.node.id}[{self.index}], {list(self.meta.shape)}, {state})"


class Node:
    """One recorded op.  A node refers to its outputs only weakly: Values point at their node
    and nodes at their input Values, so the graph holds no reference cycle and a Value (with the
    tensor it computed) is freed by reference counting as soon as its last user lets go, never
    left for Python's cycle collector.  Create nodes with ``emit``, which returns the Values."""

    __slots__ = ("id", "op", "args", "kwargs", "out_metas", "out_refs", "key", "source", "lowering",
                 "inputs", "scalars", "__weakref__")

    def __init__(self, op: Any, args: tuple, kwargs: dict, out_metas: tuple[TensorMeta, ...],
                 key: Any, source: Any = None, lowering: Any = None,
                 inputs: Optional[tuple] = None, scalars: tuple = ()) -> None:
        self.id = next(_node_ids)
        self.op = op
        self.args = args
        self.kwargs = kwargs
        # the Values and runtime scalars among the arguments, in argument order (args, then
        # kwargs, lists flattened): the hot path of signatures never walks the arguments again
        self.inputs: tuple = tuple(self._walk_values()) if inputs is None else inputs
        self.scalars = scalars
        self.key = key            # structural: op and static arguments, no value identities
        self.source = source      # the place in the user's code that recorded it (SourceLine)
        self.lowering = lowering
        self.out_metas = out_metas
        self.out_refs: tuple = ()   # weak references to the output Values (set by emit)

    @property
    def outputs(self) -> tuple[Optional["Value"], ...]:
        """The output Values, None where nothing refers to one any more."""
        return tuple(r() for r in self.out_refs)

    def _walk_values(self) -> list[Value]:
        found: list[Value] = []
        for a in itertools.chain(self.args, self.kwargs.values()):
            if isinstance(a, Value):
                found.append(a)
            elif type(a) in (list, tuple):
                found.extend(x for x in a if isinstance(x, Value))
        return found

    def input_values(self) -> tuple:
        return self.inputs

    def __repr__(self) -> str:
        return f"Node#{self.id}({self.op})"


def emit(op: Any, args: tuple, kwargs: dict, out_metas: tuple[TensorMeta, ...], key: Any,
         source: Any = None, lowering: Any = None, inputs: Optional[tuple] = None,
         scalars: tuple = ()) -> tuple[Value, ...]:
    """A new node; returns its output Values (the node holds them only weakly)."""
    node = Node(op, args, kwargs, out_metas, key, source, lowering, inputs, scalars)
    if len(out_metas) == 1:
        value = Value(node, 0, out_metas[0])
        node.out_refs = (weakref.ref(value),)
        return (value,)
    values = tuple(Value(node, i, m) for i, m in enumerate(out_metas))
    node.out_refs = tuple(weakref.ref(v) for v in values)
    return values


def leaf(tensor: torch.Tensor) -> Value:
    """A graph input holding ``tensor`` (contiguous, offset 0, so DLPack shares it)."""
    (value,) = emit(INPUT, (), {}, (TensorMeta.of(tensor),), key=None)
    value.result = tensor
    return value


def ancestors(targets: list[Value]) -> list[Node]:
    """Pending nodes needed to compute ``targets``, in record (topological) order.

    Iterative: pending graphs may be tens of thousands of nodes deep.
    """
    seen: set[int] = set()
    found: list[Node] = []
    stack = [v.node for v in targets if v.result is None]
    while stack:
        node = stack.pop()
        if node.id in seen:
            continue
        seen.add(node.id)
        found.append(node)
        for v in node.inputs:
            if v.result is None and v.node.id not in seen:
                stack.append(v.node)
    found.sort(key=lambda n: n.id)
    return found


class StorageState:
    """The contents of one storage, as the graph sees it.

    ``buffer`` is the real memory (a 1-D tensor over the whole storage) once there is any:
    a user tensor's storage, or a deferred tensor's after it was materialized.  ``contents``
    says what the storage holds if that differs from ``buffer``:
      None                       buffer is up to date
      ("root", value, meta)      the tensor ``meta`` covering the whole storage holds ``value``
      ("flat", value)            ``value`` is the flat contents in memory order
    ``poisoned``: the error of a failed op this storage's contents depended on (a flush raised
    it once); reading the storage raises it again, writing the whole storage clears it.
    ``version`` changes whenever the contents or their representation change; a tensor's
    cached value is valid only for the version it was computed at.  ``foreign``: ``buffer`` is
    memory torch does not own (NumPy's, a DLPack producer's, shared with other processes), which
    code we never see may write at any time: while it holds the contents, each recorded read
    takes a copy of it then, and nothing read from it is cached.
    """

    __slots__ = ("buffer", "contents", "version", "numel", "dtype", "device", "reads", "leaf",
                 "old_leaves", "epoch", "owned", "foreign", "poisoned", "owner", "__weakref__")

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device,
                 buffer: Optional[torch.Tensor] = None, contents: Any = None, foreign: bool = False) -> None:
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self.buffer = buffer
        self.contents = contents
        self.version = 0
        # values of tensors (by TensorMeta) read from the current contents
        self.reads: dict[TensorMeta, Value] = {}
        # graph input holding ``buffer`` while it is current
        self.leaf: Optional[Value] = None
        # every graph input made over ``buffer`` since it was last written (weakly): pending
        # nodes may still read the memory through them
        self.old_leaves: list = []
        # the defer context whose reads are cached: memory may change between contexts
        self.epoch = -1
        # ``buffer`` is memory a computation returned that nothing outside deferfuse has seen
        # (no view, pointer or array of it was handed out): a flush may replace it with the
        # memory of the new contents instead of copying them into it
        self.owned = False
        self.foreign = foreign
        # the error of the op whose result this storage was to hold, raised again when it is
        # read (a flush that failed: capture/flush.poison); None for a storage with a value
        self.poisoned: Optional[BaseException] = None
        # the user's tensor (weakly) whose memory ``buffer`` is, for the state of a plain tensor
        # (Recorder.state_of_real): once it is gone, only pending nodes may still read the memory
        self.owner: Optional[weakref.ref] = None

    def changed(self) -> None:
        """The contents or their representation changed: cached reads are stale."""
        self.version += 1
        self.reads = {}
        self.leaf = None

    @property
    def pending(self) -> bool:
        return self.contents is not None

    def __repr__(self) -> str:
        kind = "current" if self.contents is None else self.contents[0]
        return f"StorageState({self.numel} x {self.dtype}, {kind}, v{self.version})"
