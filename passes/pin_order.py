"""Pin the planned order of zinf ops against Inductor's scheduler.

Inductor may reorder nodes (its peak-memory reordering sees a prefetch as an 8-byte op that can go
anywhere). Data dependencies bound a zinf op from one side only, so this pass adds the other side
as real scheduler edges with torch's control_deps (`preserve_node_ordering`), anchored on heavy
nodes (matmuls and other extern kernels, which Inductor never fuses away):

    previous heavy node  ->  zinf op  ->  next heavy node

so an offload runs right after the step that last reads its tensor and before the next matmul, a
prefetch neither starts early (holding memory) nor late (losing overlap), and a wait blocks where
the plan put it.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx
from torch.utils._ordered_set import OrderedSet

try:
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
except ImportError:  # an older torch without control_deps: the order rests on data dependencies
    preserve_node_ordering = None

from .base import Graphs, Pass, PassContext, PassReport

HEAVY = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}


def _is_zinf(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "namespace", None) == "zinf"


@dataclass(frozen=True)
class PinOrder(Pass):
    name: ClassVar[str] = "pin-order"

    def apply(self, graphs: Graphs, ctx: PassContext) -> Any:
        return self.pin(next(iter(graphs.values())).graph)

    def pin(self, graph: fx.Graph) -> PassReport:
        """Pin one graph (Inductor's post-grad hook hands over an fx.Graph)."""
        nodes = list(graph.nodes)
        if not any(_is_zinf(n) for n in nodes):
            return PassReport(self.name, (), {})
        if preserve_node_ordering is None:
            warnings.warn("zinf: this torch has no control_deps; Inductor may move zinf ops away from "
                          "where the plan put them (memory and overlap can then differ from the plan)")
            return PassReport(self.name, ("control_deps unavailable: order not pinned",), {})
        deps: dict[fx.Node, OrderedSet[fx.Node]] = {}
        last_heavy = None
        pending: list[fx.Node] = []  # zinf ops waiting for the next heavy node
        for n in nodes:
            if _is_zinf(n):
                if last_heavy is not None and last_heavy not in n.all_input_nodes:
                    deps.setdefault(n, OrderedSet()).add(last_heavy)
                pending.append(n)
            elif n.op == "call_function" and n.target in HEAVY:
                if pending:
                    deps.setdefault(n, OrderedSet()).update(p for p in pending if p not in n.all_input_nodes)
                    if not deps[n]:
                        del deps[n]
                    pending = []
                last_heavy = n
        edges = sum(len(v) for v in deps.values())
        preserve_node_ordering(graph, deps)
        changes = tuple(f"{d.name} after {', '.join(x.name for x in v)}" for d, v in deps.items())
        return PassReport(self.name, changes, {"edges": edges} if edges else {})
