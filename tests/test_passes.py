"""Golden checks of a plan, and the passes on captured graphs (no Inductor: fast)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from zinf_compile.capture import capture
from zinf_compile.cost import BUILTIN
from zinf_compile.passes import PIPELINE, PassContext, PinOrder, verify
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
    ctx = PassContext(graphs=graphs, facts=facts, plan=plan, engine_key=1)
    report = PIPELINE[0](ctx)
    n = plan.action_counts()["offload"]
    assert report.counts == {"offload": n, "prefetch": n, "wait": n}
    assert verify(ctx, nfo, report.name) <= BUDGET
    fw_out = next(iter(graphs["forward"].graph.find_nodes(op="output")))
    saved_handles = [a for a in fw_out.args[0] if getattr(a, "target", None) == torch.ops.zinf.offload.default]
    assert len(saved_handles) == n  # the forward returns handles in place of the offloaded tensors

    from torch._inductor.fx_passes.control_dependencies import control_deps

    for role in ("forward", "backward"):
        g = graphs[role].graph
        pin = PinOrder()(g)
        wrapped = [nd for nd in g.nodes if nd.target is control_deps]
        assert pin.counts["edges"] >= len(wrapped) > 0
        for nd in wrapped:  # every added edge points at a node that stands earlier in the graph
            order = {x: i for i, x in enumerate(g.nodes)}
            assert all(order[d] < order[nd] for d in nd.args[0])
