"""The math functions of the operator expression language: one table, read by the parser (names,
argument counts, defaults), the CUDA code generator (device function names in cuda/ops/math.cuh) and
the torch reference. Adding a function means one row here and one device function in math.cuh."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F

Operand = torch.Tensor | float


@dataclass(frozen=True)
class MathFn:
    """One function callable from an expression."""

    name: str  # as written in expressions
    min_args: int  # required arguments
    max_args: int  # min_args + len(defaults)
    defaults: tuple[float, ...]  # values of the trailing optional arguments, in order
    cuda: str  # `__device__ float` function of cuda/ops/math.cuh (max_args)
    torch: Callable[..., torch.Tensor]  # fp32 reference: max_args tensors or floats, broadcast


def _fp32_args(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wraps `fn` so that every argument, tensor or python float, reaches it as a float32 tensor on
    the device of the first tensor argument: floats become 0-dim tensors, so all arguments
    broadcast."""

    @functools.wraps(fn)
    def call(*args: Operand) -> torch.Tensor:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        return fn(*(torch.as_tensor(a, dtype=torch.float32, device=device) for a in args))

    return call


# torch's functionals take their parameters as python numbers only; these take tensors as well, with
# the formulas of torch's fp32 kernels.
def _leaky_relu(x: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, x, x * slope)


def _elu(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, x, alpha * torch.expm1(x))


def _softplus(x: torch.Tensor, beta: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return torch.where(x * beta > threshold, x, torch.log1p(torch.exp(x * beta)) / beta)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _where(cond: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.where(cond != 0, x, y)


def _fn(
    name: str, ref: Callable[..., torch.Tensor], min_args: int = 1, defaults: tuple[float, ...] = ()
) -> MathFn:
    return MathFn(
        name, min_args, min_args + len(defaults), defaults, f"gpuos_{name}", _fp32_args(ref)
    )


FUNCTIONS: Mapping[str, MathFn] = MappingProxyType(
    {
        f.name: f
        for f in (
            _fn("relu", torch.relu),
            _fn("sigmoid", torch.sigmoid),
            _fn("tanh", torch.tanh),
            _fn("exp", torch.exp),
            _fn("log", torch.log),
            _fn("sqrt", torch.sqrt),
            _fn("rsqrt", torch.rsqrt),
            _fn("abs", torch.abs),
            _fn("sin", torch.sin),
            _fn("cos", torch.cos),
            _fn("erf", torch.erf),
            _fn("gelu", F.gelu),
            _fn("gelu_tanh", _gelu_tanh),
            _fn("silu", F.silu),
            _fn("hardsigmoid", F.hardsigmoid),
            _fn("hardswish", F.hardswish),
            _fn("neg", torch.neg),
            _fn("reciprocal", torch.reciprocal),
            _fn("leaky_relu", _leaky_relu, defaults=(0.01,)),
            _fn("hardtanh", torch.clamp, defaults=(-1.0, 1.0)),
            _fn("elu", _elu, defaults=(1.0,)),
            _fn("softplus", _softplus, defaults=(1.0, 20.0)),
            _fn("clamp", torch.clamp, min_args=3),
            _fn("clamp_min", torch.clamp_min, min_args=2),
            _fn("clamp_max", torch.clamp_max, min_args=2),
            _fn("max", torch.maximum, min_args=2),
            _fn("min", torch.minimum, min_args=2),
            _fn("pow", torch.pow, min_args=2),
            _fn("where", _where, min_args=3),
        )
    }
)
