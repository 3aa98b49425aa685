"""Elementwise operations: activations, arithmetic, dropout, and ops that keep their input's label.

Every tensor argument broadcasts against the others; a unit class survives an axis only
if every operand that is not broadcast along it carries it there (so a residual addition
joins the classes of its two branches, and adding the model input fixes them).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn.trace.call import TraceCall
from pyperm.nn.trace.labels import Label, tensor_leaves
from pyperm.nn.trace.registry import register_all
from pyperm.nn.trace.rules.norms import channel_norm
from pyperm.nn.trace.sites import Role

__all__ = ["elementwise", "elementwise_with_role", "invariant", "nonlinear", "same"]

NONLINEAR_MODULES = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid,
    nn.Tanh, nn.Softplus, nn.Softsign, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.LogSigmoid,
    nn.Tanhshrink, nn.Softshrink, nn.Hardshrink, nn.Threshold, nn.RReLU, nn.Softmax, nn.LogSoftmax,
    nn.Softmin,
)  # fmt: skip
PASSTHROUGH_MODULES = (
    nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
)  # fmt: skip
NONLINEAR_FUNCTIONS = (
    F.relu, torch.relu, F.relu_, torch.relu_, F.relu6, F.elu, F.selu, F.celu, F.gelu, F.silu, F.mish,
    F.leaky_relu, F.hardtanh, F.hardswish, F.hardsigmoid, F.logsigmoid, F.softplus, F.softsign, F.tanhshrink,
    F.softshrink, F.hardshrink, F.threshold, F.rrelu, torch.sigmoid, F.sigmoid, torch.tanh, F.tanh, torch.exp,
    torch.log, torch.abs, torch.sqrt, torch.rsqrt, torch.square, torch.clamp, torch.clip, torch.sin, torch.cos,
    torch.erf, torch.reciprocal, torch.sign, torch.log1p, torch.expm1, F.softmax, F.log_softmax, F.softmin,
    torch.softmax, torch.log_softmax, torch.pow, operator.pow, torch.maximum, torch.minimum, F.normalize,
)  # fmt: skip
# More elementwise functions of torch: each output element depends on the same element of every
# (broadcast) argument alone, which is all the rules need; the role only matters for the sites.
MORE_NONLINEAR_NAMES = (
    "addcdiv", "float_power", "true_divide", "atan", "arctan", "atan2", "tan", "sinh", "cosh", "asinh",
    "exp2", "log2", "log10", "erfc", "erfinv", "hypot", "logaddexp", "logit", "fmod", "remainder", "round",
    "floor", "ceil", "trunc", "frac", "xlogy", "sgn", "fmax", "fmin", "clamp_min", "clamp_max", "selu", "celu",
    "rrelu", "hardshrink", "exp_", "square_", "sqrt_", "abs_", "floor_divide",
)  # fmt: skip
MORE_LINEAR_NAMES = ("addcmul", "positive", "negative", "subtract", "multiply", "divide", "neg_", "lerp_")
MORE_NONLINEAR_FUNCTIONS = tuple(getattr(torch, n) for n in MORE_NONLINEAR_NAMES if hasattr(torch, n)) + (
    F.elu_, F.leaky_relu_, F.hardtanh_, F.threshold_, F.celu_, F.selu_, F.rrelu_, torch.special.expit,
    torch.special.erf, torch.special.logit, operator.floordiv, operator.mod, operator.abs, abs,
)  # fmt: skip
MORE_LINEAR_FUNCTIONS = tuple(getattr(torch, n) for n in MORE_LINEAR_NAMES if hasattr(torch, n))
MORE_METHODS = tuple(n for n in MORE_NONLINEAR_NAMES + ("pow_", "erf_", "log_", "relu6") if hasattr(torch.Tensor, n))
MORE_LINEAR_METHODS = tuple(n for n in MORE_LINEAR_NAMES + ("addcmul_", "addcdiv_") if hasattr(torch.Tensor, n))
# Functions of libraries pyperm does not import, by qualified name: torchvision's stochastic
# depth scales whole samples (rows) or the whole batch by one random factor, so the units
# keep their classes.
PER_SAMPLE_NAMED = ("torchvision.ops.stochastic_depth.stochastic_depth",)

LINEAR_FUNCTIONS = (
    operator.add, operator.sub, operator.mul, operator.truediv, operator.iadd, operator.isub, operator.imul,
    operator.itruediv, operator.neg, operator.pos, torch.add, torch.sub, torch.mul, torch.div, torch.neg,
    torch.where, torch.lerp, torch.nan_to_num, F.dropout, F.dropout1d, F.dropout2d, F.dropout3d,
    F.alpha_dropout, F.feature_alpha_dropout, torch.masked_fill,
)  # fmt: skip
NONLINEAR_METHODS = (
    "relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "exp", "log", "abs", "sqrt", "rsqrt", "square",
    "clamp", "clamp_", "clip", "pow", "softmax", "log_softmax", "sin", "cos", "erf", "reciprocal", "sign",
    "log1p", "expm1", "maximum", "minimum",
)  # fmt: skip
LINEAR_METHODS = (
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "neg", "lerp", "masked_fill", "masked_fill_",
    "nan_to_num", "where",
)  # fmt: skip
# Methods whose result is the first argument; other arguments only give dtype or device.
SAME_METHODS = ("contiguous", "clone", "detach", "float", "double", "half", "bfloat16", "to", "type", "type_as",
                "cpu", "cuda", "requires_grad_")  # fmt: skip
LIKE_FUNCTIONS = (torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
                  torch.randn_like)  # fmt: skip
NEW_METHODS = ("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor")


def elementwise_with_role(call: TraceCall, role: Role) -> Label:
    """Label an elementwise result (every tensor argument broadcast) and give the node ``role``."""
    out = call.out_tensor()
    ops = tensor_leaves(call.args, call.largs)
    for k, v in call.kwargs.items():
        ops.extend(tensor_leaves(v, call.lkwargs.get(k)))
    call.role = role
    return call.broadcast(ops, tuple(out.shape))


def elementwise(call: TraceCall) -> Label:
    """Rule: a function of each unit alone that is not an activation (arithmetic, dropout, a residual add)."""
    return elementwise_with_role(call, Role.PASS)


def nonlinear(call: TraceCall) -> Label:
    """Rule: an activation function of each unit alone (marks a post-activation site)."""
    return elementwise_with_role(call, Role.NONLINEAR)


def same(call: TraceCall) -> Label:
    """Rule: the result is the first argument (a copy, a dtype or device change)."""
    _, lab = call.first()
    call.role = Role.PASS
    return lab


def like(call: TraceCall) -> Label:
    """``zeros_like(x)`` and kin: constant (or identically distributed) along every axis of ``x``.

    Permuting ``x``'s units leaves such a tensor as it is, so it may carry ``x``'s label:
    ``x + torch.ones_like(x)`` keeps the units permutable.
    """
    _, lab = call.first()
    return lab


def invariant(call: TraceCall) -> Any:
    """Rule: the result does not depend on the order of any units (``zeros_like``, a new tensor)."""
    return call.invariant()


def _prelu(call: TraceCall, w: Label | None, n: int) -> Label:
    _, lx = call.first()
    out = channel_norm(call, lx, [w] if n > 1 else [])
    call.role = Role.NONLINEAR
    return out


def prelu_module(call: TraceCall) -> Label:
    return _prelu(call, call.param("weight"), call.module.num_parameters)  # type: ignore[union-attr]


def prelu_function(call: TraceCall) -> Label:
    w, _ = call.arg(1, "weight")
    return _prelu(call, w, int(call.args[1].numel()))


register_all(NONLINEAR_MODULES, nonlinear)
register_all(PASSTHROUGH_MODULES, elementwise)
register_all(NONLINEAR_FUNCTIONS + NONLINEAR_METHODS, nonlinear)
register_all(LINEAR_FUNCTIONS + LINEAR_METHODS, elementwise)
register_all(SAME_METHODS, same)
register_all(LIKE_FUNCTIONS, like)
register_all(NEW_METHODS, invariant)
register_all(MORE_NONLINEAR_FUNCTIONS + MORE_METHODS, nonlinear)
register_all(MORE_LINEAR_FUNCTIONS + MORE_LINEAR_METHODS, elementwise)
register_all([nn.Softmax2d], nonlinear)
register_all(PER_SAMPLE_NAMED, same)
register_all([nn.PReLU], prelu_module)
register_all([F.prelu], prelu_function)
