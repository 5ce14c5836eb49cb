"""Operator expressions: elementwise operators written as formulas over the inputs A, B, C.

Grammar, loosest binding first (binary operators are left-associative; comparisons do not chain):

    comparison     := additive [('<' | '<=' | '>' | '>=' | '==' | '!=') additive]   -> 1.0 or 0.0
    additive       := multiplicative (('+' | '-') multiplicative)*
    multiplicative := unary (('*' | '/') unary)*
    unary          := ('-' | '+') unary | atom
    atom           := number | A | B | C | s0..s3 | name '(' [comparison (',' comparison)*] ')'
                    | '(' comparison ')'

`s0..s3` are the task's `scalars[0..3]`; `name` is a function of gpuos_core.mathlib
(`where(c, x, y)` among them). One parse tree yields the canonical text (the cache key), the CUDA
expression and the torch reference, so the three cannot disagree about what was parsed. Everything
computes in fp32.
"""

from __future__ import annotations

import difflib
import math
import operator
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from gpuos_core.abi import MAX_SCALARS
from gpuos_core.errors import ExpressionError, TensorSpecError
from gpuos_core.mathlib import FUNCTIONS

MAX_EXPR_CHARS = 1024
MAX_DEPTH = 64  # nesting of parentheses, calls and unary operators
INPUTS = "ABC"  # in[0..2] of a task (the ABI's fourth input is for index tensors)

_ARITH: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
}
_COMPARE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
}
_SCALAR_NAME = re.compile(r"s(0|[1-9][0-9]*)")
_VARIABLES = (*INPUTS, *(f"s{k}" for k in range(MAX_SCALARS)))
T = TypeVar("T")


def _f32(value: float) -> float:
    """`value` rounded to the nearest float32, as a python float; OverflowError past float32's
    range."""
    return struct.unpack("f", struct.pack("f", value))[0]


@dataclass(frozen=True)
class _Env:
    """What the torch reference reads: float32 inputs and 0-dim float32 scalars on one device."""

    inputs: tuple[torch.Tensor, ...]
    scalars: tuple[torch.Tensor, ...]
    device: torch.device


# The parse tree. Each node prints itself canonically (fully parenthesised) and as CUDA C, and
# evaluates itself with torch.
@dataclass(frozen=True)
class Num:
    value: float  # as written; rounded to float32 where it is computed with

    def canonical(self) -> str:
        return repr(self.value)

    def cuda(self) -> str:
        return f"{_f32(self.value)!r}f"  # the shortest text that reads back as this float32

    def torch(self, env: _Env) -> torch.Tensor:
        return torch.tensor(self.value, dtype=torch.float32, device=env.device)


@dataclass(frozen=True)
class Input:
    index: int  # 0 for A

    def canonical(self) -> str:
        return INPUTS[self.index]

    def cuda(self) -> str:
        return f"a[{self.index}]"

    def torch(self, env: _Env) -> torch.Tensor:
        return env.inputs[self.index]


@dataclass(frozen=True)
class Scalar:
    index: int  # k of s<k>

    def canonical(self) -> str:
        return f"s{self.index}"

    def cuda(self) -> str:
        return f"s[{self.index}]"

    def torch(self, env: _Env) -> torch.Tensor:
        return env.scalars[self.index]


@dataclass(frozen=True)
class Neg:
    operand: Node

    def canonical(self) -> str:
        return f"(-{self.operand.canonical()})"

    def cuda(self) -> str:
        return f"(-{self.operand.cuda()})"

    def torch(self, env: _Env) -> torch.Tensor:
        return -self.operand.torch(env)


@dataclass(frozen=True)
class BinOp:
    op: str  # + - * /
    left: Node
    right: Node

    def canonical(self) -> str:
        return f"({self.left.canonical()} {self.op} {self.right.canonical()})"

    def cuda(self) -> str:
        return f"({self.left.cuda()} {self.op} {self.right.cuda()})"

    def torch(self, env: _Env) -> torch.Tensor:
        return _ARITH[self.op](self.left.torch(env), self.right.torch(env))


