"""Planning time at scale: `zinf plan` on GPT-style graphs from ~1k to 50k+ nodes.

    python -m bench planning [--layers 4,8,16,32,64,128,256,352] [--inductor-layers 4,8]
                             [--hidden 256] [--seq 128] [--batch 8] [--budget-share 0.6]
                             [--manage-share 0.45] [--baseline-src DIR] [--repeats 1]

For each depth a fresh process builds examples/gpt.py's GPT under FakeTensorMode, captures forward
and backward (what `zinf plan` does: nothing is allocated) and times, on the captured graphs:

    analyse + plan   facts (timeline, gaps, lower bound) and the plan, under a budget of
                     `budget-share` x the unplanned peak (so the planner has offloads to choose);
                     the fastest of 3 in the process
    with params      plan_offline(params="auto") under the same budget: the whole pipeline (gathers
                     for every candidate, one partition, the planner's decisions, every pass and
                     its verification), without the capture it runs inside
    end to end       the same plan_offline call's wall time: what `zinf plan` takes, capture included
                     (comparable with an older zinf's capture + its planning)
    managed, e2e     the same under `manage-share` x the unplanned peak: below what every parameter
                     resident allows, so the planner must shard parameters (0 skips it)

`--baseline-src DIR` also runs, alternately at each depth, the same measurements against the zinf
in DIR (a checkout of an older commit: `git worktree add /tmp/zinf-963bca3 963bca3`): its package
is imported instead of this one's. Before plan_offline existed (963bca3), its end to end is its
`trace(keep_joint=True)` plus `plan_captured` (the trial loop over parameter choices), which is
what its `zinf plan` ran.

For the smallest depths (`--inductor-layers`) another fresh process compiles the same model, for
real, with Inductor (torch.compile, forward+backward of one step) and times that: what planning
adds to a compile. Reports seconds against graph nodes, seconds per 10k nodes, and the log-log
slope of planning time over nodes (1 = linear; n log n is about 1.1 over this range).

Writes <out>/planning.json and <out>/planning.png.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from bench import _harness

DEFAULTS = dict(hidden=256, seq=128, batch=8, heads=4, vocab=1024)


def worker(args) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import torch

    from gpt import build

    kwargs = dict(batch=args.batch, seq=args.seq, layers=args.n, hidden=args.hidden, heads=args.heads,
                  vocab=args.vocab)
    if args.worker == "inductor":
        torch.set_num_threads(2)
        import torch._inductor.config as inductor_config

        inductor_config.force_disable_caches = True  # a cold compile, as a user's first run
        model, (idx, tgt) = build(**kwargs)
        t0 = time.perf_counter()
        model(idx, tgt).loss.backward()
        eager = time.perf_counter() - t0
        compiled = torch.compile(model)
        t0 = time.perf_counter()
        compiled(idx, tgt).loss.backward()
        first = time.perf_counter() - t0
        return dict(layers=args.n, inductor_s=first - eager, eager_step_s=eager)

    if args.zinf_src:
        _import_from(os.path.abspath(args.zinf_src))
    import zinf_compile.capture as capture_mod
    from zinf_compile.cost import load_profile, step_cost
    from zinf_compile.planner import make_plan

    try:
        from zinf_compile.analysis import analyze, graph_specs
    except ImportError:  # 963bca3
        from zinf_compile.analysis.facts import analyze
        from zinf_compile.pipeline import graph_specs
    old = not hasattr(capture_mod, "plan_offline")
    t0 = time.perf_counter()
    c = capture_mod.trace(build, kwargs, keep_joint=True) if old else capture_mod.trace(build, kwargs)
    capture = time.perf_counter() - t0
    nodes = sum(len(g.graph.nodes) for g in c.graphs.values())
    profile = load_profile("cpu")
    analysed = planned = math.inf
    for _ in range(3):  # the fastest of 3 (the first also pays one-time imports and caches)
        t0 = time.perf_counter()
        facts = analyze(graph_specs(c.graphs, c.num_fwd_outputs), device="cpu", step_cost=step_cost(profile))
        analysed = min(analysed, time.perf_counter() - t0)
        budget = max(int(facts.peak * args.budget_share), facts.lower_bound)
        t0 = time.perf_counter()
        plan = make_plan(facts, budget, profile, "nvme")
        planned = min(planned, time.perf_counter() - t0)

    def end_to_end(b: int):
        """(plan, wall seconds of capture + planning, seconds of the planning alone) of `zinf plan`
        with params=auto under budget b, or an error's first line."""
        t0 = time.perf_counter()
        try:
            if old:  # its zinf plan: the capture (above) plus its trial loop
                full = capture_mod.plan_captured(c, b, profile, "nvme", params="auto")
                planning = time.perf_counter() - t0
                return full.plan, capture + planning, planning
            full = capture_mod.plan_offline(build, kwargs, b, profile, "nvme", params="auto")
        except Exception as e:  # noqa: BLE001 - an impossible budget is a result here
            return f"{type(e).__name__}: {str(e).splitlines()[0]}", None, None
        return full.plan, time.perf_counter() - t0, sum(full.seconds.values())

    # with parameters: the whole pipeline (gathers for every candidate, one partition, the planner's
    # decisions, every pass applied and verified), timed without the capture it runs inside
    full, e2e, with_params = end_to_end(budget)
    if isinstance(full, str):
        raise RuntimeError(full)
    row = dict(layers=args.n, nodes=nodes, steps=len(facts.steps), buffers=len(facts.buffers), gaps=len(facts.gaps),
               capture_s=capture, analyse_s=analysed, plan_s=planned, plan_total_s=analysed + planned,
               with_params_s=with_params, end_to_end_s=e2e, budget=budget, peak_before=plan.peak_before,
               peak_after=plan.peak_after, offloads=len(plan.moves()) // 3, managed=len(full.params),
               decisions=[n for n in full.notes if n.startswith(("parameters", "tiles"))])
    if args.manage_share:
        low = int(facts.peak * args.manage_share)
        mplan, e2e_low, _ = end_to_end(low)
        row.update(manage_budget=low, managed_end_to_end_s=e2e_low,
                   managed_low=len(mplan.params) if not isinstance(mplan, str) else None,
                   managed_error=mplan if isinstance(mplan, str) else None)
    return row


