"""Our own decompositions, for ops that torch._decomp leaves whole but that must not run eagerly in
a training loop: the foreach ops (unrolled into one aten call per list element), the fused
optimizer steps and torch.amp's gradient scaler ops (written as the per-element math of their CPU
kernels), batch norm updating its running statistics (as its functional twin) and group norm of
a half input with float32 parameters (in float32, as its CPU kernel computes it).

All are recorded like any other code (through the defer mode), so an optimizer step fuses with
the backward pass before it, and its Python float hyperparameters become runtime scalars.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from ..ir.foreach import foreach_binding

aten = torch.ops.aten

# -- foreach ------------------------------------------------------------------------------------
# (which per-element overload a foreach op unrolls into: ir/foreach.py, shared with the
# torch.compile front end)


def unroll_foreach(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run a foreach op as one per-element aten call per list element (in the caller's mode).
    NotImplemented if the op has no per-element form (its scalars come as a tensor)."""
    binding = foreach_binding(op)
    if binding is None:
        return NotImplemented
    schema_args = op._schema.arguments
    values = list(args) + [kwargs.get(a.name, a.default_value) if a.name in kwargs or a.has_default_value()
                           else None for a in schema_args[len(args):]]
    lengths = {len(v) for v, listed in zip(values, binding.listed) if listed}
    if len(lengths) != 1:
        raise RuntimeError(f"{op}: tensor lists must have the same number of elements, got "
                           f"{sorted(lengths)}")
    (n,) = lengths
    results = []
    for i in range(n):
        pos, kw = binding.element_arguments(values, i)
        result = binding.op(*pos, **kw)
        if binding.copy_back:
            values[0][i].copy_(result)
        results.append(result)
    if not op._schema.returns:
        return None
    return results


# -- fused optimizers ---------------------------------------------------------------------------
_REDUCED = (torch.float16, torch.bfloat16)


def _under_amp(step):
    """A fused optimizer step as its kernel runs it with torch.amp's arguments: each gradient
    divided by ``grad_scale`` (and written back), and nothing changed at all when ``found_inf`` is
    1.  With no data-dependent branch: the step runs, and every tensor it may write is put back
    where ``found_inf`` says so (the copies fuse into the step's computation)."""
    @functools.wraps(step)
    def amp_step(params, grads, *lists, grad_scale=None, found_inf=None, **kwargs):
        if grad_scale is None and found_inf is None:
            return step(params, grads, *lists, **kwargs)
        written = [t for group in (params, grads, *lists) for t in group if isinstance(t, torch.Tensor)]
        before = [t.clone() for t in written] if found_inf is not None else []
        if grad_scale is not None:
            scale = grad_scale.reshape(())
            for g in grads:
                g.copy_(g / scale if g.dtype not in _REDUCED else g.float() / scale)
        step(params, grads, *lists, **kwargs)
        if found_inf is not None:
            skip = (found_inf == 1.0).reshape(())
            for t, old in zip(written, before):
                t.copy_(torch.where(skip, old, t))
        return None
    return amp_step


def _fused_adam(adamw: bool):
    @_under_amp
    def step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
             weight_decay, eps, amsgrad, maximize):
        for i, param in enumerate(params):
            grad = grads[i].neg() if maximize else grads[i]
            if weight_decay != 0:
                if adamw:
                    param.mul_(1 - lr * weight_decay)
                else:
                    grad = grad.add(param, alpha=weight_decay)
            # bias corrections in double from the step tensor, as the kernel computes them
            step_ = state_steps[i].to(torch.float64)
            bias_correction1 = 1 - torch.pow(beta1, step_)
            bias_correction2_sqrt = (1 - torch.pow(beta2, step_)).sqrt()
            exp_avg, exp_avg_sq = exp_avgs[i], exp_avg_sqs[i]
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if amsgrad:
                torch.maximum(max_exp_avg_sqs[i], exp_avg_sq, out=max_exp_avg_sqs[i])
                second = max_exp_avg_sqs[i]
            else:
                second = exp_avg_sq
            denom = (second.sqrt() / bias_correction2_sqrt.to(second.dtype)).add_(eps)
            step_size = (lr / bias_correction1).to(param.dtype)
            param.sub_(exp_avg / denom * step_size)
        return None
    return step


@_under_amp
def _fused_sgd(params, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening, nesterov,
               maximize, is_first_step):
    for i, param in enumerate(params):
        grad = grads[i].neg() if maximize else grads[i]
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        if momentum != 0:
            buf = momentum_buffer_list[i]
            if is_first_step:
                buf.copy_(grad)
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            grad = grad.add(buf, alpha=momentum) if nesterov else buf
        if isinstance(lr, torch.Tensor):
            param.sub_(grad * lr.to(param.dtype))
        else:
            param.add_(grad, alpha=-lr)
    return None


