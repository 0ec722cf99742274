"""The fast subset: a representative slice of op_db for CI (tests/test_conformance.py).

OpInfo names, with ".variant_test_name" where the OpInfo has one.  Together they cover pointwise
unary and binary ops, reductions, views and movement, indexing, linalg, nn.functional, creation,
in-place and out= variants, random ops, data-dependent shapes, and gradients (float64).
"""

FAST_OPS = (
    # pointwise unary
    "abs", "exp", "sin", "sigmoid", "sqrt", "floor", "logical_not", "bitwise_not",
    # pointwise binary / ternary
    "add", "mul", "div.no_rounding_mode", "pow", "maximum", "eq", "where", "clamp", "lerp",
    # reductions and scans
    "sum", "mean", "amax", "argmax", "var", "cumsum", "logsumexp",
    # views and movement
    "reshape", "transpose", "permute", "cat", "stack", "flip", "narrow", "unsqueeze", "expand",
    # indexing
    "index_select", "gather", "scatter", "masked_fill", "__getitem__", "index_put",
    # linalg
    "mm", "bmm", "addmm", "matmul",
    # nn.functional
    "softmax", "nn.functional.layer_norm", "nn.functional.conv2d", "nn.functional.relu",
    "nn.functional.gelu", "nn.functional.linear", "nn.functional.embedding",
    # creation
    "zeros_like", "full", "arange", "empty_like",
    # random
    "bernoulli", "nn.functional.dropout",
    # sorting, data-dependent shapes
    "sort", "nonzero",
    # a dtype JAX lacks (complex32): torch's kernel decides, not a lowering or decomposition
    "chalf",
)

# Samples per (OpInfo, dtype) in the fast subset: the first N that sample_inputs yields.
FAST_MAX_SAMPLES = 5      # the same cap as the full sweep's default
