"""The operator catalogue: every built-in operator, its interface and its torch reference.

Elementwise operators are expressions over the math library (gpuos_core/mathlib.py), so the CUDA
code of a catalogue op and of a user's expression come from the same generator. Each has an
independent torch reference (torch's own function), used by tests and by the canary check before a
swap.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .calls import Empty, LaidOut, OpCall, Params
from .errors import TensorSpecError
from .expr import Expr, parse
from .families import Family, family

RefFn = Callable[[Sequence[torch.Tensor], Sequence[float]], torch.Tensor]
NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,47}$")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ScalarParam:
    """A named float parameter of an operator; `default` None means the caller gives it, unless
    the family derives it from the inputs (attention's `scale` from the head dim)."""

    name: str
    default: float | None = None


@dataclass(frozen=True)
class OpSpec:
    """One operator version's definition. Interface fields stay fixed across versions of an op."""

    name: str  # C identifier, unique
    family: str  # families.family(...) name
    arity: int  # most tensor inputs
    min_inputs: int  # fewest tensor inputs (norms take optional weights)
    scalars: tuple[ScalarParam, ...] = ()  # in the order of task.scalars
    expression: Expr | None = None  # map family: the implementation
    reference: RefFn | None = None  # independent torch reference; None: the implementation
    source: str = "catalogue"  # where this version came from (expression text)
    cuda_body: str | None = None  # raw CUDA functor body (map only; `expression` is then
    # its reference and what the CPU backend runs)

    @property
    def kind(self) -> Family:
        """The family object."""
        return family(self.family)

    def compute(self, xs: Sequence[torch.Tensor], p: Params) -> torch.Tensor:
        """This version's own torch implementation over encoded-layout inputs."""
        return self.kind.compute(xs, p, self.expression)

    def check_reference(self, xs: Sequence[torch.Tensor], p: Params) -> torch.Tensor:
        """The reference a kernel of this version must match (encoded layout)."""
        if self.reference is None:
            return self.compute(xs, p)
        return self.reference(xs, p.scalars)


def check_name(name: str) -> str:
    """Operator names become C symbols: lower-case identifier, at most 48 characters."""
    if not NAME_RE.match(name):
        raise TensorSpecError(
            f"operator name {name!r} is invalid: use a lower-case letter then letters, digits or "
            "'_', at most 48 characters"
        )
    return name


MAX_CUDA_BODY = 16384


def expression_spec(
    name: str,
    text: str,
    arity: int | None = None,
    scalars: tuple[ScalarParam, ...] | None = None,
    cuda: str | None = None,
) -> OpSpec:
    """A map operator from an expression; scalars default to required s0..s{n-1}. `cuda`, when
    given, is the body of its functor (`float operator()(const float* a, const float* s)`: inputs
    a[0..arity), scalars s[0..4)) and the expression becomes its reference."""
    if cuda is not None and not 0 < len(cuda) <= MAX_CUDA_BODY:
        raise TensorSpecError(
            f"CUDA source must be 1 to {MAX_CUDA_BODY} characters, got {len(cuda)}"
        )
    expr = parse(text, arity)
    params = (
        scalars
        if scalars is not None
        else tuple(ScalarParam(f"s{i}") for i in range(expr.num_scalars))
    )
    if expr.num_scalars > len(params):
        raise TensorSpecError(
            f"expression uses s{expr.num_scalars - 1} but {name} takes {len(params)} scalar(s)"
        )
    return OpSpec(check_name(name), "map", expr.arity, expr.arity, params, expr, None, text, cuda)


def new_version(current: OpSpec, text: str, cuda: str | None = None) -> OpSpec:
    """The next version of `current` implemented by an expression, keeping its interface."""
    if current.family != "map":
        raise TensorSpecError(
            f"{current.name} is a {current.family} operator: only elementwise (map) operators can "
            "be replaced by an expression"
        )
    made = expression_spec(current.name, text, current.arity, current.scalars, cuda)
    return replace(made, arity=current.arity, min_inputs=current.min_inputs)


def _map(name: str, text: str, ref: RefFn, *scalars: ScalarParam) -> OpSpec:
    spec = expression_spec(name, text, None, tuple(scalars))
    return replace(spec, reference=ref, source="catalogue")


def _fixed(name: str, fam: str, arity: int, min_inputs: int, *scalars: ScalarParam) -> OpSpec:
    return OpSpec(name, fam, arity, min_inputs, tuple(scalars))


def _builtin() -> dict[str, OpSpec]:
    P = ScalarParam
    specs = [
        _map("add", "A + B", lambda x, s: torch.add(x[0], x[1])),
        _map("sub", "A - B", lambda x, s: torch.sub(x[0], x[1])),
        _map("mul", "A * B", lambda x, s: torch.mul(x[0], x[1])),
        _map("div", "A / B", lambda x, s: torch.div(x[0], x[1])),
        _map("maximum", "max(A, B)", lambda x, s: torch.maximum(x[0], x[1])),
        _map("minimum", "min(A, B)", lambda x, s: torch.minimum(x[0], x[1])),
        _map("pow", "pow(A, B)", lambda x, s: torch.pow(x[0], x[1])),
        _map("relu", "relu(A)", lambda x, s: torch.relu(x[0])),
        _map("sigmoid", "sigmoid(A)", lambda x, s: torch.sigmoid(x[0])),
        _map("tanh", "tanh(A)", lambda x, s: torch.tanh(x[0])),
        _map("exp", "exp(A)", lambda x, s: torch.exp(x[0])),
        _map("log", "log(A)", lambda x, s: torch.log(x[0])),
        _map("sqrt", "sqrt(A)", lambda x, s: torch.sqrt(x[0])),
        _map("abs", "abs(A)", lambda x, s: torch.abs(x[0])),
        _map("sin", "sin(A)", lambda x, s: torch.sin(x[0])),
        _map("cos", "cos(A)", lambda x, s: torch.cos(x[0])),
        _map("gelu", "gelu(A)", lambda x, s: F.gelu(x[0])),
        _map("gelu_tanh", "gelu_tanh(A)", lambda x, s: F.gelu(x[0], approximate="tanh")),
        _map("silu", "silu(A)", lambda x, s: F.silu(x[0])),
        _map("swiglu", "silu(A) * B", lambda x, s: F.silu(x[0]) * x[1]),  # Llama's gated MLP
        _map("hardsigmoid", "hardsigmoid(A)", lambda x, s: F.hardsigmoid(x[0])),
        _map("hardswish", "hardswish(A)", lambda x, s: F.hardswish(x[0])),
        _map(
            "leaky_relu",
            "leaky_relu(A, s0)",
            lambda x, s: F.leaky_relu(x[0], s[0]),
            P("negative_slope", 0.01),
        ),
        _map(
            "hardtanh",
            "hardtanh(A, s0, s1)",
            lambda x, s: F.hardtanh(x[0], s[0], s[1]),
            P("min_val", -1.0),
            P("max_val", 1.0),
        ),
        _map("elu", "elu(A, s0)", lambda x, s: F.elu(x[0], s[0]), P("alpha", 1.0)),
        _map(
            "softplus",
            "softplus(A, s0, s1)",
            lambda x, s: F.softplus(x[0], s[0], s[1]),
            P("beta", 1.0),
            P("threshold", 20.0),
        ),
        _map(
            "clamp",
            "clamp(A, s0, s1)",
            lambda x, s: torch.clamp(x[0], s[0], s[1]),
            P("min"),
            P("max"),
        ),
        _map("clamp_min", "clamp_min(A, s0)", lambda x, s: torch.clamp_min(x[0], s[0]), P("min")),
        _map("clamp_max", "clamp_max(A, s0)", lambda x, s: torch.clamp_max(x[0], s[0]), P("max")),
        _map("neg", "-A", lambda x, s: torch.neg(x[0])),
        _map("reciprocal", "1 / A", lambda x, s: torch.reciprocal(x[0])),
        _fixed("softmax", "softmax", 1, 1),
        _fixed("log_softmax", "log_softmax", 1, 1),
        _fixed("layernorm", "layernorm", 3, 1, P("eps", 1e-5)),
        _fixed("rmsnorm", "rmsnorm", 2, 1, P("eps", 1e-6)),
        _fixed("add_layernorm", "add_layernorm", 4, 2, P("eps", 1e-5)),  # x += y; layernorm(x)
        _fixed("add_rmsnorm", "add_rmsnorm", 3, 2, P("eps", 1e-6)),  # x += y; rmsnorm(x)
        _fixed("sum", "sum", 1, 1),
        _fixed("mean", "mean", 1, 1),
        _fixed("rotary", "rotary", 4, 3),  # [, positions]
        # linear_parts' sums rotated up to row `rotated` of dim -2 (q, k heads), then only summed
        _fixed("rotary_parts", "rotary_parts", 4, 3, P("rotated")),
        # [, lengths[, new_k, new_v]]
        _fixed("attention_decode", "attention_decode", 6, 3, P("scale")),
        _fixed("scatter_rows", "scatter_rows", 2, 2),
        _fixed("gather_rows", "gather_rows", 2, 2),  # embedding lookups
        _fixed("sample_tokens", "sample_tokens", 3, 3),
        _fixed("linear", "linear", 3, 2),  # x @ weight.T [+ bias]
        _fixed("linear_parts", "linear_parts", 3, 2),  # its K splits' sums, for add_*norm
        _fixed("linear_gelu", "linear_gelu", 3, 2),  # gelu(linear): an MLP's up projection
        _fixed("linear_gelu_tanh", "linear_gelu_tanh", 3, 2),
        _fixed("linear_silu_glu", "linear_silu_glu", 3, 2),  # swiglu(linear), W's rows in pairs
        _fixed("feed_tokens", "feed_tokens", 4, 4),  # the LLM engine's chained steps
        _fixed("tick", "tick", 1, 1),
    ]
    return {s.name: s for s in specs}


CATALOGUE: Mapping[str, OpSpec] = _builtin()


def prepare(
    spec: OpSpec, call: OpCall, device: torch.device, empty: Empty | None = None
) -> LaidOut:
    """Validate `call` against `spec` and lay it out for encoding; allocates the output if
    needed, with `empty` when given (a program's Arena), else torch.empty on `device`."""
    _check_inputs(spec, call.inputs, device)
    if call.share is not None and call.share < 1:
        raise TensorSpecError(f"{spec.name}: share must be at least 1, got {call.share}")
    lay = spec.kind.fit_out(spec.kind.layout(call.inputs, call.dims, call.keepdim), call.out)
    scalars = _scalars(spec, call.scalars, call.inputs)
    out = _output(call, lay.out_shape, device, spec.kind.out_dtype, empty)
    out_ref = out
    if lay.ref_shape != lay.out_shape:  # reductions without keepdim: re-insert the reduced dims
        for d in lay.reduce_dims:
            out_ref = out_ref.unsqueeze(d)
    return LaidOut(
        spec.name,
        out,
        out_ref,
        lay.inputs,
        Params(scalars, lay.reduce_dims),
        lay.items,
        spec.kind,
        inputs_written=spec.kind.inputs_written,
        reads=lay.reads,
        share=call.share,
    )


def run_reference(spec: OpSpec, call: OpCall) -> torch.Tensor:
    """`call` computed by `spec`'s torch reference directly, without layout checks or encoding:
    what launching the micro-op with torch costs (a baseline). Inputs must already agree."""
    xs = call.inputs
    if spec.kind.updates_out:  # its reference takes the `out` it updates as a last input
        if call.out is None:
            raise TensorSpecError(f"{spec.name} writes into the tensor given as out=: pass one")
        xs = (*xs, call.out)
    return spec.check_reference(xs, Params(_scalars(spec, call.scalars, call.inputs)))


def _check_inputs(spec: OpSpec, inputs: Sequence[torch.Tensor], device: torch.device) -> None:
    if not spec.min_inputs <= len(inputs) <= spec.arity:
        want = (
            str(spec.arity)
            if spec.min_inputs == spec.arity
            else f"{spec.min_inputs} to {spec.arity}"
        )
        raise TensorSpecError(f"{spec.name} takes {want} tensor input(s), got {len(inputs)}")
    indices = spec.kind.index_inputs
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise TensorSpecError(
                f"{spec.name} input {i} must be a torch.Tensor, got {type(x).__name__}"
            )
        if i in indices and x.dtype != torch.int32:
            raise TensorSpecError(
                f"{spec.name} input {i} ({indices[i]}) is an index tensor: it "
                f"must be int32, got {x.dtype}"
            )
        if i not in indices and x.dtype not in FLOAT_DTYPES:
            which = (
                f"only its {' and '.join(indices.values())} input is int32"
                if indices
                else "it takes no int32 index input"
            )
            raise TensorSpecError(
                f"{spec.name} input {i} has dtype {x.dtype}; use float32, "
                f"float16 or bfloat16 ({which})"
            )
        if x.device != device:
            raise TensorSpecError(
                f"{spec.name} input {i} is on {x.device}; this runtime runs on "
                f"{device}: move it there first"
            )


def _scalars(
    spec: OpSpec, given: Mapping[str, float], inputs: Sequence[torch.Tensor]
) -> tuple[float, ...]:
    names = [p.name for p in spec.scalars]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise TensorSpecError(
            f"{spec.name} has no parameter(s) {unknown}; it takes {names or 'none'}"
        )
    values = []
    for p in spec.scalars:
        value = given.get(p.name, p.default)
        if value is None:
            value = spec.kind.derived_scalar(p.name, inputs)
        if value is None:
            raise TensorSpecError(f"{spec.name} needs the parameter {p.name!r}")
        values.append(float(value))
    return tuple(values)


def _output(
    call: OpCall,
    shape: tuple[int, ...],
    device: torch.device,
    fixed: torch.dtype | None,
    empty: Empty | None,
) -> torch.Tensor:
    """The caller's `out`, checked, or a new one (from `empty` when given); `fixed` is the
    family's output dtype if it has one."""
    if fixed is not None and call.out_dtype not in (None, fixed):
        raise TensorSpecError(
            f"{call.op} returns {fixed}; out_dtype {call.out_dtype} is not possible"
        )
    dtype = fixed or call.out_dtype or _promote(call.inputs)
    if call.out is None:  # no allocator made per call: this is every coalesced task's path
        return (
            torch.empty(shape, dtype=dtype, device=device) if empty is None else empty(shape, dtype)
        )
    out = call.out
    kind = f"a {fixed} tensor" if fixed else "a float tensor"
    allowed = (fixed,) if fixed else FLOAT_DTYPES
    if tuple(out.shape) != shape or out.dtype not in allowed or out.device != device:
        raise TensorSpecError(
            f"{call.op}: out must be {kind} of shape {shape} on {device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if _overlaps_itself(out):
        raise TensorSpecError(
            f"{call.op}: out has overlapping elements (an expanded view); "
            "pass a tensor whose elements are distinct"
        )
    return out


def _promote(inputs: Sequence[torch.Tensor]) -> torch.dtype:
    dtype = inputs[0].dtype
    for x in inputs[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def _overlaps_itself(t: torch.Tensor) -> bool:
    return any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))