@dataclass(frozen=True)
class Compare:
    op: str  # < <= > >= == !=
    left: Node
    right: Node

    def canonical(self) -> str:
        return f"({self.left.canonical()} {self.op} {self.right.canonical()})"

    def cuda(self) -> str:
        return f"(({self.left.cuda()} {self.op} {self.right.cuda()}) ? 1.0f : 0.0f)"

    def torch(self, env: _Env) -> torch.Tensor:
        return _COMPARE[self.op](self.left.torch(env), self.right.torch(env)).float()


@dataclass(frozen=True)
class Call:
    fn: str  # a key of mathlib.FUNCTIONS
    args: tuple[Node, ...]  # all of its arguments: the parser fills in defaults

    def canonical(self) -> str:
        return f"{self.fn}({', '.join(a.canonical() for a in self.args)})"

    def cuda(self) -> str:
        return f"{FUNCTIONS[self.fn].cuda}({', '.join(a.cuda() for a in self.args)})"

    def torch(self, env: _Env) -> torch.Tensor:
        return FUNCTIONS[self.fn].torch(*(a.torch(env) for a in self.args))


Node = Num | Input | Scalar | Neg | BinOp | Compare | Call


@dataclass(frozen=True)
class Expr:
    """A parsed, validated expression."""

    text: str  # as given
    canonical: str  # fully parenthesised, numbers as repr(float), defaults filled in: cache key
    arity: int  # tensor inputs: the declared arity, else 1 + the highest letter used (A=1)
    num_scalars: int  # 1 + the highest s<k> used, else 0
    cuda: str  # C expression over `const float* a` (inputs) and `const float* s` (scalars)
    # calling the gpuos_* functions of cuda/ops/math.cuh; fp32 only
    tree: Node = field(repr=False, compare=False)


@dataclass(frozen=True)
class _Token:
    kind: str  # "number", "name", "end", or the operator itself ("+", "<=", "(", ...)
    text: str
    pos: int  # offset in the expression

    def describe(self) -> str:
        return "end of expression" if self.kind == "end" else repr(self.text)


_TOKEN = re.compile(
    r"(?P<space>\s+)|(?P<number>(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<power>\*\*)"
    r"|(?P<op><=|>=|==|!=|[-+*/<>(),])"
)
_HINTS = {
    "^": ": use pow(x, y) for powers",
    "=": ": use == to compare",
    "&": ": use * for 'and'",
    "|": ": use max(x, y) for 'or'",
    "!": ": use == 0 for 'not'",
}


def _tokenize(text: str) -> list[_Token]:
    """The tokens of `text`, ending with an "end" token; ExpressionError at the first bad
    character."""
    tokens, pos = [], 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ExpressionError(
                f"unexpected character {text[pos]!r}{_HINTS.get(text[pos], '')}", text, pos
            )
        _check_token(match, text)
        if match.lastgroup != "space":
            kind = match.lastgroup if match.lastgroup in ("number", "name") else match.group()
            tokens.append(_Token(kind, match.group(), pos))
        pos = match.end()
    return [*tokens, _Token("end", "", len(text))]


def _check_token(match: re.Match[str], text: str) -> None:
    """Rejects `**` and numbers run together with letters, digits or dots ("1e", "1.2.3", "2A")."""
    if match.lastgroup == "power":
        raise ExpressionError("'**' is not supported: use pow(x, y)", text, match.start())
    end = match.end()
    if match.lastgroup == "number" and re.match(r"[A-Za-z0-9_.]", text[end : end + 1]):
        bad = re.split(r"[^A-Za-z0-9_.]", text[match.start() :], maxsplit=1)[0]
        raise ExpressionError(f"malformed number {bad!r}", text, match.start())


def _unknown(name: str) -> str:
    """The message for an unknown name, with the closest known names (any case) as suggestions."""
    known = {k.lower(): k for k in (*_VARIABLES, *FUNCTIONS)}
    close = [known[k] for k in difflib.get_close_matches(name.lower(), known, n=3, cutoff=0.6)]
    if close:
        return f"unknown name {name!r}; did you mean {' or '.join(map(repr, close))}?"
    return (
        f"unknown name {name!r}: inputs are {', '.join(INPUTS)}, "
        f"scalars s0..s{MAX_SCALARS - 1}, functions {', '.join(sorted(FUNCTIONS))}"
    )


