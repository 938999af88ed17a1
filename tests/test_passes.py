"""Golden checks of a plan, and the passes on captured graphs (no Inductor: fast)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from zinf_compile.capture import capture
from zinf_compile.cost import BUILTIN
from zinf_compile import ir
from zinf_compile.passes import InsertOffloads, PassContext, PinOrder, Recompute, check_invariants, verify
from zinf_compile.pipeline import plan_graphs

from gpt import build as build_gpt

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "gpt_plan.json")
GPT_TINY = dict(batch=4, seq=32, layers=2, hidden=64, heads=2, vocab=128)
BUDGET = int(1.5 * 2**20)  # unplanned peak 1.71 MiB, lower bound 1.33 MiB


@pytest.fixture(scope="module")
def gpt_graphs():
    return capture(build_gpt, GPT_TINY)


def planned(gpt_graphs):
    graphs, nfo = gpt_graphs
    return plan_graphs(graphs, nfo, BUDGET, BUILTIN["cpu"], "nvme")


def test_golden_gpt_plan(gpt_graphs):
    """The plan of a tiny examples/gpt.py under 1.5 MiB, action by action. A change here is a change in
    the planner's decisions: look at it, then regenerate with ZINF_UPDATE_GOLDEN=1."""
    facts, plan = planned(gpt_graphs)
    names = {t.id: t.name for t in plan.tensors}
    got = {
        "peak_before": plan.peak_before, "peak_after": plan.peak_after, "lower_bound": plan.lower_bound,
        "actions": [[a.kind, names[a.tensor], a.step, plan.steps[a.step].name, a.nbytes] for a in plan.actions],
    }
    if os.environ.get("ZINF_UPDATE_GOLDEN"):
        with open(GOLDEN, "w") as f:
            json.dump(got, f, indent=1)
    with open(GOLDEN) as f:
        assert got == json.load(f)


def test_passes_rewrite_verify_and_pin(gpt_graphs):
    import copy

    graphs, nfo = gpt_graphs
    graphs = {k: copy.deepcopy(v) for k, v in graphs.items()}
    facts, plan = plan_graphs(graphs, nfo, BUDGET, BUILTIN["cpu"], "nvme")
    ctx = PassContext(num_fwd_outputs=nfo, engine_key=1, plan=plan, facts=facts)
    check_invariants(graphs, ctx, Recompute().apply(graphs, ctx).name)  # the plan rebuilds gelu's output
    report = InsertOffloads().apply(graphs, ctx)
    n = plan.action_counts()["offload"]
    assert report.counts == {"offload": n, "prefetch": n, "wait": n}
    assert verify(ctx, nfo, report.name, graphs) <= BUDGET
    fw_out = next(iter(graphs["forward"].graph.find_nodes(op="output")))
    saved_handles = [a for a in fw_out.args[0] if getattr(a, "target", None) == torch.ops.zinf.offload.default]
    # the forward returns handles in place of the offloaded tensors: one per offload, in place of
    # every alias of its storage the forward saved (q, k, v of one projection: several outputs)
    assert len(set(saved_handles)) == n and len(saved_handles) >= n

    from torch._inductor.fx_passes.control_dependencies import control_deps

    for role in ("forward", "backward"):
        g = graphs[role].graph
        pin = PinOrder().pin(g)
        wrapped = [nd for nd in g.nodes if nd.target is control_deps]
        assert pin.counts["edges"] >= len(wrapped) > 0
        for nd in wrapped:  # every added edge points at a node that stands earlier in the graph
            order = {x: i for i, x in enumerate(g.nodes)}
            assert all(order[d] < order[nd] for d in nd.args[0])


def rewritten(gpt_graphs, budget=BUDGET):
    import copy

    graphs, nfo = gpt_graphs
    graphs = {k: copy.deepcopy(v) for k, v in graphs.items()}
    facts, plan = plan_graphs(graphs, nfo, budget, BUILTIN["cpu"], "nvme")
    ctx = PassContext(num_fwd_outputs=nfo, engine_key=1, plan=plan, facts=facts)
    Recompute().apply(graphs, ctx)
    InsertOffloads().apply(graphs, ctx)
    return ctx, nfo, graphs


