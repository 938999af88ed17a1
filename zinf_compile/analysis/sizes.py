"""Tensor sizes as sympy expressions, with integer hints for decisions that must add no guards."""
from __future__ import annotations

import sympy
import torch

FALLBACK_HINT = 8192  # an unbacked size with no hint: plan as if it were this large


def expr_of(x) -> sympy.Expr:
    """The sympy expression of an int or SymInt, without guarding on it."""
    if isinstance(x, torch.SymInt):
        return x.node.expr
    return sympy.Integer(int(x))


def hint_of(x) -> int:
    """A concrete value for x, read from the shape env's hints; never adds a guard."""
    if type(x) is int:  # the common case, first
        return x
    if isinstance(x, torch.SymInt):
        node = x.node
        if node.hint is not None:
            return int(node.hint)
        try:
            return int(node.shape_env.size_hint(node.expr, allow_none=False))
        except Exception:  # unbacked and no hint: plan for a large value, say so in the plan
            return FALLBACK_HINT
    return int(x)


def storage_nbytes(val: torch.Tensor) -> tuple[int, sympy.Expr]:
    """Bytes of the storage behind `val` (shared by all its views): (hint, expression)."""
    n = val.untyped_storage().nbytes()
    return hint_of(n), expr_of(n)


def tensor_nbytes(val: torch.Tensor) -> int:
    return hint_of(val.numel()) * val.element_size()


def shape_str(val: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) if isinstance(s, int) else str(expr_of(s)) for s in val.shape) + "]"


def dense_dim_order(val: torch.Tensor) -> list[int] | None:
    """The permutation whose contiguous layout gives val's strides, or None when val is not
    non-overlapping and dense (then it cannot be stored and re-created as one block).

    Decided on the size hints with plain integers: torch's own density check guards on symbolic
    sizes, and a memory plan must not add guards (nor recompiles) to the graph it plans."""
    sizes = [hint_of(s) for s in val.shape]
    strides = [hint_of(s) for s in val.stride()]
    # outermost first. Any order reproduces the data (offload permutes, wait permutes back);
    # the one matching the strides makes the offload copy-free.
    order = sorted(range(val.dim()), key=lambda d: (-strides[d], d))
    expected = 1
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != expected:
            return None
        expected *= sizes[d]
    return order