class _Parser:
    """Recursive descent over the tokens of one expression; one method per grammar rule."""

    def __init__(self, text: str, arity: int | None) -> None:
        self.text, self.arity = text, arity
        self.tokens, self.index, self.depth = _tokenize(text), 0, 0
        self.num_inputs, self.num_scalars = 0, 0  # 1 + the highest index used

    def peek(self) -> _Token:
        return self.tokens[self.index]

    def take(self) -> _Token:
        token = self.tokens[self.index]
        if token.kind != "end":  # the end token stays, so every error has a token to point at
            self.index += 1
        return token

    def error(self, message: str, token: _Token) -> ExpressionError:
        return ExpressionError(message, self.text, token.pos)

    def nested(self, opener: _Token, rule: Callable[[], T]) -> T:
        """Runs `rule` one nesting level deeper; `opener` is the token that opened the level."""
        if self.depth == MAX_DEPTH:
            raise self.error(
                f"expression nests deeper than {MAX_DEPTH} levels "
                "(parentheses, calls and unary operators)",
                opener,
            )
        self.depth += 1
        node = rule()
        self.depth -= 1
        return node

    def expression(self) -> Node:
        """The whole expression: a comparison followed by the end."""
        node = self.comparison()
        token = self.peek()
        if token.kind == ")":
            raise self.error("unmatched ')'", token)
        if token.kind != "end":
            raise self.error(f"unexpected {token.describe()}: expected an operator", token)
        return node

    def comparison(self) -> Node:
        left = self.additive()
        if self.peek().kind not in _COMPARE:
            return left
        op = self.take().kind
        node = Compare(op, left, self.additive())
        if self.peek().kind in _COMPARE:
            raise self.error(
                "comparisons do not chain: combine them with * or where(c, x, y)", self.peek()
            )
        return node

    def additive(self) -> Node:
        node = self.multiplicative()
        while self.peek().kind in ("+", "-"):
            node = BinOp(self.take().kind, node, self.multiplicative())
        return node

    def multiplicative(self) -> Node:
        node = self.unary()
        while self.peek().kind in ("*", "/"):
            node = BinOp(self.take().kind, node, self.unary())
        return node

    def unary(self) -> Node:
        sign = self.peek()
        if sign.kind not in ("+", "-"):
            return self.atom()
        self.take()
        operand = self.nested(sign, self.unary)
        if sign.kind == "+":
            return operand
        # A negative literal is one number, so "-1" and a default of -1.0 are the same tree.
        return Num(-operand.value) if isinstance(operand, Num) else Neg(operand)

    def atom(self) -> Node:
        token = self.take()
        if token.kind == "number":
            return self.number(token)
        if token.kind == "name":
            return self.call(token) if self.peek().kind == "(" else self.variable(token)
        if token.kind == "(":
            node = self.nested(token, self.comparison)
            self.close(token, "')'")
            return node
        raise self.error(f"expected an operand, found {token.describe()}", token)

    def close(self, opener: _Token, expected: str) -> None:
        """Consumes the ')' matching `opener`."""
        token = self.take()
        if token.kind == "end":
            raise self.error("unclosed '('", opener)
        if token.kind != ")":
            raise self.error(f"expected {expected}, found {token.describe()}", token)

    def number(self, token: _Token) -> Num:
        value = float(token.text)
        try:
            finite = math.isfinite(_f32(value))
        except OverflowError:
            finite = False
        if not finite:
            raise self.error(f"number {token.text} is outside the float32 range (±3.4e38)", token)
        return Num(value)

    def variable(self, token: _Token) -> Node:
        name = token.text
        if name in FUNCTIONS:
            raise self.error(f"{name!r} is a function: call it as {name}(...)", token)
        if name in INPUTS:
            return self.input(token)
        if _SCALAR_NAME.fullmatch(name):
            return self.scalar(token)
        raise self.error(_unknown(name), token)

    def input(self, token: _Token) -> Input:
        index = INPUTS.index(token.text)
        if self.arity is not None and index >= self.arity:
            raise self.error(
                f"input {token.text!r} is beyond the operator's {self.arity} input(s) "
                f"({', '.join(INPUTS[: self.arity])})",
                token,
            )
        self.num_inputs = max(self.num_inputs, index + 1)
        return Input(index)

    def scalar(self, token: _Token) -> Scalar:
        index = int(token.text[1:])
        if index >= MAX_SCALARS:
            raise self.error(
                f"there is no scalar {token.text!r}: scalars are s0..s{MAX_SCALARS - 1}", token
            )
        self.num_scalars = max(self.num_scalars, index + 1)
        return Scalar(index)

    def call(self, name: _Token) -> Call:
        fn = FUNCTIONS.get(name.text)
        if fn is None:
            known = name.text in _VARIABLES
            raise self.error(
                f"{name.text!r} is not a function" if known else _unknown(name.text), name
            )
        opener = self.take()
        args = self.nested(opener, self.arguments)
        self.close(opener, "',' or ')'")
        if not fn.min_args <= len(args) <= fn.max_args:
            raise self.error(
                f"{fn.name} takes {_count(fn.min_args, fn.max_args)}, got {len(args)}", name
            )
        missing = fn.defaults[len(args) - fn.min_args :]
        return Call(fn.name, (*args, *(Num(d) for d in missing)))

    def arguments(self) -> list[Node]:
        """Comma-separated arguments up to (not including) the closing ')'."""
        if self.peek().kind == ")":
            return []
        args = [self.comparison()]
        while self.peek().kind == ",":
            self.take()
            args.append(self.comparison())
        return args


