"""What every pass shares: the context it works on and the report it returns."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from zinf_compile.analysis.facts import GraphFacts
from zinf_compile.plan import Plan


@dataclass
class PassContext:
    """The graphs being rewritten (by role), the facts they were analysed into, the plan."""

    graphs: dict[str, fx.GraphModule]
    facts: GraphFacts
    plan: Plan
    engine_key: int
    inserted: dict[int, dict[str, fx.Node]] = field(default_factory=dict)  # group -> kind -> node

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
