"""Kernels shipped as examples of ``deferfuse.jax_op`` (docs/kernels.md).  Importing a module
registers its ops (namespace ``deferfuse_examples``) and imports JAX:

- ``rmsnorm``: a Pallas RMSNorm over blocks of rows, with an explicit backward (``bwd=``);
- ``top2``: two outputs, one of them integer (``jax.lax.top_k``);
- ``attention``: attention in JAX as a drop-in for ``F.scaled_dot_product_attention``, and its
  registration as a Hugging Face ``transformers`` attention implementation.
"""
