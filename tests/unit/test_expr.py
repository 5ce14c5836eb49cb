"""The expression language: parsing, precedence, validation errors and their positions, the torch
reference against torch itself, and real NVRTC compiles of the generated CUDA against math.cuh."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from cuda.bindings import nvrtc

from gpuos_core.errors import ExpressionError, TensorSpecError
from gpuos_core.expr import MAX_DEPTH, MAX_EXPR_CHARS, evaluate, parse
from gpuos_core.mathlib import FUNCTIONS
from gpuos_core.paths import CUDA_DIR

Ref = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def nvrtc_compile(cuda_expr: str) -> str:
    """Compiles `cuda_expr` as the body of a device function over math.cuh; returns NVRTC's log."""
    src = (
        '#include "ops/math.cuh"\nextern "C" __device__ float f(const float* a, const float* s) '
        f"{{ return {cuda_expr}; }}\n"
    )
    _, prog = nvrtc.nvrtcCreateProgram(src.encode(), b"expr.cu", 0, [], [])
    opts = [
        b"--gpu-architecture=sm_90",
        b"-rdc=true",
        f"-I{CUDA_DIR}".encode(),
        b"-Xptxas=--warn-on-double-precision-use",
    ]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    log = bytearray(nvrtc.nvrtcGetProgramLogSize(prog)[1])
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode()
    return log.decode().strip("\x00\n ")


