"""Helpers over argument trees (tuples, lists and dicts holding tensors) and op results."""

from __future__ import annotations

from typing import Any

import torch


# -- helpers over argument trees ---------------------------------------------------------------
def tensors_in(*trees: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    stack = list(trees)
    while stack:
        a = stack.pop()
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            stack.extend(a)
        elif isinstance(a, dict):
            stack.extend(a.values())
    return found


def map_tensors(tree: Any, fn) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(x, fn) for x in tree)
    if isinstance(tree, dict):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    return tree


def written_arguments(func, info, args, kwargs) -> list:
    found = []
    names = info.arg_names
    for name in info.written:
        if name in kwargs:
            value = kwargs[name]
        else:
            i = names.index(name)
            if i >= len(args):
                continue
            value = args[i]
        # a written Tensor[] (foreach ops, fused optimizers) writes each of its tensors
        found.extend(value) if isinstance(value, (list, tuple)) else found.append(value)
    return found


def map_returned(out: Any, real_written: list, written: list) -> Any:
    def swap(t):
        for r, w in zip(real_written, written):
            if t is r:
                return w
        return t
    return map_tensors(out, swap)


def restructure(info, outs: list) -> Any:
    """Outputs in the structure the schema returns: one tensor, a list, or a tuple."""
    if info.returns == "one":
        return outs[0]
    return list(outs) if info.returns == "list" else tuple(outs)


def undefined_where_masked(op, args: tuple, kwargs: dict, result: Any) -> Any:
    """``result`` with None for each output whose ``output_mask`` entry is False, as torch's
    kernels return it: some decompositions (native_batch_norm_backward's grad_input) compute
    every output whatever the mask says."""
    if not isinstance(result, tuple):
        return result
    names = [a.name for a in op._schema.arguments]
    if "output_mask" not in names:
        return result
    mask = kwargs["output_mask"] if "output_mask" in kwargs else args[names.index("output_mask")]
    if len(mask) != len(result):
        return result
    return tuple(r if wanted else None for r, wanted in zip(result, mask))
