"""Expression fusion for the scheduler: elementwise nodes inlined into their consumers.

At a flush each elementwise node gets a `Form`, an expression over tensor leaves and scalar
parameters. A consumer inlines its producers' forms as long as the result fits one task (at most
3 tensor inputs, an expression the parser takes; scalars past the task's 4 become constants), so
a node needs a task of its own only if its result is still referenced, a row or reduce op reads
it, or a consumer could not inline it (`needed`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .abi import MAX_SCALARS
from .catalogue import CATALOGUE
from .expr import INPUTS, MAX_EXPR_CHARS, BinOp, Call, Input, Neg, Node as ExprNode, Num, Scalar
from .lowering import Build
from .pending import Node, Operand

MAX_PAREN_DEPTH = 28  # canonical parentheses; the parser also counts calls and unary minus
# Catalogue operators by (canonical expression, arity): a fused chain that spells one uses it.
CATALOGUE_BY_TEXT: dict[tuple[str, int], str] = {
    (spec.expression.canonical, spec.arity): name
    for name, spec in CATALOGUE.items()
    if spec.expression is not None
}


@dataclass(frozen=True)
class Form:
    """An elementwise node as an expression over tensor leaves and scalar parameters."""

    tree: ExprNode
    leaves: tuple[torch.Tensor | Node, ...]  # Input(k) reads leaves[k]
    scalars: tuple[float, ...]  # Scalar(k) reads scalars[k]
    inlined: frozenset[int] = frozenset()  # ids of nodes computed inside this form


def forms_of(nodes: Sequence[Node], fuse: bool) -> dict[int, Form]:
    """Expression forms of the elementwise nodes, by id, in queue order (producers first). With
    `fuse`, a node's form inlines its elementwise producers' forms wherever the result fits."""
    found: dict[int, Form] = {}
    for n in nodes:
        if n.build is None:
            continue
        parts = [_part(x, found, fuse) for x in n.operands]
        form = _combine(parts, n.build)
        while not _fits(form):  # materialise the widest inlined producer instead
            k, widest = max(
                (
                    (i, x)
                    for i, x in enumerate(n.operands)
                    if isinstance(x, Node) and parts[i].leaves != (x,)
                ),
                key=lambda ix: len(parts[ix[0]].leaves),
            )
            parts[k] = Form(Input(0), (widest,), ())
            form = _combine(parts, n.build)
        found[id(n)] = form
    return found


def _part(x: Operand, found: dict[int, Form], fuse: bool) -> Form:
    """The form an operand contributes: its producer's form (inlined), a scalar or a leaf."""
    if isinstance(x, Node) and fuse and id(x) in found:
        f = found[id(x)]
        return Form(f.tree, f.leaves, f.scalars, f.inlined | {id(x)})
    if isinstance(x, float):
        return Form(Scalar(0), (), (x,))
    return Form(Input(0), (x,), ())


def needed(nodes: Sequence[Node], forms: dict[int, Form]) -> list[Node]:
    """Nodes that must be written: live results and what those read, in queue order."""
    need: set[int] = set()
    for n in reversed(nodes):
        if n.alive() or id(n) in need:
            need.add(id(n))
            need.update(id(d) for d in _deps(n, forms))
    return [n for n in nodes if id(n) in need]


def inputs_of(n: Node, form: Form | None) -> tuple[Operand, ...]:
    """What node `n`'s task reads, in its task's input order: the leaves of its form
    (elementwise nodes), else its operands (a row or reduce node's one tensor or node)."""
    return form.leaves if form is not None else n.operands


def _deps(n: Node, forms: dict[int, Form]) -> list[Node]:
    return [x for x in inputs_of(n, forms.get(id(n))) if isinstance(x, Node)]


def _rewrite(tree: ExprNode, leaf: Callable[[ExprNode], ExprNode]) -> ExprNode:
    """`tree` with every leaf (input, scalar, number) replaced by `leaf(it)`."""
    if isinstance(tree, Neg):
        return Neg(_rewrite(tree.operand, leaf))
    if isinstance(tree, BinOp):
        return BinOp(tree.op, _rewrite(tree.left, leaf), _rewrite(tree.right, leaf))
    if isinstance(tree, Call):
        return Call(tree.fn, tuple(_rewrite(a, leaf) for a in tree.args))
    return leaf(tree)


def _remap(tree: ExprNode, inputs: Sequence[int], scalars: Sequence[int]) -> ExprNode:
    """`tree` with Input(k) → Input(inputs[k]) and Scalar(k) → Scalar(scalars[k])."""
    return _rewrite(
        tree,
        lambda n: (
            Input(inputs[n.index])
            if isinstance(n, Input)
            else Scalar(scalars[n.index])
            if isinstance(n, Scalar)
            else n
        ),
    )


def constants(tree: ExprNode, scalars: Sequence[float]) -> ExprNode:
    """Scalars past the task's MAX_SCALARS become constants of the expression."""
    if len(scalars) <= MAX_SCALARS:  # Scalar(k) reads scalars[k]: none is past them
        return tree
    return _rewrite(
        tree,
        lambda n: (
            Num(float(scalars[n.index])) if isinstance(n, Scalar) and n.index >= MAX_SCALARS else n
        ),
    )


def _combine(parts: Sequence[Form], build: Build) -> Form:
    """`build` applied to the parts; leaves (by identity) and scalars deduplicated."""
    leaves: list[Any] = []
    scalars: list[float] = []
    trees = []
    for part in parts:
        lmap = [_index_of(leaves, leaf) for leaf in part.leaves]
        smap = [_index_eq(scalars, s) for s in part.scalars]
        # The first part (in a chain, the producer's whole form) usually maps onto itself:
        # rewriting it anyway copied the whole chain again for every op.
        same = lmap == list(range(len(lmap))) and smap == list(range(len(smap)))
        trees.append(part.tree if same else _remap(part.tree, lmap, smap))
    inlined = frozenset().union(*(p.inlined for p in parts))
    return Form(build(trees), tuple(leaves), tuple(scalars), inlined)


def _index_of(items: list[Any], item: Any) -> int:
    for i, x in enumerate(items):
        if x is item:
            return i
    items.append(item)
    return len(items) - 1


def _index_eq(items: list[float], value: float) -> int:
    if value in items:
        return items.index(value)
    items.append(value)
    return len(items) - 1


def _fits(form: Form) -> bool:
    """Whether the form can be one task: few enough inputs, text and nesting the parser takes."""
    if len(form.leaves) > len(INPUTS):
        return False
    text = constants(form.tree, form.scalars).canonical()
    if len(text) > MAX_EXPR_CHARS - 64:
        return False
    if text.count("(") <= MAX_PAREN_DEPTH:  # no deeper than its parentheses: no scan needed
        return True
    depth = best = 0
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        best = max(best, depth)
    return best <= MAX_PAREN_DEPTH
