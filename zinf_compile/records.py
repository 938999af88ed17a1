"""What each compile planned and changed, kept for inspection after compilation."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch.fx as fx

from zinf_compile.plan import Plan


@dataclass(frozen=True)
class CompileRecord:
    index: int
    plan: Plan
    reports: tuple  # PassReport per pass
    graphs: dict[str, fx.GraphModule]  # the rewritten graphs, by role
    simulated_peak: int | None  # the verifier's re-analysed peak (None when verification is off)


_lock = threading.Lock()
_records: list[CompileRecord] = []


def snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the graph as planned: Inductor goes on rewriting the original in place."""
    g = fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return fx.GraphModule(gm, g)


def add(plan: Plan, reports, graphs, simulated_peak) -> CompileRecord:
    with _lock:
        snaps = {role: snapshot(gm) for role, gm in graphs.items()}
        rec = CompileRecord(len(_records), plan, tuple(reports), snaps, simulated_peak)
        _records.append(rec)
        return rec


def compiles() -> list[CompileRecord]:
    """Every graph zinf compiled in this process, oldest first."""
    return list(_records)


def last_plans(n: int | None = None) -> list[Plan]:
    """The plans of the most recent compiles (all of them when n is None)."""
    recs = _records if n is None else _records[-n:]
    return [r.plan for r in recs]


def reset() -> None:
    with _lock:
        _records.clear()