# -- torch.amp.GradScaler -----------------------------------------------------------------------
# Written as the per-element math of their CPU kernels (aten/src/ATen/native/cpu/
# AmpGradScalerKernels.cpp); no data-dependent branch, so a step fuses whether or not it overflows.


def _amp_unscale(grads, found_inf, inv_scale):
    """Each gradient times ``inv_scale`` in place (in float32 for half and bfloat16 gradients, as
    the kernel computes them), and ``found_inf`` set to 1.0 if any gradient holds an inf or NaN."""
    if not grads:
        return None
    inv = inv_scale.reshape(())
    finite = torch.stack([g.isfinite().all() for g in grads]).all()
    found_inf.copy_(torch.where(finite, found_inf, torch.ones_like(found_inf)))
    for g in grads:
        g.copy_(g.float() * inv if g.dtype in _REDUCED else g * inv)
    return None


def _amp_update_scale(current_scale, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor,
                      growth_interval):
    """The scale backed off (and the tracker reset) after an overflow; otherwise the tracker
    counts successful steps and, at ``growth_interval``, the scale grows where the grown scale is
    finite.  The kernel multiplies the float scale by the double factors in double."""
    found = found_inf != 0
    successful = growth_tracker + 1
    grow = successful == growth_interval
    scale = current_scale.double()
    backed_off = (scale * scale_backoff_factor).to(current_scale.dtype)
    grown = (scale * scale_growth_factor).to(current_scale.dtype)
    kept = torch.where(grow & grown.isfinite(), grown, current_scale)
    tracker = torch.where(found | grow, torch.zeros_like(growth_tracker), successful)
    current_scale.copy_(torch.where(found, backed_off, kept))
    growth_tracker.copy_(tracker)
    return current_scale


# -- batch norm in training mode ------------------------------------------------------------------
def _batch_norm_training(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """``native_batch_norm`` updating running statistics (in place, though its schema does not
    say so): its functional twin, whose lowering computes what the CPU kernel does, then the
    statistics copied back.  torch._decomp's decomposition rounds the saved mean and inverse
    deviation to the input's type on the CPU, where the kernel keeps them float32 for a
    bfloat16 or half input with float32 parameters: its backward then raised "mixed dtype"."""
    if not training or running_mean is None or running_var is None:
        return NotImplemented
    out, save_mean, save_invstd, new_mean, new_var = aten._native_batch_norm_legit_functional(
        input, weight, bias, running_mean, running_var, True, momentum, eps)
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, save_mean, save_invstd


# -- group norm of a half or bfloat16 input with float32 parameters --------------------------------
# The CPU kernel's "mixed type" (GroupNorm.cpp): it computes in float32 from the half input,
# keeps mean and rstd float32, and rounds only the normalized output (and grad_input) to the
# input's type.  torch._decomp's decompositions, and the meta kernels, round the statistics to the
# input's type (the backward then starts from rounded statistics: gradients 1e-3 off), and the
# backward's meta kernel gives grad_input float32.  So a mixed call is recorded as the same op on
# the input made float32, its output rounded to the input's type; other calls go the usual way.
def _mixed(x, *params) -> bool:
    defined = [p for p in params if p is not None]
    return bool(defined) and x.dtype in _REDUCED and all(p.dtype == torch.float32 for p in defined)


def _group_norm(input, weight, bias, N, C, HxW, group, eps):
    if not _mixed(input, weight, bias):
        return NotImplemented
    out, mean, rstd = aten.native_group_norm(input.float(), weight, bias, N, C, HxW, group, eps)
    return out.to(input.dtype), mean, rstd


def _group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    if not _mixed(input, weight) or mean.dtype != torch.float32:
        return NotImplemented
    grad_input, grad_weight, grad_bias = aten.native_group_norm_backward(
        grad_out.float(), input.float(), mean, rstd, weight, N, C, HxW, group, output_mask)
    return (None if grad_input is None else grad_input.to(input.dtype)), grad_weight, grad_bias


DECOMPOSITIONS: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    aten.native_group_norm.default: _group_norm,
    aten.native_group_norm_backward.default: _group_norm_backward,
    aten.native_batch_norm.default: _batch_norm_training,
    aten._amp_foreach_non_finite_check_and_unscale_.default: _amp_unscale,
    aten._amp_update_scale_.default: _amp_update_scale,
    aten._fused_adam_.default: _fused_adam(adamw=False),
    aten._fused_adam_.tensor_lr: _fused_adam(adamw=False),
    aten._fused_adamw_.default: _fused_adam(adamw=True),
    aten._fused_adamw_.tensor_lr: _fused_adam(adamw=True),
    aten._fused_sgd_.default: _fused_sgd,
    aten._fused_sgd_.tensor_lr: _fused_sgd,
}