def _count(low: int, high: int) -> str:
    """'1 argument', '2 arguments' or '1 to 3 arguments'."""
    if low == high:
        return f"{low} argument{'s' * (low != 1)}"
    return f"{low} to {high} arguments"


def parse(text: str, arity: int | None = None) -> Expr:
    """Parses and validates `text`. With `arity` (1..3), letters beyond it are an error and the Expr
    has that arity even if it uses fewer inputs; without it the arity is inferred from the letters.
    Raises ExpressionError pointing at the offending token."""
    if arity is not None and not 1 <= arity <= len(INPUTS):
        raise ExpressionError(
            f"the declared arity must be 1 to {len(INPUTS)}, got {arity}", text, 0
        )
    if len(text) > MAX_EXPR_CHARS:
        raise ExpressionError(
            f"expression is {len(text)} characters long; the limit is {MAX_EXPR_CHARS}",
            text,
            MAX_EXPR_CHARS,
        )
    if not text.strip():
        raise ExpressionError("empty expression: write a formula over the inputs A, B, C", text, 0)
    parser = _Parser(text, arity)
    tree = parser.expression()
    if parser.num_inputs == 0:
        raise ExpressionError("the expression uses no input: use at least one of A, B, C", text, 0)
    return Expr(
        text, tree.canonical(), arity or parser.num_inputs, parser.num_scalars, tree.cuda(), tree
    )


def evaluate(
    expr: Expr, inputs: Sequence[torch.Tensor], scalars: Sequence[float] = ()
) -> torch.Tensor:
    """The torch reference of `expr`: inputs are upcast to float32 and broadcast together, scalars
    rounded to float32. Returns a new contiguous float32 tensor of the inputs' broadcast shape (the
    caller casts). Raises TensorSpecError for a wrong number of inputs or too few scalars."""
    if len(inputs) != expr.arity:
        raise TensorSpecError(
            f"expression {expr.text!r} takes {expr.arity} input(s), got {len(inputs)}"
        )
    if len(scalars) < expr.num_scalars:
        raise TensorSpecError(
            f"expression {expr.text!r} uses s{expr.num_scalars - 1}, got {len(scalars)} scalar(s)"
        )
    device = inputs[0].device
    env = _Env(
        tuple(t.float() for t in inputs),
        tuple(torch.tensor(float(s), dtype=torch.float32, device=device) for s in scalars),
        device,
    )
    shape = torch.broadcast_shapes(*(t.shape for t in inputs))
    return expr.tree.torch(env).expand(shape).clone(memory_format=torch.contiguous_format)