def test_inserted_ops_stand_where_the_plan_anchors_them(gpt_graphs):
    """offload right after its step's node, prefetch and wait right before theirs (apart from
    other zinf ops anchored at the same place)."""
    ctx, _, _ = rewritten(gpt_graphs)
    zinf_ops = (torch.ops.zinf.offload.default, torch.ops.zinf.prefetch.default, torch.ops.zinf.wait.default)
    for a in ctx.plan.moves():
        node = ctx.inserted[a.group][a.kind]
        anchor = ctx.step_node(a.step)
        step = node.prev if a.kind == "offload" else node.next
        views = torch.ops.aten.as_strided.default  # a wait's rebuilt views follow it
        while step.target in zinf_ops or step.target is views or isinstance(ir.meta(step), ir.RecomputeMeta):
            # skip neighbours inserted at the same anchor (a recompute's chain: waits stand before it)
            step = step.prev if a.kind == "offload" else step.next
        assert step is anchor, (a, node.name, anchor.name, step.name)


def test_simulated_peak_of_the_rewritten_graphs_is_the_plans(gpt_graphs):
    ctx, nfo, graphs = rewritten(gpt_graphs)
    assert verify(ctx, nfo, "insert-offloads", graphs) == ctx.plan.peak_after


@pytest.mark.parametrize("corrupt,message", [
    ("late_reader", "after its offload"),
    ("wait_first", "stands before its prefetch"),
    ("budget", "over the budget"),
    ("saved_handle", "not one prefetch"),
])
def test_verifier_rejects_broken_rewrites(gpt_graphs, corrupt, message):
    """Each invariant, broken by hand, is caught and named."""
    import dataclasses

    from zinf_compile.passes import VerificationError

    ctx, nfo, graphs = rewritten(gpt_graphs)
    group, nodes = next(iter(ctx.inserted.items()))
    off, pre, wait = nodes["offload"], nodes["prefetch"], nodes["wait"]
    if corrupt == "late_reader":  # something reads the offloaded tensor after the offload
        src = off.args[0]
        with off.graph.inserting_after(off):
            off.graph.call_function(torch.ops.aten.clone.default, (src,))
    elif corrupt == "wait_first":
        pre.prepend(wait)
    elif corrupt == "budget":
        ctx.plan = dataclasses.replace(ctx.plan, budget=ctx.plan.peak_after - 1)
    else:  # the backward receives the handle but never prefetches it
        saved = [u for u in off.users if u.op == "output"]
        assert saved, "the first group should be a saved activation"
        bw = graphs["backward"].graph
        ph = next(p for p in bw.find_nodes(op="placeholder")
                  if isinstance(ir.meta(p), ir.MoveMeta) and ir.meta(p).group == group)
        with bw.inserting_after(ph):
            bw.call_function(torch.ops.aten.clone.default, (ph,))
    with pytest.raises(VerificationError, match=message):
        verify(ctx, nfo, "corrupted", graphs)


def test_stall_prediction_against_hand_computed_cases(gpt_graphs):
    """Just-in-time reads on a slow disk stall for every byte; early reads on a fast disk do not."""
    from dataclasses import replace

    from zinf_compile.planner import simulate

    facts, plan = planned(gpt_graphs)
    gaps = {(g.buffer, g.after, g.before): g for g in (*facts.gaps, *facts.rebuild_gaps)}
    groups: dict = {}
    for a in plan.moves():
        groups.setdefault(a.group, {})[a.kind] = a
    chosen = [gaps[(g["offload"].tensor, g["offload"].step, g["wait"].step)] for g in groups.values()]
    nbytes = {b.id: b.nbytes for b in facts.buffers}
    slow = replace(BUILTIN["cpu"], nvme_read_bw=1e6, nvme_write_bw=2e6)
    compute, stall = simulate(facts, chosen, [g.before for g in chosen], nbytes, slow, "nvme")
    moved = sum(nbytes[g.buffer] for g in chosen)
    assert compute == pytest.approx(sum(s.est_time_s for s in facts.steps))
    assert stall == pytest.approx(moved / 1e6 + moved / 2e6)  # every read and write waited for
    fast = replace(BUILTIN["cpu"], nvme_read_bw=1e15, nvme_write_bw=1e15)
    _, stall = simulate(facts, chosen, [g.after + 1 for g in chosen], nbytes, fast, "nvme")
    assert stall < 1e-6
    rebuilt = {(r.buffer, r.before): r.est_time_s for r in facts.recomputes}  # their chains are compute too
    more = sum(rebuilt[(a.tensor, a.step)] for a in plan.recomputes())
    assert plan.predicted_stall_s > 0 and plan.predicted_compute_s == pytest.approx(compute + more)


