"""The pictures, the DOT graph and the HTML report of a plan, on plans built by hand."""
from __future__ import annotations

import json
import os
import re
import time

import pytest

from zinf_compile.plan import PLAN_VERSION, Action, Plan, Step, TensorLife
from zinf_compile.report import (
    draw_lanes,
    draw_timeline,
    format_bytes,
    render_svg,
    summary_rows,
    write_dot,
    write_report,
)
from zinf_compile.report import graph as graph_mod
from zinf_compile.report import html as html_mod

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MiB = 2**20


def make_plan(n_steps: int = 20, n_groups: int = 3, tier: str = "nvme",
              nbytes: int = 4 * MiB) -> Plan:
    """A forward/backward plan: step i of the forward saves a tensor for its mirror backward step.

    The first `n_groups` saved tensors (spread over the forward) are offloaded after their def,
    prefetched a few steps before their backward use and waited for right before it.
    """
    half = n_steps // 2
    steps = tuple(
        Step(index=i, graph="forward" if i < half else "backward", name=f"op_{i}",
             op="aten.mm.default" if i % 2 else "aten.relu.default",
             est_time_s=1e-3 * (1 + i % 5), flops=1000 * i)
        for i in range(n_steps)
    )
    tensors = [TensorLife(id=0, name="x", graph="forward", role="input", nbytes=MiB,
                          size_expr="1048576", shape="[256, 1024]", dtype="torch.float32",
                          def_step=-1, use_steps=(0,), movable=False)]
    for i in range(half):
        back = n_steps - 1 - i
        tensors.append(TensorLife(
            id=i + 1, name=f"act_{i}", graph="forward", role="saved", nbytes=nbytes + i,
            size_expr=f"{nbytes + i}", shape=f"[s0, {i + 1}]", dtype="torch.float16",
            def_step=i, use_steps=(i + 1, back), movable=True))
    stride = max(1, (half - 1) // max(n_groups, 1))
    actions: list[Action] = []
    away: list[tuple[int, int, int]] = []
    for g in range(n_groups):
        i = min(g * stride, half - 2)
        t = tensors[i + 1]
        back = n_steps - 1 - i
        pre = max(i + 2, back - 3)
        actions += [Action("offload", t.id, i + 1, tier, t.nbytes, g),
                    Action("prefetch", t.id, pre, tier, t.nbytes, g),
                    Action("wait", t.id, back, tier, t.nbytes, g)]
        away.append((i + 2, pre, t.nbytes))
    live = [0] * (n_steps + 1)  # a difference array: + at the first step, - past the last
    for t in tensors[1:]:
        live[t.def_step] += t.nbytes
        live[max(t.use_steps) + 1] -= t.nbytes
    gone = [0] * (n_steps + 1)
    for lo, hi, nb in away:
        gone[lo] += nb
        gone[hi] -= nb
    before, after, cur, out = [], [], MiB, 0
    for s in range(n_steps):
        cur, out = cur + live[s], out + gone[s]
        before.append(cur)
        after.append(cur - out)
    return Plan(
        version=PLAN_VERSION, graphs=("forward", "backward"), device="cuda", profile="h100-test",
        budget=int(max(after) * 1.05), tier=tier, steps=steps, tensors=tuple(tensors),
        actions=tuple(actions), timeline_before=tuple(before), timeline_after=tuple(after),
        peak_before=max(before), peak_after=max(after), lower_bound=3 * nbytes,
        bytes_moved={tier: 2 * sum(nb for _, _, nb in away)},
        predicted_compute_s=sum(s.est_time_s for s in steps), predicted_stall_s=0.0125,
        notes=("three tensors offloaded", "<b>not bold</b>"),
    )


@pytest.fixture(scope="module")
def big_plan() -> Plan:
    return make_plan(n_steps=5000, n_groups=1000, nbytes=MiB)


def _png(path: str) -> None:
    assert os.path.getsize(path) > 1000
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC


def test_round_trip_through_json() -> None:
    plan = make_plan()
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan
    assert Plan.from_json(json.loads(plan.dumps())) == plan


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * MiB) == "3.00 MiB"
    assert format_bytes(5 * 2**30 // 2) == "2.50 GiB"


def test_draw_timeline_and_lanes_write_png(tmp_path) -> None:
    plan = make_plan()
    assert draw_timeline(plan, str(tmp_path / "t.png")) == str(tmp_path / "t.png")
    assert draw_lanes(plan, str(tmp_path / "l.png")) == str(tmp_path / "l.png")
    _png(str(tmp_path / "t.png"))
    _png(str(tmp_path / "l.png"))


def test_pictures_of_an_empty_or_inference_plan(tmp_path) -> None:
    plan = make_plan(n_groups=0)
    infer = Plan(**{**plan.__dict__, "graphs": ("inference",), "steps": tuple(
        Step(s.index, "inference", s.name, s.op, s.est_time_s, s.flops) for s in plan.steps)})
    bare = Plan(**{**plan.__dict__, "steps": (), "tensors": (), "actions": (),
                   "timeline_before": (), "timeline_after": ()})
    for i, p in enumerate((plan, infer, bare)):
        _png(draw_timeline(p, str(tmp_path / f"t{i}.png")))
        _png(draw_lanes(p, str(tmp_path / f"l{i}.png")))
        write_dot(p, str(tmp_path / f"g{i}.dot"))


def test_unknown_action_kind_gets_a_lane(tmp_path) -> None:
    plan = make_plan()
    extra = Action("gather", 1, 3, "cpu", 10, 99)  # type: ignore[arg-type]
    plan = Plan(**{**plan.__dict__, "actions": plan.actions + (extra,)})
    _png(draw_lanes(plan, str(tmp_path / "l.png")))
    assert "gather 1" in dict(summary_rows(plan))["actions"]


def test_big_plan_draws(tmp_path, big_plan: Plan) -> None:
    assert len(big_plan.steps) == 5000 and len(big_plan.actions) == 3000
    t0 = time.monotonic()
    _png(draw_timeline(big_plan, str(tmp_path / "t.png")))
    _png(draw_lanes(big_plan, str(tmp_path / "l.png")))
    assert time.monotonic() - t0 < 120  # ~ a few seconds; generous for slow machines


def test_write_dot_small(tmp_path) -> None:
    plan = make_plan()
    path = write_dot(plan, str(tmp_path / "g.dot"))
    text = open(path).read()
    assert text.startswith("digraph")
    assert "cluster_0_forward" in text and "cluster_1_backward" in text
    assert "in0 " in text  # the graph input has its node in a small graph
    dashed = [line for line in text.splitlines() if "style=\"dashed\"" in line]
    assert dashed and all("#d62728" in line for line in dashed)
    assert any("offload->nvme @ step 1 / prefetch @ step 16" in line for line in dashed)
    assert "s1 -> s18 " in text  # act_0: def at 0, used at 1 and 19; offloaded after 1
    assert text.count("{") == text.count("}")


def test_write_dot_large_keeps_touched_steps(tmp_path, big_plan: Plan) -> None:
    path = write_dot(big_plan, str(tmp_path / "g.dot"), max_nodes=400)
    text = open(path).read()
    nodes = set(re.findall(r"^\s+s(\d+) \[label=", text, flags=re.M))
    assert 0 < len(nodes) <= 400
    assert "more than 400" in text
    touched = {a.step for a in big_plan.actions}
    assert all(int(n) in touched for n in nodes)  # neighbours would be too many here
    assert "in0 " not in text  # no input nodes in a pruned graph

    small = make_plan(n_steps=60, n_groups=2)
    text = open(write_dot(small, str(tmp_path / "s.dot"), max_nodes=20)).read()
    nodes = {int(n) for n in re.findall(r"^\s+s(\d+) \[label=", text, flags=re.M)}
    touched = {a.step for a in small.actions}
    assert touched <= nodes
    assert nodes == {j for i in touched for j in (i - 1, i, i + 1) if 0 <= j < 60}
    assert "neighbours" in text and "dashed" in text


def test_render_svg_without_graphviz(tmp_path, monkeypatch) -> None:
    dot = write_dot(make_plan(), str(tmp_path / "g.dot"))
    monkeypatch.setattr(graph_mod.shutil, "which", lambda name: None)
    assert render_svg(dot, str(tmp_path / "g.svg")) is None
    monkeypatch.setattr(graph_mod.shutil, "which", lambda name: str(tmp_path / "no-such-dot"))
    assert render_svg(dot, str(tmp_path / "g.svg")) is None
    monkeypatch.setattr(graph_mod.shutil, "which", lambda name: "/bin/false")
    assert render_svg(dot, str(tmp_path / "g.svg")) is None


@pytest.mark.skipif(not graph_mod.shutil.which("dot"), reason="graphviz is not installed")
def test_render_svg_with_graphviz(tmp_path) -> None:
    dot = write_dot(make_plan(), str(tmp_path / "g.dot"))
    assert render_svg(dot, str(tmp_path / "g.svg")) == str(tmp_path / "g.svg")
    assert "<svg" in open(tmp_path / "g.svg").read()


def test_write_report(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(html_mod, "render_svg", lambda dot, svg: None)
    plan = make_plan()
    files = write_report(plan, str(tmp_path / "out"), title="my <plan>")
    assert set(files) == {"timeline", "lanes", "dot", "html"}
    for key in ("timeline", "lanes", "dot", "html"):
        assert os.path.getsize(files[key]) > 0
    html = open(files["html"], encoding="utf-8").read()
    assert html.count("data:image/png;base64,iVBORw0KGgo") == 2  # both PNGs, embedded
    assert "<title>my &lt;plan&gt;</title>" in html
    assert "act_0" in html and "[s0, 1]" in html
    assert "&lt;b&gt;not bold&lt;/b&gt;" in html  # notes are escaped
    assert "offload 3, prefetch 3, wait 3" in html
    assert "DOT source" in html  # no graphviz: the DOT text instead


def test_write_report_inlines_svg(tmp_path, monkeypatch) -> None:
    def fake_render(dot: str, svg: str) -> str:
        with open(svg, "w") as f:
            f.write('<?xml version="1.0"?>\n<!DOCTYPE svg>\n<svg id="fake"></svg>\n')
        return svg

    monkeypatch.setattr(html_mod, "render_svg", fake_render)
    files = write_report(make_plan(), str(tmp_path))
    html = open(files["html"], encoding="utf-8").read()
    assert files["svg"].endswith("graph.svg")
    assert '<svg id="fake"></svg>' in html and "<?xml" not in html


def test_report_caps_tensor_table(tmp_path, monkeypatch, big_plan: Plan) -> None:
    monkeypatch.setattr(html_mod, "render_svg", lambda dot, svg: None)
    html = open(write_report(big_plan, str(tmp_path))["html"], encoding="utf-8").read()
    assert "... 800 more" in html
    table = html.split("<h2>Offloaded tensors</h2>")[1].split("<h2>")[0]
    assert table.count("<tr>") == 1 + 200 + 1  # header, rows, the "more" line
    # sorted by bytes, largest first: act_i has nbytes MiB + i
    first = re.search(r"<tr><td>(act_\d+)</td>", table).group(1)
    assert first == max((t for t in big_plan.tensors if t.id in {a.tensor for a in
                         big_plan.actions}), key=lambda t: t.nbytes).name


def test_summary_rows() -> None:
    plan = make_plan()
    rows = dict(summary_rows(plan))
    assert rows["actions"] == "offload 3, prefetch 3, wait 3"
    assert rows["peak before"] == format_bytes(plan.peak_before)
    assert rows["peak after"] == format_bytes(plan.peak_after)
    assert rows["budget"] == format_bytes(plan.budget)
    assert rows["lower bound"] == "12.00 MiB"
    assert rows["bytes moved (nvme)"] == format_bytes(plan.bytes_moved["nvme"])
    assert rows["predicted stall"] == "12.50 ms"
    assert rows["predicted compute"] == "60.00 ms"
    assert rows["device"] == "cuda" and rows["tier"] == "nvme"
    empty = make_plan(n_groups=0)
    assert dict(summary_rows(empty))["actions"] == "none"


def test_plan_from_json_rejects_inconsistent_plans():
    import json as _json

    import pytest as _pytest

    from zinf_compile.plan import Plan as _Plan

    good = _json.loads(_json.dumps(make_plan().to_json()))
    _Plan.from_json(good)
    with _pytest.raises(ValueError, match="unknown field"):
        _Plan.from_json({**good, "extra": 1})
    with _pytest.raises(ValueError, match="one entry per step"):
        _Plan.from_json({**good, "timeline_after": good["timeline_after"][:-1]})
    with _pytest.raises(ValueError, match="version"):
        _Plan.from_json({**good, "version": 99})


# -- managed parameters (ZeRO-3): gather / release / reduce / fetch actions, group = -1 - pid --------


def make_param_plan(n_params: int = 2, n_steps: int = 40, fetch: bool = True, world: int = 1,
                    n_groups: int = 1) -> Plan:
    """make_plan plus `n_params` managed parameters: parameter i is gathered in the forward at
    step 2i+1 (its shard fetched two steps ahead) and released a step later, gathered again in the
    mirrored backward step, and its gradient reduced two steps after that."""
    from zinf_compile.plan import ManagedParam

    base = make_plan(n_steps=n_steps, n_groups=n_groups)
    half = n_steps // 2
    tensors, actions, params = list(base.tensors), list(base.actions), []
    tid = max(t.id for t in tensors) + 1
    for pid in range(n_params):
        nbytes = (pid + 1) * 64 * 1024
        params.append(ManagedParam(pid, f"layers.{pid}.weight", nbytes, -(-nbytes // world), "nvme", world))
        g = -1 - pid
        f_at = (2 * pid + 1) % (half - 2)
        b_at = n_steps - 4 - f_at
        for at, graph in ((f_at, "forward"), (b_at, "backward")):
            tensors.append(TensorLife(id=tid, name=f"gather_{tid}", graph=graph, role="activation",
                                      nbytes=nbytes, size_expr=str(nbytes), shape="[256, 64]",
                                      dtype="float32", def_step=at, use_steps=(at + 1,), movable=False))
            if fetch and at >= 2:
                actions.append(Action("fetch", tid + 1000, at - 2, "nvme", -(-nbytes // world), g))
                tensors.append(TensorLife(id=tid + 1000, name=f"fetch_{tid}", graph=graph, role="activation",
                                          nbytes=8, size_expr="8", shape="[1]", dtype="int64",
                                          def_step=at - 2, use_steps=(at,), movable=False))
            actions += [Action("gather", tid, at, "nvme", nbytes, g),
                        Action("release", tid, at + 1, "nvme", nbytes, g)]
            tid += 1
        actions.append(Action("reduce", tid - 1, b_at + 2, "nvme", nbytes, g))
    actions.sort(key=lambda a: (a.step, a.kind != "offload", a.group))
    return Plan(**{**base.__dict__, "tensors": tuple(sorted(tensors, key=lambda t: t.id)),
                   "actions": tuple(actions), "params": tuple(params)})


def test_param_plan_round_trips_and_pairs_gathers_with_releases() -> None:
    from zinf_compile.report.common import param_spans, param_uses

    plan = make_param_plan()
    assert Plan.from_json(json.loads(plan.dumps())) == plan
    assert plan.moves() and all(a.group >= 0 for a in plan.moves())
    spans = param_spans(plan)
    assert [(s.name, s.graph, s.gather, s.release) for s in spans] == [
        ("layers.0.weight", "forward", 1, 2), ("layers.1.weight", "forward", 3, 4),
        ("layers.1.weight", "backward", 33, 34), ("layers.0.weight", "backward", 35, 36)]
    assert [s.fetch for s in spans] == [None, 1, 31, 33]  # layer 0's forward gather at step 1: no room
    uses = param_uses(plan)
    assert [(u.param.name, u.gathers, u.reduces) for u in uses] == [
        ("layers.0.weight", (1, 35), (37,)), ("layers.1.weight", (3, 33), (35,))]


def test_lanes_show_parameter_lanes_and_spans(tmp_path) -> None:
    from zinf_compile.report.lanes import ACTIVATION_LANES, lane_figure, lane_kinds

    plan = make_param_plan()
    assert lane_kinds(plan) == ["offload", "prefetch", "wait", "fetch", "gather", "release", "reduce"]
    _png(draw_lanes(plan, str(tmp_path / "l.png")))
    fig = lane_figure(plan)
    lanes, away, whole, compute = fig.axes[:4]
    assert [t.get_text() for t in lanes.get_yticklabels()] == [
        "offload (1)", "prefetch (1)", "wait (1)", "fetch (3)", "gather (4)", "release (4)", "reduce (2)"]
    assert whole.get_ylabel() == "whole"
    assert [t.get_text() for t in whole.get_yticklabels()] == ["layers.0.weight 64.00 KiB",
                                                               "layers.1.weight 128.00 KiB"]
    bars, reads = whole.collections[:2]
    assert len(bars.get_segments()) == 4 and len(reads.get_segments()) == 3  # whole; fetch -> gather
    legend = [t.get_text() for t in whole.get_legend().get_texts()]
    assert legend == ["whole, shard on nvme", "fetch → gather", "gradient reduced"]
    assert "2 parameters managed" in fig._suptitle.get_text()

    # no parameters: the three axes and three lanes as before
    fig = lane_figure(make_plan())
    assert len(fig.axes) == 3 and lane_kinds(make_plan()) == ACTIVATION_LANES


def test_lanes_with_many_parameters_draw_unnamed_rows(tmp_path) -> None:
    from zinf_compile.report.lanes import PARAM_ROWS_UP_TO, lane_figure

    n = PARAM_ROWS_UP_TO + 10
    plan = make_param_plan(n_params=n, n_steps=400, fetch=False)
    whole = lane_figure(plan).axes[2]
    assert not [t.get_text() for t in whole.get_yticklabels() if t.get_text()]
    assert any(f"{n} parameters" in t.get_text() for t in whole.texts)
    _png(draw_lanes(plan, str(tmp_path / "l.png")))


def test_summary_dot_and_report_list_managed_parameters(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(html_mod, "render_svg", lambda dot, svg: None)
    plan = make_param_plan(world=4)
    rows = dict(summary_rows(plan))
    assert rows["actions"] == "offload 1, prefetch 1, wait 1, fetch 3, gather 4, release 4, reduce 2"
    assert rows["offloaded tensors"] == "1"  # the parameters' actions are no offload groups
    assert rows["managed parameters"] == "2: 192.00 KiB whole, 48.00 KiB of shards per rank of 4 in nvme"
    assert rows["parameter gathers"] == ("4 per step, 96.00 KiB read from nvme (384.00 KiB whole after the "
                                         "all-gather), 3 of them fetched ahead")
    assert rows["gradient reduces"] == "2 per step, into the shards in nvme"
    assert "managed parameters" not in dict(summary_rows(make_plan()))

    dot = open(write_dot(plan, str(tmp_path / "g.dot"))).read()
    # a step with only parameter actions is outlined in the gather colour, one with an offload in red
    assert re.search(r's33 \[label="33: op_33\\naten.mm.default\\n[^"]*\\nfetch, gather".*"#ff7f0e"', dot)
    assert re.search(r's1 \[label="1: op_1\\n[^"]*\\nfetch, gather, offload".*"#d62728"', dot)

    files = write_report(plan, str(tmp_path / "out"))
    html = open(files["html"], encoding="utf-8").read()
    table = html.split("<h2>Managed parameters</h2>")[1].split("<h2>")[0]
    assert "sharded over 4 ranks, the shards in nvme" in table
    assert table.index("layers.1.weight") < table.index("layers.0.weight")  # largest first
    assert "<td>layers.0.weight</td><td class=\"num\">64.00 KiB</td><td class=\"num\">16.00 KiB</td>" \
           "<td>nvme</td><td class=\"num\">2</td>" in table
    assert "at the gather, 2 steps ahead (step 33)" in table  # layer 0: forward, then backward
    assert "no parameter is managed" in open(write_report(make_plan(), str(tmp_path / "o2"))["html"]).read()


@pytest.fixture(scope="module")
def compiled_param_plan(offload_root):
    """A real compile that manages the parameters of a tiny MLP (both weights are 64 KiB)."""
    import torch

    import zinf_compile

    torch._dynamo.reset()
    zinf_compile.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opts = {"params": "offload", "offload": "nvme", "offload_dir": os.path.join(offload_root, "report")}
    torch.compile(model, backend="zinf", options=opts)(torch.randn(8, 64)).sum().backward()
    plans = [r.plan for r in zinf_compile.compiles() if "backward" in r.plan.graphs]
    del model
    return plans[-1]


def test_report_of_a_compile_that_manages_parameters(tmp_path, monkeypatch, compiled_param_plan) -> None:
    from zinf_compile.report.lanes import lane_figure

    monkeypatch.setattr(html_mod, "render_svg", lambda dot, svg: None)
    plan = compiled_param_plan
    assert {p.name for p in plan.params} == {"0.weight", "2.weight"}
    counts = plan.action_counts()
    assert counts["gather"] == counts["release"] >= 3 and counts["reduce"] == 2
    files = write_report(plan, str(tmp_path))
    _png(files["lanes"])
    whole = lane_figure(plan).axes[2]
    assert {t.get_text().split()[0] for t in whole.get_yticklabels()} == {"0.weight", "2.weight"}
    html = open(files["html"], encoding="utf-8").read()
    table = html.split("<h2>Managed parameters</h2>")[1].split("<h2>")[0]
    assert "<td>0.weight</td>" in table and "<td>2.weight</td>" in table
    assert "managed parameters" in html.split("<h2>Summary</h2>")[1].split("<h2>")[0]