def _import_from(src: str) -> None:
    """zinf_compile from the checkout `src`, before any zinf_compile import. Its passes too: the
    editable install maps zinf_compile.passes to this checkout's passes/ folder (package-dir), which
    sys.path alone does not override."""
    import importlib.util

    sys.path.insert(0, src)
    import zinf_compile

    init = os.path.join(src, "passes", "__init__.py")
    spec = importlib.util.spec_from_file_location("zinf_compile.passes", init,
                                                  submodule_search_locations=[os.path.dirname(init)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["zinf_compile.passes"] = zinf_compile.passes = mod
    spec.loader.exec_module(mod)
    assert zinf_compile.__file__.startswith(src), zinf_compile.__file__


def _run(kind: str, n: int, args, src: str | None = None) -> dict:
    extra = ["--zinf-src", src] if src else []
    return _harness.run("bench.planning", kind, ["--n", str(n), "--budget-share", str(args.budget_share),
                                                 "--manage-share", str(args.manage_share), *extra,
                                                 *_harness.as_argv(args, DEFAULTS)], args.timeout, 2,
                        worker="zinf" if kind == "baseline" else kind)[0]


TIMES = ("capture_s", "analyse_s", "plan_s", "plan_total_s", "with_params_s", "end_to_end_s", "managed_end_to_end_s")


def _fastest(runs: list[dict]) -> dict:
    """One row for several runs of a contender: each time its smallest (other jobs on the machine
    only ever add to a time), with every run's times kept under "runs"."""
    row = dict(runs[0])
    for k in TIMES:
        vals = [r[k] for r in runs if r.get(k) is not None]
        row[k] = min(vals) if vals else None
    row["runs"] = [{k: r.get(k) for k in TIMES} for r in runs]
    return row


def _slope(xs, ys) -> float:
    """Least-squares slope of log y over log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den else float("nan")


def parent(args) -> int:
    rows, base = [], []
    for n in [int(x) for x in args.layers.split(",") if x]:
        print(f"layers {n} ...", flush=True)
        runs: dict[str, list[dict]] = {"baseline": [], "zinf": []}
        for _ in range(args.repeats):  # alternately, the baseline first
            if args.baseline_src:
                runs["baseline"].append(_run("baseline", n, args, args.baseline_src))
            runs["zinf"].append(_run("zinf", n, args))
        if args.baseline_src:
            base.append(_fastest(runs["baseline"]))
        rows.append(_fastest(runs["zinf"]))
        for r in [rows[-1], *base[-1:]]:
            print(f"  {r['contender']}: {r['nodes']} nodes: capture {r['capture_s']:.1f} s, analyse+plan "
                  f"{r['plan_total_s']:.2f} s, end to end {r['end_to_end_s']:.1f} s"
                  + (f", managed {r['managed_end_to_end_s'] or float('nan'):.1f} s" if args.manage_share else ""),
                  flush=True)
    inductor = []
    for n in [int(x) for x in args.inductor_layers.split(",") if x]:
        print(f"inductor, layers {n} ...", flush=True)
        inductor.append(_run("inductor", n, args))
    by_layers = {r["layers"]: r for r in rows}
    for i in inductor:
        if i["layers"] in by_layers:
            i["zinf_plan_s"] = by_layers[i["layers"]]["plan_total_s"]
            i["nodes"] = by_layers[i["layers"]]["nodes"]
    xs = [r["nodes"] for r in rows]
    summary = dict(
        per_10k_nodes_s=max(r["plan_total_s"] / r["nodes"] * 1e4 for r in rows),
        per_10k_nodes_with_params_s=max(r["with_params_s"] / r["nodes"] * 1e4 for r in rows),
        slope_plan=_slope(xs, [r["plan_total_s"] for r in rows]) if len(rows) > 1 else None,
        slope_with_params=_slope(xs, [r["with_params_s"] for r in rows]) if len(rows) > 1 else None,
        max_nodes=max(xs),
    )
    checks = {"under_1s_per_10k_nodes": summary["per_10k_nodes_s"] < 1.0,
              "no_worse_than_nlogn": summary["slope_plan"] is None or summary["slope_plan"] <= 1.25}
    if base:
        checks["end_to_end_no_worse_than_baseline"] = all(
            r["end_to_end_s"] <= b["end_to_end_s"] for r, b in zip(rows, base))
        checks["analyse_plan_no_worse_than_baseline"] = all(
            r["plan_total_s"] <= b["plan_total_s"] for r, b in zip(rows, base))
    record = dict(date=time.strftime("%Y-%m-%d"), machine=_machine(), args=vars(args), rows=rows,
                  baseline=base, inductor=inductor, summary=summary, checks=checks)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "planning.json"), "w") as f:
        json.dump(record, f, indent=1)
    _draw(rows, inductor, os.path.join(args.out, "planning.png"))
    print(_table(rows, inductor, summary, checks))
    if base:
        print(_side_by_side(rows, base, args.baseline_src))
    return 0 if all(checks.values()) else 1


def _machine() -> dict:
    from bench.params import _machine as m

    return m()


def _table(rows, inductor, summary, checks) -> str:
    lines = [f"{'layers':>6} {'nodes':>7} {'steps':>6} {'gaps':>6} {'capture s':>9} {'analyse s':>9} {'plan s':>7} "
             f"{'s/10k nodes':>11} {'with params s':>13} {'end to end s':>12} {'managed':>7}"]
    for r in rows:
        lines.append(f"{r['layers']:>6} {r['nodes']:>7} {r['steps']:>6} {r['gaps']:>6} {r['capture_s']:>9.1f} "
                     f"{r['analyse_s']:>9.2f} {r['plan_s']:>7.2f} {r['plan_total_s'] / r['nodes'] * 1e4:>11.3f} "
                     f"{r['with_params_s']:>13.2f} {r['end_to_end_s']:>12.1f} {r['managed']:>7}")
    for i in inductor:
        lines.append(f"Inductor compile, {i['layers']} layers: {i['inductor_s']:.1f} s"
                     + (f" (zinf's analyse + plan of the same graphs: {i['zinf_plan_s']:.2f} s)" if "zinf_plan_s" in i
                        else ""))
    lines.append(f"worst: {summary['per_10k_nodes_s']:.3f} s per 10k nodes (analyse + plan), "
                 f"{summary['per_10k_nodes_with_params_s']:.3f} s with parameters; log-log slope "
                 f"{summary['slope_plan']:.2f} (with parameters {summary['slope_with_params']:.2f})"
                 if summary["slope_plan"] is not None else "")
    lines.append("checks: " + ", ".join(f"{k}={v}" for k, v in checks.items()))
    return "\n".join(lines)


def _side_by_side(rows, base, src: str) -> str:
    def e2e(r, key):
        return f"{r[key]:.1f}" if r.get(key) is not None else (r.get("managed_error") or "-")[:40]

    lines = [f"side by side with {src}:",
             f"{'layers':>6} {'nodes':>7} {'analyse+plan base':>17} {'now':>6} {'end to end base':>15} {'now':>6} "
             f"{'managed e2e base':>16} {'now':>6}"]
    for r, b in zip(rows, base):
        lines.append(f"{r['layers']:>6} {r['nodes']:>7} {b['plan_total_s']:>17.2f} {r['plan_total_s']:>6.2f} "
                     f"{b['end_to_end_s']:>15.1f} {r['end_to_end_s']:>6.1f} {e2e(b, 'managed_end_to_end_s'):>16} "
                     f"{e2e(r, 'managed_end_to_end_s'):>6}")
    return "\n".join(lines)


def _draw(rows, inductor, path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = [r["nodes"] for r in rows]
    ax.loglog(xs, [r["plan_total_s"] for r in rows], "o-", color="#2a9d8f", label="zinf: analyse + plan")
    ax.loglog(xs, [r["with_params_s"] for r in rows], "s-", color="#457b9d",
              label="zinf: with the parameter choice (params=auto)")
    ax.loglog(xs, [r["end_to_end_s"] for r in rows], "v-", color="#1d3557", label="zinf plan, end to end")
    ax.loglog(xs, [r["capture_s"] for r in rows], "^--", color="#8d99ae", label="capture under FakeTensorMode")
    ind = [i for i in inductor if "nodes" in i]
    if ind:
        ax.loglog([i["nodes"] for i in ind], [i["inductor_s"] for i in ind], "D-", color="#e76f51",
                  label="Inductor compile (real)")
    lo, hi = min(xs), max(xs)
    ax.loglog([lo, hi], [lo / 1e4, hi / 1e4], ":", color="#999999", label="1 s per 10k nodes (target)")
    ax.set_xlabel("graph nodes (forward + backward)")
    ax.set_ylabel("seconds")
    ax.set_title("planning time against graph size (GPT, layers " + f"{rows[0]['layers']}-{rows[-1]['layers']})",
                 fontsize=9)
    ax.legend(fontsize=7, frameon=False)
    fig.savefig(path + ".tmp", format="png")
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench planning", description=__doc__.split("\n")[0])
    _harness.add_options(ap, DEFAULTS)
    ap.add_argument("--layers", default="4,8,16,32,64,128,256,352")
    ap.add_argument("--inductor-layers", default="4,8")
    ap.add_argument("--budget-share", type=float, default=0.6)
    ap.add_argument("--manage-share", type=float, default=0.45,
                    help="a second end to end run under this share of the unplanned peak (0: none)")
    ap.add_argument("--baseline-src", help="a checkout of another zinf to measure side by side")
    ap.add_argument("--repeats", type=int, default=1, help="runs per depth and contender; the smallest time counts")
    ap.add_argument("--zinf-src", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    served = _harness.serve(args, worker)
    return parent(args) if served is None else served


if __name__ == "__main__":
    sys.exit(main())
