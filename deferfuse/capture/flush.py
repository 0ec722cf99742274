"""The flush: computing pending contents and writing them into memory.

``materialize_states`` runs the pending graph of some storages (widened to what shares work with
them, ``_widen``), then writes each result back into the user's memory (``write_back``), adopts
it as the storage's memory where nothing outside deferfuse has seen the old one (``_adopt``),
and releases what the computed nodes held (``_release``).  It knows storages, not the tensor
subclass, so the tensor module can call it.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

import torch

from .. import engine
from ..debugging.source import user_source
from ..errors import FlushReason, failed_node, raised_again
from ..ir import graph
from ..ir.graph import Node, StorageState, Value
from ..stats import STATS
from . import meta as meta_
from .dispatch_keys import no_dispatch
from .storage import STATES_BY_PTR, flat_meta, raw_data_ptr, snapshot_old_leaves, untyped_storage


def materialize_states(states: list[StorageState], reason: FlushReason, recorder: Any,
                       everything: bool = False, detail: Optional[str] = None,
                       checked: Optional[list[Value]] = None) -> None:
    """Compute the contents of ``states`` and write them into their buffers (``everything``:
    they are all that is pending, so there is nothing to widen the flush to; ``detail``: what
    explain() says after the reason, such as the collective that flushed; ``checked``: values
    of ops that check values, computed for their checks even where nothing reads them)."""
    states = [s for s in states if s.contents is not None]
    checked = [v for v in checked if v.result is None] if checked else []
    if not states and not checked:
        return
    snapshot, nodes = False, None
    if recorder is not None:
        states, snapshot, nodes = _widen(states, recorder, everything)
    STATS.flushes[reason.value] += 1
    with no_dispatch(), engine.profile_range("deferfuse.flush"):
        targets: list[Value] = []
        for s in states:
            if s.contents[0] == "root" and not _is_plain_root(s):
                flatten_detached(s)
                nodes = None   # (a new node to compute)
            targets.append(s.contents[1])
        if nodes is None:
            nodes = graph.ancestors(targets)
        if checked:
            # (a check whose op the targets need runs with them; only the others, whose
            # results nobody reads, are computed as outputs of their own)
            needed = {n.id for n in nodes}
            checked = [v for v in checked if v.node.id not in needed]
            if checked:
                nodes = graph.ancestors(targets + checked)
        all_states = states
        to_compute = [v for v in targets if v.result is None] + checked
        trigger = user_source() if recorder is None or recorder.record_source else None
        # (whether this flush computes a target's result: then the memory is its own to adopt)
        fresh_results = [v.result is None for v in targets]
        why = reason.value if detail is None else f"{reason.value} {detail}"
        try:
            computed = iter(engine.execute(nodes, to_compute, why, trigger, on_lone=meta_.mark_lone)
                            if to_compute else [])
        except Exception as exc:
            failed = failed_node(exc)
            if failed is not None and recorder is not None:
                poison(failed, exc, states + recorder.pending_states(), recorder)
            raise
        results = [(next(computed), True) if fresh else (v.result, False)
                   for v, fresh in zip(targets, fresh_results)]
        adopted: set[int] = set()
        for s, value, (result, fresh) in zip(all_states, targets, results):
            flat = result.reshape(-1)
            if s.buffer is None:
                if adopted and raw_data_ptr(flat) in adopted:
                    flat = flat.clone()   # (another storage of this flush holds that memory)
                s.buffer = flat
                ptr = untyped_storage(flat).data_ptr()
                if ptr:
                    STATES_BY_PTR[ptr] = s
                s.owned = fresh and _adoptable(flat, s, adopted)
            elif s.owned and fresh and _adoptable(flat, s, adopted):
                _adopt(s, flat)
            else:
                if snapshot:
                    snapshot_old_leaves(s)
                write_back(s.buffer, flat)
                s.old_leaves = []
            value.result = result
            s.contents = None
            s.changed()
        _release(nodes)
    if recorder is not None:
        recorder.pending_nodes = max(0, recorder.pending_nodes - len(nodes))
        if not everything:
            recorder.flushed()


# A flush computes what it needs, and with it every pending storage whose graph shares work with
# that (so nothing computed inside this computation is computed again later: a training step
# ending in loss.item() runs as one computation), or that reads memory this flush writes back
# (so it still sees the old contents).  Scalar bookkeeping (an optimizer's step counter read with
# .item()) instead copies the small memory it writes back for the pending readers of its old
# contents, so it never drags the rest of the pending graph along.
_SMALL_FLUSH_NODES = 64
_SNAPSHOT_BYTES = 1 << 16


def _widen(states: list[StorageState], recorder: Any,
           everything: bool = False) -> tuple[list[StorageState], bool, Optional[list[Node]]]:
    """(states to compute, whether to snapshot old memory before writing it back, and the
    pending nodes they need when that is known already)."""
    nodes = graph.ancestors([s.contents[1] for s in states])
    if everything:
        return states, False, nodes
    small = len(nodes) <= _SMALL_FLUSH_NODES and all(m.numel <= 1 for n in nodes for m in n.out_metas)
    if small and all(s.buffer is None or s.numel * s.dtype.itemsize <= _SNAPSHOT_BYTES for s in states):
        return states, True, nodes
    chosen = {id(s): s for s in states}
    others = [p for p in recorder.pending_states() if id(p) not in chosen]
    if not others:
        return states, False, nodes
    computed = _shared_work(nodes)
    written: set[int] = set()

    def note_written(s: StorageState) -> None:
        if s.buffer is not None:
            written.update(id(leaf) for leaf in (ref() for ref in s.old_leaves) if leaf is not None)

    for s in states:
        note_written(s)
    grew = True
    while grew and others:
        grew = False
        touches: dict[int, bool] = {}
        remaining = []
        for p in others:
            if _touches(p.contents[1].node, computed, written, touches):
                chosen[id(p)] = p
                _add_shared_work(p.contents[1].node, computed)
                note_written(p)
                grew = True
            else:
                remaining.append(p)
        others = remaining
    return list(chosen.values()), False, nodes if len(chosen) == len(states) else None


def _shared_work(nodes: list[Node]) -> set[int]:
    """Ids of the nodes whose work another storage could share: all but plain reads of memory."""
    return {n.id for n in nodes if not (n.op is graph.READ_VIEW and n.inputs[0].result is not None)}


def _add_shared_work(root: Node, computed: set[int]) -> None:
    """Add ``root`` and its pending ancestors to ``computed``, stopping at nodes already there
    (their ancestors are too), so including many storages walks the graph once."""
    stack = [root]
    while stack:
        node = stack.pop()
        if node.id in computed:
            continue
        if not (node.op is graph.READ_VIEW and node.inputs[0].result is not None):
            computed.add(node.id)
        stack.extend(v.node for v in node.inputs if v.result is None and v.node.id not in computed)


def _touches(root: Node, computed: set[int], written: set[int], memo: dict[int, bool]) -> bool:
    """Whether ``root`` or a pending node above it is computed by this flush or reads memory it
    writes back (iterative: pending graphs may be deep).  Plain loops rather than generators:
    a flush at the end of a training step walks every pending node through here."""
    stack = [(root, False)]
    pop, push = stack.pop, stack.append
    while stack:
        node, expanded = pop()
        nid = node.id
        if nid in memo:
            continue
        inputs = node.inputs
        if not expanded:
            if nid in computed:
                memo[nid] = True
                continue
            if written:
                hit = False
                for v in inputs:
                    if id(v) in written:
                        hit = True
                        break
                if hit:
                    memo[nid] = True
                    continue
            push((node, True))
            for v in inputs:
                if v.result is None:
                    above = v.node
                    if above.id not in memo:
                        push((above, False))
        else:
            found = False
            for v in inputs:
                if v.result is None and memo.get(v.node.id, False):
                    found = True
                    break
            memo[nid] = found
    return memo.get(root.id, False)



# Write-backs into user memory up to this size are one memmove on the calling thread.  torch's copy_
# splits a copy over its OpenMP threads, and right after an XLA computation those wait for
# cores that XLA's own threads are still spinning on: with the second core busy, an AdamW
# step's 150 copies of 256 KB took 4.3 ms by memmove and 9.4 ms by copy_ (python -m
# bench.adamw_parts --write-back-both); on an idle 2-core machine the two are within noise.
# Larger copies stay with copy_: on a machine with many cores its threads reach a memory
# bandwidth one thread does not.
MEMMOVE_BYTES = 1 << 20


def write_back(buffer: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy the computed contents ``flat`` into ``buffer``, the user's memory."""
    nbytes = flat.nbytes
    if nbytes <= MEMMOVE_BYTES and flat.dtype == buffer.dtype and flat.device.type == "cpu" \
            and buffer.device.type == "cpu" and flat.numel() == buffer.numel() \
            and flat.is_contiguous() and buffer.is_contiguous():
        ctypes.memmove(raw_data_ptr(buffer), raw_data_ptr(flat), nbytes)
    else:
        buffer.copy_(flat)


