"""Google's tokamax kernel library as PyTorch ops (the optional extra ``deferfuse[tokamax]``).

Five of tokamax's ops, each a ``deferfuse.jax_op`` in the namespace ``tokamax``, with torch-typed
signatures that follow tokamax's own:

- ``dot_product_attention(query, key, value, bias, mask, *, scale, is_causal, ...)``: tokamax's
  layout, ``(batch, length, heads, dim)``, with grouped-query heads;
- ``layer_norm(x, scale, offset, *, axis, epsilon, scale_offset, subtract_mean)``;
- ``gated_linear_unit(x, weights, *, activation)``: fused weights ``(K, 2, N)``, the activation
  named by a string (``ACTIVATIONS``);
- ``ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type, activation)``;
- ``linear_softmax_cross_entropy_loss(x, labels, weights, *, reduction)``.

``register_with_transformers()`` registers tokamax's attention as the transformers attention
implementation ``"tokamax"``.

Importing this module registers the ops and imports neither JAX nor tokamax: tokamax is imported
when an op is first traced (and by ``register_with_transformers``), and is missing it raises an
``ImportError`` that says to ``pip install 'deferfuse[tokamax]'``.  On the CPU (deferfuse's
tensors) every op runs tokamax's XLA implementation (``implementation="xla"``); on an
accelerator, tokamax's default choice (its Pallas kernels where they apply).  ``implementation=``
overrides both.
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata
from typing import Any, Callable, Optional

import torch

from .._lazy import lazy_import
from ..lower import dtypes as dtypes_
from .jax_op import JaxOp, fingerprint, jax_op, pallas_interpret

jax = lazy_import("jax", globals(), "jax")

INSTALL = "pip install 'deferfuse[tokamax]'"


def load() -> Any:
    """The ``tokamax`` module; an ImportError saying how to install it when it is missing."""
    try:
        module = importlib.import_module("tokamax")
    except ImportError as error:
        raise ImportError(f"deferfuse's tokamax ops need the tokamax package ({error}); "
                          f"install it with: {INSTALL}") from error
    # tokamax 0.0.12 reads its options from absl flags, parsing the whole sys.argv the first
    # time, which fails on any argument absl does not know (pytest's -q, a script's own flags).
    # Parse only the flags that are defined (tokamax's --tokamax_* ones), as later tokamax does.
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv, known_only=True)
    return module


def _installed_version() -> str:
    try:
        return metadata.version("tokamax")
    except metadata.PackageNotFoundError:
        return "missing"


def _op(name: str, static_argnames: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], JaxOp]:
    """``jax_op`` for a tokamax op: its version names this file and tokamax's version, so an
    executable cached for another tokamax never runs."""
    def register(fn: Callable[..., Any]) -> JaxOp:
        version = f"{fingerprint(fn, None, None)}-tokamax{_installed_version()}"
        return jax_op(name, static_argnames=static_argnames, version=version)(fn)
    return register


def _implementation(chosen: Optional[str]) -> Optional[str]:
    """tokamax's XLA implementation on the CPU; its default (None) on an accelerator."""
    if chosen is not None:
        return chosen
    return "xla" if pallas_interpret() else None


def _gelu(x: Any) -> Any:
    return jax.nn.gelu(x, approximate=False)


def _gelu_tanh(x: Any) -> Any:
    return jax.nn.gelu(x, approximate=True)


def _silu(x: Any) -> Any:
    return jax.nn.silu(x)


def _relu(x: Any) -> Any:
    return jax.nn.relu(x)


def _sigmoid(x: Any) -> Any:
    return jax.nn.sigmoid(x)


# the activations by name, as torch names them: "gelu" is exact (torch's F.gelu), "gelu_tanh"
# its tanh approximation (jax.nn.gelu's default)
ACTIVATIONS: dict[str, Callable[[Any], Any]] = {
    "silu": _silu, "swish": _silu, "gelu": _gelu, "gelu_tanh": _gelu_tanh, "relu": _relu, "sigmoid": _sigmoid,
}


def _activation(name: Optional[str]) -> Optional[Callable[[Any], Any]]:
    if name is None:
        return None
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


@_op("tokamax::dot_product_attention", static_argnames=("scale", "logits_soft_cap"))
def dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          bias: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
                          query_seq_lengths: Optional[torch.Tensor] = None,
                          key_value_seq_lengths: Optional[torch.Tensor] = None, *,
                          scale: Optional[float] = None, is_causal: bool = False,
                          local_window_size: Optional[list[int]] = None, logits_soft_cap: Optional[float] = None,
                          precision: Optional[str] = None, implementation: Optional[str] = None) -> torch.Tensor:
    """tokamax.dot_product_attention: ``query (*B, T, N, H)``, ``key`` and ``value``
    ``(*B, S, K, H)`` with ``N`` a multiple of ``K``; ``bias`` (added to the logits) and ``mask``
    (boolean, True: attend) broadcast to ``(*B, N, T, S)``; integer ``query_seq_lengths`` and
    ``key_value_seq_lengths`` ``(B,)`` (positional here, keywords in tokamax: a torch custom op
    takes no keyword-only tensors); ``local_window_size``: one or two ints (before, after).
    ``scale`` and ``logits_soft_cap`` are compiled in."""
    window: Any = local_window_size
    if window is not None:
        if len(window) not in (1, 2):
            raise ValueError(f"local_window_size takes one or two ints, got {list(window)}")
        window = window[0] if len(window) == 1 else tuple(window)
    return load().dot_product_attention(
        query, key, value, bias=bias, mask=mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=window, logits_soft_cap=logits_soft_cap, precision=precision,
        implementation=_implementation(implementation))


