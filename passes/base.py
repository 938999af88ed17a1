"""The pass contract: a frozen dataclass with a class-level `name` and its options as fields;
`apply(graphs, ctx)` rewrites the graphs (role -> GraphModule, edited in place: a partition replaces
"joint" by "forward" and "backward") and returns a PassReport. The driver (zinf_compile.pipeline)
runs passes in order and owns linting, verification, timing and dumps: passes contain none of that.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch.fx as fx

from zinf_compile.plan import Plan

Graphs = dict[str, fx.GraphModule]


@dataclass
class PassContext:
    """What passes may read besides their options: the plan being applied (and the facts its
    steps index), the number of the forward's user outputs, the offload engine's key."""

    num_fwd_outputs: int = -1
    engine_key: int = 0
    plan: Plan | None = None
    facts: Any = None  # GraphFacts of the graphs the plan was made for
    inserted: dict[int, dict[str, fx.Node]] = field(default_factory=dict)  # move group -> kind -> node

    def step_node(self, step: int) -> fx.Node:
        return self.facts.steps[step].node


@dataclass(frozen=True)
class PassReport:
    name: str
    changes: tuple[str, ...]  # one line per change, for people
    counts: dict[str, int]

    def __str__(self) -> str:
        c = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items())) or "no change"
        return f"{self.name}: {c}"


@dataclass(frozen=True)
class Pass:
    name: ClassVar[str] = "pass"

    def apply(self, graphs: Graphs, ctx: PassContext) -> PassReport:  # pragma: no cover
        raise NotImplementedError

    def report(self, changes, **counts: int) -> PassReport:
        return PassReport(self.name, tuple(changes), {k: v for k, v in counts.items() if v})
