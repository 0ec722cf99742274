"""Debug mode: every op runs eagerly in torch, one by one, after checks torch does not always make.

    with deferfuse.debug():          # or TORCHTPU_MODE=debug
        y = model(x)

``DebugMode`` (mode.py) is the TorchDispatchMode; the checks live beside it:

  source.py   the user's file:line, past frames of deferfuse, torch and jax
  bounds.py   before an indexing op (embedding, index_select, gather, scatter, index,
              index_put, take, ...): every index within the indexed dimension, as torch
              allows it for that op (negative indices wrap only where torch wraps them)
  checks.py   before a mutating op: no written tensor shares memory with another input
              (except the identical view, as in ``x.add_(x)``); after any op, when the
              setting ``check_nans`` is on: no NaN/Inf that the op's inputs did not have
  uninit.py   (setting ``check_uninitialized``) memory from empty*/resizes tracked per element
              until written; a read of an unwritten element names the allocation's line
  backward.py each forward op's line and module written into its autograd node, read back in
              backward, so an error there names the forward line that recorded the node
  scopes.py   the running module's path (``model.layers.2.mlp``), from global module hooks

A failed check raises a ``DebugCheckError`` (see deferfuse.errors) that names the aten op, the
user's file:line and module (in backward: the forward line and module too), and whose type
still matches what strict PyTorch raises, if it does.

``compare.py`` (``deferfuse.compare``, the divergence finder) runs a program in strict mode and
under defer and names the first op whose values part; it is imported by ``deferfuse`` only,
since it uses the modes, which import this package.
This package imports torch only (not jax).  It is not named ``debug`` because
``deferfuse.debug`` is the function that enters the mode.
"""

from .mode import DebugMode
from .source import user_source

__all__ = ["DebugMode", "user_source"]