@_op("tokamax::layer_norm", static_argnames=("epsilon", "scale_offset"))
def layer_norm(x: torch.Tensor, scale: Optional[torch.Tensor], offset: Optional[torch.Tensor], *, axis: int = -1,
               epsilon: float = 1e-6, scale_offset: float = 0.0, subtract_mean: bool = True,
               implementation: Optional[str] = None) -> torch.Tensor:
    """tokamax.layer_norm: LayerNorm along ``axis`` (RMSNorm with ``subtract_mean=False``),
    computed in float32 for half-precision inputs; ``scale`` is used as ``scale + scale_offset``.
    ``epsilon`` and ``scale_offset`` are compiled in."""
    return load().layer_norm(x, scale, offset, axis=axis, epsilon=epsilon, scale_offset=scale_offset,
                             subtract_mean=subtract_mean, implementation=_implementation(implementation))


@_op("tokamax::gated_linear_unit")
def gated_linear_unit(x: torch.Tensor, weights: torch.Tensor, *, activation: Optional[str] = None,
                      precision: Optional[str] = None, implementation: Optional[str] = None) -> torch.Tensor:
    """tokamax.gated_linear_unit: ``activation(x @ weights[:, 0]) * (x @ weights[:, 1])`` for
    ``x (*B, M, K)`` and fused ``weights (K, 2, N)``; ``activation`` names one of
    ``ACTIVATIONS`` ("silu" gives SwiGLU), None for none."""
    return load().gated_linear_unit(x, weights, activation=_activation(activation), precision=precision,
                                    implementation=_implementation(implementation))


@_op("tokamax::ragged_dot")
def ragged_dot(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, precision: Optional[str] = None,
               preferred_element_type: Optional[torch.dtype] = None, activation: Optional[str] = None, *,
               implementation: Optional[str] = None) -> torch.Tensor:
    """tokamax.ragged_dot (``jax.lax.ragged_dot``'s API): ``lhs (M, K)``, ``rhs (G, K, N)``,
    integer ``group_sizes (G,)``; rows of group ``g`` are multiplied by ``rhs[g]``, rows past
    ``group_sizes.sum()`` are zero.  ``activation`` as in ``gated_linear_unit``."""
    element_type = None if preferred_element_type is None else dtypes_.to_jax(preferred_element_type)
    return load().ragged_dot(lhs, rhs, group_sizes, precision=precision, preferred_element_type=element_type,
                             activation=_activation(activation), implementation=_implementation(implementation))


@_op("tokamax::linear_softmax_cross_entropy_loss")
def linear_softmax_cross_entropy_loss(x: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, *,
                                      reduction: str = "sum", implementation: Optional[str] = None) -> torch.Tensor:
    """tokamax.linear_softmax_cross_entropy_loss: the cross entropy of ``softmax(x @ weights)``
    (``x (B, H)``, ``weights (H, V)``) against integer ``labels (B,)``, summed or averaged
    (``reduction``), a 0-d tensor; the logits are never returned."""
    return load().linear_softmax_cross_entropy_loss(x, labels, weights, reduction=reduction,
                                                    implementation=_implementation(implementation))


def hf_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                 is_causal: Optional[bool] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An attention function for transformers' ``AttentionInterface``: its inputs in SDPA's
    layout ``(batch, heads, length, dim)``, its output ``(batch, length, heads, dim)``, which is
    tokamax's layout.  A boolean mask is tokamax's ``mask``, a float one its ``bias``; a
    ``softcap`` its ``logits_soft_cap``.  Calls with dropout or a position bias go to SDPA's."""
    if dropout or kwargs.get("position_bias") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    mask = bias = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:
            bias = attention_mask.to(query.dtype)
    out = dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), bias, mask,
                                scale=scaling, is_causal=is_causal, logits_soft_cap=kwargs.get("softcap"))
    return out, None


def register_with_transformers(name: str = "tokamax") -> str:
    """Register ``hf_attention`` as the transformers attention implementation ``name`` (with
    SDPA's masks): ``Model.from_config(config, attn_implementation="tokamax")``.  Imports
    tokamax, so a missing install is said here."""
    load()
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    AttentionInterface.register(name, hf_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name
