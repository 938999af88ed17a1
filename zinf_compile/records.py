"""What each compile planned and changed, kept for inspection after compilation.

A record made by a real compile lives as long as the compiled function it belongs to (the backend
hands it to that function's token, `hold`): `torch._dynamo.reset()` or the model's code going away
frees its plan and graph snapshots. Records nobody holds (offline plans, dumps) stay until `reset()`."""
from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass

import torch.fx as fx

from zinf_compile.plan import Plan


@dataclass(frozen=True)
class CompileRecord:
    index: int
    plan: Plan
    reports: list  # PassReport per pass, in order (pin-order's arrive when Inductor compiles a graph)
    graphs: dict[str, fx.GraphModule]  # the rewritten graphs, by role
    simulated_peak: int | None  # the verifier's re-analysed peak (None when verification is off)


_lock = threading.Lock()
_records: list = []  # CompileRecord, or a weakref to one that a compiled function holds
_ids = itertools.count()  # never reset: a graph planned before reset() must not find a newer record
RECORD = "zinf_record"  # output-node meta of a planned graph: its record's index (survives copies)


def snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the graph as planned: Inductor goes on rewriting the original in place."""
    g = fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return fx.GraphModule(gm, g)


def add(plan: Plan, reports, graphs, simulated_peak) -> CompileRecord:
    with _lock:
        snaps = {role: snapshot(gm) for role, gm in graphs.items()}
        rec = CompileRecord(next(_ids), plan, list(reports), snaps, simulated_peak)
        _records.append(rec)
        for gm in graphs.values():
            next(iter(gm.graph.find_nodes(op="output"))).meta[RECORD] = rec.index
        return rec


def attach(graph: fx.Graph, report) -> None:
    """Add a later pass's report (run by Inductor on a graph we planned) to that graph's record."""
    index = next(iter(graph.find_nodes(op="output"))).meta.get(RECORD)
    with _lock:
        rec = next((r for r in reversed(_live()) if r.index == index), None)
        if rec is not None and report.counts:
            rec.reports.append(report)


def hold(rec: CompileRecord, owner) -> None:
    """`owner` (a compiled function's token) keeps `rec` alive; the list here only points at it."""
    owner.records = (*getattr(owner, "records", ()), rec)
    with _lock:
        for i, r in enumerate(_records):
            if r is rec:
                _records[i] = weakref.ref(rec)


def _live() -> list[CompileRecord]:
    """The records still alive, oldest first; forgets the dead (call with _lock held)."""
    out, keep = [], []
    for r in _records:
        rec = r() if isinstance(r, weakref.ref) else r
        if rec is not None:
            out.append(rec)
            keep.append(r)
    _records[:] = keep
    return out


def compiles() -> list[CompileRecord]:
    """Every graph zinf compiled in this process whose compiled function is alive, oldest first."""
    with _lock:
        return _live()


def last_plans(n: int | None = None) -> list[Plan]:
    """The plans of the most recent compiles (all of them when n is None)."""
    recs = compiles()
    return [r.plan for r in (recs if n is None else recs[-n:])]


def reset() -> None:
    with _lock:
        _records.clear()
