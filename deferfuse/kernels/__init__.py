"""Front end 3: JAX functions and Pallas kernels as PyTorch ops (``deferfuse.jax_op``).

Beside ``capture/`` (defer mode), never importing it: a ``jax_op`` is a ``torch.library`` custom
op whose lowering is registered in the table, so defer mode records it like an aten op.
"""

from .jax_op import JaxOp, KernelError, jax_op, pallas_interpret

__all__ = ["jax_op", "JaxOp", "KernelError", "pallas_interpret"]