@pytest.fixture
def abc() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A and C: real, both signs, some past softplus' threshold; B: positive (log, sqrt, pow
    base)."""
    torch.manual_seed(0)
    return torch.randn(257) * 4, torch.rand(257) + 0.1, torch.randn(257) * 4


# Each function of mathlib, called from an expression, against torch called directly.
CASES: dict[str, list[tuple[str, Ref]]] = {
    "relu": [("relu(A)", lambda a, b, c: torch.relu(a))],
    "sigmoid": [("sigmoid(A)", lambda a, b, c: torch.sigmoid(a))],
    "tanh": [("tanh(A)", lambda a, b, c: torch.tanh(a))],
    "exp": [("exp(A)", lambda a, b, c: torch.exp(a))],
    "log": [("log(B)", lambda a, b, c: torch.log(b))],
    "sqrt": [("sqrt(B)", lambda a, b, c: torch.sqrt(b))],
    "rsqrt": [("rsqrt(B)", lambda a, b, c: torch.rsqrt(b))],
    "abs": [("abs(A)", lambda a, b, c: torch.abs(a))],
    "sin": [("sin(A)", lambda a, b, c: torch.sin(a))],
    "cos": [("cos(A)", lambda a, b, c: torch.cos(a))],
    "erf": [("erf(A)", lambda a, b, c: torch.erf(a))],
    "gelu": [("gelu(A)", lambda a, b, c: F.gelu(a))],
    "gelu_tanh": [("gelu_tanh(A)", lambda a, b, c: F.gelu(a, approximate="tanh"))],
    "silu": [("silu(A)", lambda a, b, c: F.silu(a))],
    "hardsigmoid": [("hardsigmoid(A)", lambda a, b, c: F.hardsigmoid(a))],
    "hardswish": [("hardswish(A)", lambda a, b, c: F.hardswish(a))],
    "neg": [("neg(A)", lambda a, b, c: -a)],
    "reciprocal": [("reciprocal(A)", lambda a, b, c: torch.reciprocal(a))],
    "leaky_relu": [
        ("leaky_relu(A)", lambda a, b, c: F.leaky_relu(a)),
        ("leaky_relu(A, 0.2)", lambda a, b, c: F.leaky_relu(a, 0.2)),
    ],
    "hardtanh": [
        ("hardtanh(A)", lambda a, b, c: F.hardtanh(a)),
        ("hardtanh(A, -0.5, 2)", lambda a, b, c: F.hardtanh(a, -0.5, 2.0)),
    ],
    "elu": [("elu(A)", lambda a, b, c: F.elu(a)), ("elu(A, 0.7)", lambda a, b, c: F.elu(a, 0.7))],
    "softplus": [
        ("softplus(A)", lambda a, b, c: F.softplus(a)),
        ("softplus(A, 2, 5)", lambda a, b, c: F.softplus(a, beta=2.0, threshold=5.0)),
    ],
    "clamp": [
        ("clamp(A, -1, 2)", lambda a, b, c: torch.clamp(a, -1.0, 2.0)),
        ("clamp(A, C, C + 1)", lambda a, b, c: torch.clamp(a, c, c + 1)),
    ],
    "clamp_min": [("clamp_min(A, 0.5)", lambda a, b, c: torch.clamp_min(a, 0.5))],
    "clamp_max": [("clamp_max(A, 0.5)", lambda a, b, c: torch.clamp_max(a, 0.5))],
    "max": [("max(A, C)", lambda a, b, c: torch.maximum(a, c))],
    "min": [("min(A, C)", lambda a, b, c: torch.minimum(a, c))],
    "pow": [("pow(B, A)", lambda a, b, c: torch.pow(b, a)), ("pow(A, 2)", lambda a, b, c: a * a)],
    "where": [
        ("where(A, B, C)", lambda a, b, c: torch.where(a != 0, b, c)),
        ("where(A > C, A, 0.1 * C)", lambda a, b, c: torch.where(a > c, a, 0.1 * c)),
    ],
}


def test_cases_cover_every_function() -> None:
    assert CASES.keys() == FUNCTIONS.keys()


@pytest.mark.parametrize("text,ref", [case for cases in CASES.values() for case in cases])
def test_function_matches_torch(text: str, ref: Ref, abc: tuple[torch.Tensor, ...]) -> None:
    expr = parse(text)
    torch.testing.assert_close(evaluate(expr, abc[: expr.arity]), ref(*abc))


def test_scalars_are_parameters(abc: tuple[torch.Tensor, ...]) -> None:
    a, b, _ = abc
    expr = parse("leaky_relu(A, s0) + s1 * B")
    assert (expr.arity, expr.num_scalars) == (2, 2)
    torch.testing.assert_close(
        evaluate(expr, [a, b], [0.3, -1.5, 9.0, 9.0]), F.leaky_relu(a, 0.3) - 1.5 * b
    )


@pytest.mark.parametrize(
    "text,canonical",
    [
        ("A - B - C", "((A - B) - C)"),
        ("A / B / C", "((A / B) / C)"),
        ("A - B * C", "(A - (B * C))"),
        ("-A * B", "((-A) * B)"),
        ("-(A + B)", "(-(A + B))"),
        ("A + B < C * 2", "((A + B) < (C * 2.0))"),
        ("+A - -B", "(A - (-B))"),
    ],
)
def test_precedence_and_associativity(text: str, canonical: str) -> None:
    assert parse(text).canonical == canonical


def test_left_associativity_in_values(abc: tuple[torch.Tensor, ...]) -> None:
    a, b, c = abc
    torch.testing.assert_close(evaluate(parse("A - B - C"), abc), a - b - c)
    torch.testing.assert_close(evaluate(parse("A / B / C"), abc), a / b / c)
    torch.testing.assert_close(evaluate(parse("A - B * C"), abc), a - b * c)


@pytest.mark.parametrize("op", ["<", "<=", ">", ">=", "==", "!="])
def test_comparisons_yield_one_or_zero(op: str, abc: tuple[torch.Tensor, ...]) -> None:
    a, _, c = abc
    c = torch.where(torch.rand(c.shape) < 0.3, a, c)  # some equal pairs, so == and != both occur
    expected = {"<": a < c, "<=": a <= c, ">": a > c, ">=": a >= c, "==": a == c, "!=": a != c}[op]
    torch.testing.assert_close(evaluate(parse(f"A {op} C"), [a, c, c]), expected.float())


@pytest.mark.parametrize(
    "first,second",
    [
        ("A*B+1", "(A * B) + 1.0"),
        ("leaky_relu(A)", "leaky_relu(A, 0.01)"),
        ("hardtanh(A)", "hardtanh(A, -1, 1)"),
        ("-1 * A", "(-1.0) * (A)"),
        ("A * 2.5e-1", "A*.25"),
    ],
)
def test_canonical_is_equal_for_the_same_tree(first: str, second: str) -> None:
    assert parse(first).canonical == parse(second).canonical


def test_canonical_tells_different_trees_apart_and_reparses() -> None:
    assert parse("A*B+1").canonical != parse("A*(B+1)").canonical
    for text in ("A*B+1", "where(A > s0, -A, 0.5 / B)", "softplus(-A) != A", "A * -1"):
        canonical = parse(text).canonical
        assert parse(canonical).canonical == canonical


@pytest.mark.parametrize("literal", ["3", "2.5", ".5", "5.", "1e-3", "2.5E+2", "7e1"])
def test_number_formats(literal: str, abc: tuple[torch.Tensor, ...]) -> None:
    a = abc[0]
    torch.testing.assert_close(evaluate(parse(f"A * {literal}"), [a]), a * float(literal))


@pytest.mark.parametrize(
    "text,position,fragment",
    [
        ("", 0, "empty expression"),
        ("   ", 0, "empty expression"),
        ("A +", 3, "expected an operand, found end"),
        ("max(A,)", 6, "expected an operand, found ')'"),
        ("(A + B", 0, "unclosed '('"),
        ("relu(A", 4, "unclosed '('"),
        ("(A B)", 3, "expected ')', found 'B'"),
        ("relu(A B)", 7, "expected ',' or ')'"),
        ("A + B)", 5, "unmatched ')'"),
        ("A B", 2, "unexpected 'B'"),
        ("A + sigmoud(B)", 4, "did you mean 'sigmoid'"),
        ("A + D", 4, "unknown name 'D'"),
        ("a * 2", 0, "did you mean 'A'"),
        ("relu(A, B)", 0, "relu takes 1 argument, got 2"),
        ("A * clamp(A, 1)", 4, "clamp takes 3 arguments, got 2"),
        ("leaky_relu(A, 1, 2)", 0, "leaky_relu takes 1 to 2 arguments, got 3"),
        ("A # B", 2, "unexpected character '#'"),
        ("-A ** 2", 3, "use pow(x, y)"),
        ("A ^ 2", 2, "use pow(x, y)"),
        ("A = B", 2, "use =="),
        ("A < B < C", 6, "do not chain"),
        ("relu + A", 0, "'relu' is a function"),
        ("A + B(C)", 4, "'B' is not a function"),
        ("A * s4", 4, "scalars are s0..s3"),
        ("A * 1e39", 4, "float32 range"),
        ("A * 1.2.3", 4, "malformed number '1.2.3'"),
        ("2A", 0, "malformed number '2A'"),
        ("1 + s0", 0, "uses no input"),
    ],
)
def test_error_points_at_the_offending_token(text: str, position: int, fragment: str) -> None:
    with pytest.raises(ExpressionError) as info:
        parse(text)
    assert info.value.position == position
    assert fragment in info.value.message


def test_input_beyond_declared_arity() -> None:
    with pytest.raises(ExpressionError) as info:
        parse("A + C", arity=2)
    assert info.value.position == 4
    assert "beyond the operator's 2 input(s)" in info.value.message


def test_arity_is_inferred_or_declared(abc: tuple[torch.Tensor, ...]) -> None:
    assert parse("B + 1").arity == 2
    assert parse("A * C").arity == 3
    expr = parse("A * 2", arity=2)
    a, b = abc[0].reshape(-1, 1), abc[1][:5].reshape(1, -1)
    assert expr.arity == 2
    torch.testing.assert_close(evaluate(expr, [a, b]), (a * 2).expand(257, 5))


def test_length_limit() -> None:
    longest = "+".join("A" * (MAX_EXPR_CHARS // 2))  # a flat sum of the longest allowed length
    assert len(longest) == MAX_EXPR_CHARS - 1
    assert parse(longest + " ").arity == 1
    with pytest.raises(ExpressionError) as info:
        parse(longest + "+A")
    assert info.value.position == MAX_EXPR_CHARS


@pytest.mark.parametrize("opener,closer", [("(", ")"), ("-", ""), ("relu(", ")")])
def test_depth_limit(opener: str, closer: str) -> None:
    deepest = opener * MAX_DEPTH + "A" + closer * MAX_DEPTH
    assert parse(deepest).arity == 1
    with pytest.raises(ExpressionError) as info:
        parse(opener * (MAX_DEPTH + 1) + "A" + closer * (MAX_DEPTH + 1))
    # the opener's own '(' or '-' of the level past the limit
    assert info.value.position == len(opener) * (MAX_DEPTH + 1) - 1


def test_evaluate_upcasts_and_broadcasts() -> None:
    torch.manual_seed(1)
    a, b = torch.randn(4, 1, dtype=torch.float16), torch.randn(1, 6, dtype=torch.bfloat16)
    out = evaluate(parse("gelu(A) * B"), [a, b])
    assert out.dtype == torch.float32 and out.shape == (4, 6) and out.is_contiguous()
    torch.testing.assert_close(out, F.gelu(a.float()) * b.float())


def test_evaluate_returns_a_new_tensor() -> None:
    a = torch.randn(8)
    out = evaluate(parse("A"), [a])
    out.add_(1)
    assert not torch.equal(out, a)


def test_evaluate_rejects_wrong_operands() -> None:
    expr = parse("A * s1 + B")
    with pytest.raises(TensorSpecError, match="takes 2 input"):
        evaluate(expr, [torch.randn(3)], [1.0, 2.0])
    with pytest.raises(TensorSpecError, match="uses s1"):
        evaluate(expr, [torch.randn(3), torch.randn(3)], [1.0])


@pytest.mark.parametrize(
    "text",
    [
        "A*B+1",
        "leaky_relu(A)",
        "where(A > s0, gelu(A), leaky_relu(B, s1))",
        "-A / (B - 1e-3) * 0.044715",
        "softplus(A, 2, 5) >= hardtanh(C)",
        "clamp(A, -1.5, s3) != 0",
        "+".join("A" * (MAX_EXPR_CHARS // 2)),
    ],
)
def test_generated_cuda_compiles_in_fp32_only(text: str) -> None:
    log = nvrtc_compile(parse(text).cuda)
    assert "double precision" not in log  # every literal is a float: no fp64 instruction


def test_expression_using_every_function_compiles() -> None:
    calls = [f"{f.name}({', '.join('ABC'[: f.max_args])})" for f in FUNCTIONS.values()]
    # sinf/cosf keep an fp64 path for huge arguments, so only the compile itself is asserted here.
    nvrtc_compile(parse(" + ".join(calls)).cuda)