def _adoptable(flat: torch.Tensor, s: StorageState, adopted: set[int]) -> bool:
    """Whether a state may keep ``flat``, a result this flush computed, as its memory: its own
    (no other result of the flush lies in it), dense and of the storage's size and dtype."""
    if flat.device.type != "cpu" or flat.dtype != s.dtype or flat.numel() != s.numel \
            or not flat.is_contiguous():
        return False
    ptr = raw_data_ptr(flat)
    if not ptr or ptr in adopted:
        return False
    adopted.add(ptr)
    return True


def _adopt(s: StorageState, flat: torch.Tensor) -> None:
    """The new contents of a storage whose memory nothing outside deferfuse has seen become its
    memory, instead of being copied into the old one (an optimizer's state, updated every step).
    Pending nodes that read the old memory keep it, unchanged, through their graph inputs."""
    old = raw_data_ptr(s.buffer)
    if old and STATES_BY_PTR.get(old) is s:
        del STATES_BY_PTR[old]
    s.buffer = flat
    ptr = raw_data_ptr(flat)
    if ptr:
        STATES_BY_PTR[ptr] = s
    s.old_leaves = []


def _is_plain_root(s: StorageState) -> bool:
    _, value, m = s.contents
    return m.is_contiguous and m.offset == 0 and m.numel == s.numel