# -- the parameter levers' invariants, each broken by hand ----------------------------------------

@pytest.fixture(scope="module")
def managed_graphs():
    """A training plan with every weight managed on NVMe (gathers, fetches, reduces) and one with
    the first weight forced into tiles, both through the backend's pipeline."""
    from mlp import build

    from zinf_compile.capture import plan_offline

    plain = plan_offline(build, {"batch": 16}, 1 << 30, BUILTIN["cpu"], "nvme", params="offload")
    tiled = plan_offline(build, {"batch": 16}, 1 << 30, BUILTIN["cpu"], "nvme", params="offload",
                         max_tile_bytes=64 << 10, tiling="force")
    return plain, tiled


@pytest.mark.parametrize("corrupt,message", [
    ("direct_read", "is read directly"),
    ("fetch_unfinished", "is not finished by one later gather"),
    ("late_gradient_reader", "is reduced by .* before"),
    ("saved_parameter", "saves whole parameters"),
    ("stacked_tiles", "stacked"),
])
def test_verifier_names_each_broken_parameter_invariant(managed_graphs, corrupt, message):
    import copy

    from zinf_compile.ir import FetchMeta, GatherMeta, ParamMeta, ReduceMeta
    from zinf_compile.passes import VerificationError, check_invariants

    plain, tiled = managed_graphs
    done = tiled if corrupt == "stacked_tiles" else plain
    graphs = {role: copy.deepcopy(gm) for role, gm in done.graphs.items()}  # a test's own copy
    ctx = PassContext(num_fwd_outputs=done.num_fwd_outputs)
    check_invariants(graphs, ctx, "as planned")  # the pipeline's graphs keep every invariant
    fw, bw = graphs["forward"].graph, graphs["backward"].graph
    if corrupt == "direct_read":
        p = next(n for n in fw.find_nodes(op="placeholder") if isinstance(ir.meta(n), ParamMeta))
        with fw.inserting_after(p):
            fw.call_function(torch.ops.aten.clone.default, (p,))
    elif corrupt == "fetch_unfinished":
        h = next(n for g in (fw, bw) for n in g.nodes if isinstance(ir.meta(n), FetchMeta))
        with h.graph.inserting_after(h):
            h.graph.call_function(torch.ops.aten.clone.default, (h,))
    elif corrupt == "late_gradient_reader":
        r = next(n for n in bw.nodes if isinstance(ir.meta(n), ReduceMeta))
        with bw.inserting_after(r):
            bw.call_function(torch.ops.aten.clone.default, (r.args[0],))
    elif corrupt == "saved_parameter":
        g = next(n for n in fw.nodes if isinstance(ir.meta(n), GatherMeta))
        out = ir.output_node(fw)
        out.args = ((*out.args[0], g),)
    else:
        tiles = [n for g in (fw, bw) for n in g.nodes if isinstance(ir.meta(n), GatherMeta) and ir.meta(n).rows]
        first = tiles[0]
        third = next(t for t in tiles[2:] if t.graph is first.graph and ir.meta(t).pid == ir.meta(first).pid)
        first.prepend(third)  # tile 2's rows gathered before tile 0's matmul: three tiles at once
        for a in third.all_input_nodes:  # keep the graph well formed (its handle, if fetched, first)
            if a.op != "placeholder":
                third.prepend(a)
    with pytest.raises(VerificationError, match=message):
        check_invariants(graphs, ctx, "corrupted")
