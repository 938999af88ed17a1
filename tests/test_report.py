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