def flatten_detached(s: StorageState) -> Value:
    _, value, m = s.contents
    (flat,) = graph.emit(graph.FLATTEN, (value, m), {}, (flat_meta(s),), (graph.FLATTEN, m))
    s.contents = ("flat", flat)
    return flat


def poison(failed: Node, exc: BaseException, states: list[StorageState], recorder: Any = None) -> None:
    """A flush raised ``exc`` from ``failed``'s op: the error reaches the user once, here, and
    never comes back.  Every pending storage whose contents depend on that op leaves the pending
    graph: one with memory of its own (a user's tensor, a parameter) drops the pending writes
    that depend on it, as if they never ran, which is what strict leaves when the op raises
    (writes of the same storage before them are kept where they were partial writes, dropped
    with the rest where a write covered the whole storage); one without (a deferred result)
    is *poisoned*: reading it raises the error again, writing all of it makes it a value again.
    Pending work that does not depend on the op stays pending: the next flush computes it."""
    states = [s for s in dict.fromkeys(states) if s.contents is not None]
    checked = recorder.checked if recorder is not None else []
    nodes = graph.ancestors([s.contents[1] for s in states] + [v for v in checked if v.result is None])
    bad = {failed.id}
    for node in nodes:   # (record order: a topological order)
        if node.id in bad:
            continue
        for v in node.inputs:
            if v.node.id in bad and v.result is None:
                bad.add(node.id)
                break
    if checked:   # (checks of the failed op, or of ops that read its results: gone with them)
        recorder.checked = [v for v in checked if v.node.id not in bad]
    for s in states:
        value = s.contents[1]
        if value.node.id not in bad:
            continue
        if s.buffer is None:
            s.contents = None
            s.poisoned = exc
        else:
            while value.node.id in bad and value.node.op is graph.WRITE_VIEW:
                value = value.node.args[0]   # (the flat contents before that write)
            if value.node.id in bad or value.node.op is graph.INPUT:
                s.contents = None            # (memory holds the contents before them all)
            else:
                s.contents = ("flat", value)
        s.changed()


def raise_poisoned(s: StorageState) -> None:
    """Reading a storage whose op failed raises its error again."""
    raise raised_again(s.poisoned)


def _release(nodes: list[Node]) -> None:
    """Computed nodes drop their arguments, so the graph above them (and the tensors it holds)
    is freed now rather than when the last computed Value goes.  A node with an output still
    pending (an intermediate some cached read may ask for again) keeps them."""
    for node in nodes:
        # (a loop, not all() over a generator: this runs for every node of every flush)
        for ref in node.out_refs:
            v = ref()
            if v is not None and v.result is None:
                break
        else:
            node.args = ()
            node.kwargs = {}
            node.inputs = ()
