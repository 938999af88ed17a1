"""Memory-centric tiling, measured: one linear layer whose weight alone is larger than the budget.

    python -m bench tiling [--width 16384] [--batch 64] [--budget 512MiB] [--roomy 3GiB]
                           [--steps 2] [--repeats 1] [--contenders eager,zinf-tiled,zinf-untiled,zinf-forced]

The model is examples/tiled.py's OneBig (Linear(256, W) -> GELU -> Linear(W, W) -> GELU ->
Linear(W, 16), cross-entropy): at W = 16384 the big weight is 1 GiB in fp32. Each contender trains it
with AdamW in a fresh process, alternately:

    eager          the model in eager mode + torch.optim.AdamW: everything in memory
    zinf-tiled     backend="zinf", budget (512 MiB), NVMe tier, params="offload", tiling "auto":
                   the plan tiles the big layer's matmuls; zinf_compile.optimizer(model, AdamW)
    zinf-untiled   the same with a roomy budget (3 GiB, where the whole weight fits) and tiling "off"
    zinf-forced    the roomy budget with tiling forced ({"max_tile_bytes": W^2 * 4 / 4}: 4 tiles)

Memory (as `python -m bench params`): VmRSS after imports (`base`), after build, compile and a
warm-up step (`held` = that - base: compiled code and what stays resident), then VmHWM over the
measured steps (`growth`). Checks: zinf-tiled's growth <= 1.25 x budget; eager's peak over base
> 2 x budget; the untiled graph's lower bound (zinf-untiled's plan) > budget, so without tiling no
plan exists under it.

Speed: zinf-forced / zinf-untiled step time (same budget, same tier; only the tiling differs: the
cost of tiles where both fit), and zinf-tiled / zinf-untiled. Medians of the measured steps.

Writes <out>/tiling.json and <out>/tiling.png; exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench import _harness
from bench.params import _machine, _median

MiB = 2**20
CONTENDERS = ("eager", "zinf-tiled", "zinf-untiled", "zinf-forced")
LIMIT = 1.25
DEFAULTS = dict(width=16384, batch=64, d_in=256, steps=2, warmup=1, threads=2, seed=0, lr=1e-4)


def _options(args) -> dict | None:
    base = {"offload": "nvme", "params": "offload", "offload_dir": args.offload_dir}
    w = args.width * args.width * 4
    return {
        "eager": None,
        "zinf-tiled": {**base, "budget": args.budget},
        "zinf-untiled": {**base, "budget": args.roomy, "tiling": "off"},
        "zinf-forced": {**base, "budget": args.roomy, "tiling": {"max_tile_bytes": -(-w // 4)}},
    }[args.worker]


def worker(args) -> dict:
    import gc

    import torch

    from bench import _rss

    torch.set_num_threads(args.threads)
    import zinf_compile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from tiled import build

    gc.collect()
    _rss.trim()
    base = _rss.rss()
    model, (x, y) = build(args.batch, d_in=args.d_in, width=args.width, seed=args.seed)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    options = _options(args)
    if options is None:
        fn = model
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    else:
        fn = torch.compile(model, backend="zinf", options=options)
        opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=args.lr)

    def step() -> float:
        loss = fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    m = _harness.measure_steps(step, args.warmup, args.steps)
    peak = m["peak"]
    result = dict(contender=args.worker, base=base, **m, peak_over_base=peak - base, param_bytes=param_bytes)
    plans = [p for p in zinf_compile.last_plans() if "forward" in p.graphs]
    if options is not None and plans:
        p = plans[-1]
        result["plan"] = dict(budget=p.budget, peak_before=p.peak_before, peak_after=p.peak_after,
                              lower_bound=p.lower_bound, actions=p.action_counts(), params=len(p.params),
                              tiles=[dict(graph=t.graph, op=t.op, axis=t.axis, count=t.count, grad=t.grad,
                                          tile_shape=list(t.tile_shape)) for t in p.tiles])
    return result


def _run(name: str, args) -> list[dict]:
    return _harness.run("bench.tiling", name, ["--budget", args.budget, "--roomy", args.roomy,
                                               *_harness.as_argv(args, DEFAULTS)], args.timeout, args.threads)


def parent(args) -> int:
    from zinf_compile.units import parse_bytes

    budget = parse_bytes(args.budget)
    names = [n for n in args.contenders.split(",") if n]
    runs = _harness.alternate(names, CONTENDERS, args.repeats, lambda n: _run(n, args))
    summary = {}
    for n in names:
        rs = [x for x in runs if x["contender"] == n]
        summary[n] = dict(
            growth_max=max(x["peak"] - x["held_after_warmup"] for x in rs),
            held_median=_median([x["held_after_warmup"] - x["base"] for x in rs]),
            peak_over_base_max=max(x["peak_over_base"] for x in rs),
            step_s=_median([s for x in rs for s in x["step_s"]]),
            moved_per_step=_median([sum(x["moved_per_step"].values()) for x in rs]),
            final_loss=rs[0]["losses"][-1], losses=rs[0]["losses"], plan=rs[0].get("plan"),
            files_left=sorted({f for x in rs for f in x["files_left"]}),
        )
    weight = args.width * args.width * 4
    checks: dict = {"big_weight_vs_budget": weight / budget}
    if "zinf-tiled" in summary:
        z = summary["zinf-tiled"]
        checks["tiled_growth_vs_budget"] = z["growth_max"] / budget
        checks["tiled_growth_within_1.25x_budget"] = z["growth_max"] <= LIMIT * budget
        checks["tiled_plan_has_tiles"] = bool(z["plan"] and z["plan"]["tiles"])
    if "eager" in summary:
        checks["eager_peak_vs_budget"] = summary["eager"]["peak_over_base_max"] / budget
        checks["eager_needs_over_2x_budget"] = summary["eager"]["peak_over_base_max"] > 2 * budget
    if "zinf-untiled" in summary and summary["zinf-untiled"]["plan"]:
        lb = summary["zinf-untiled"]["plan"]["lower_bound"]
        checks["untiled_lower_bound_vs_budget"] = lb / budget
        checks["untiled_cannot_fit_the_budget"] = lb > budget
        u = summary["zinf-untiled"]["step_s"]
        speed = {}
        for n in ("zinf-forced", "zinf-tiled"):
            if n in summary:
                speed[f"{n}_vs_untiled"] = summary[n]["step_s"] / u
        checks["speed"] = speed
    checks["no_files_left"] = not any(s["files_left"] for s in summary.values())
    ok = all(v for k, v in checks.items() if isinstance(v, bool))
    record = dict(date=time.strftime("%Y-%m-%d"), machine=_machine(), args=vars(args), budget=budget,
                  weight_bytes=weight, param_bytes=runs[0]["param_bytes"], summary=summary, checks=checks,
                  runs=runs, ok=ok)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tiling.json"), "w") as f:
        json.dump(record, f, indent=1)
    _draw(summary, budget, weight, os.path.join(args.out, "tiling.png"))
    print(_table(summary, budget, weight, checks))
    return 0 if ok else 1


def _table(summary, budget, weight, checks) -> str:
    lines = [f"big weight {weight / MiB:.0f} MiB = {weight / budget:.1f}x the budget of {budget / MiB:.0f} MiB",
             f"{'contender':13} {'peak-base MiB':>14} {'held MiB':>9} {'growth MiB':>11} {'x budget':>9} "
             f"{'step s':>8} {'moved MiB/step':>15}  tiles"]
    for n, s in summary.items():
        tiles = ", ".join(f"{t['graph'][0]}:{t['axis']}x{t['count']}" for t in (s["plan"] or {}).get("tiles", []))
        lines.append(f"{n:13} {s['peak_over_base_max'] / MiB:>14.0f} {s['held_median'] / MiB:>9.0f} "
                     f"{s['growth_max'] / MiB:>11.0f} {s['growth_max'] / budget:>9.2f} {s['step_s']:>8.2f} "
                     f"{s['moved_per_step'] / MiB:>15.0f}  {tiles or '-'}")
    for k, v in checks.get("speed", {}).items():
        lines.append(f"step time {k.replace('_vs_', ' / ')}: {v:.2f}x")
    lines.append("checks: " + ", ".join(f"{k}={v if not isinstance(v, float) else round(v, 3)}"
                                        for k, v in checks.items() if k != "speed"))
    return "\n".join(lines)


def _draw(summary, budget, weight, path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.2, 4.0), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax, bx = fig.subplots(1, 2, width_ratios=[3, 2])
    names = list(summary)
    held = [summary[n]["held_median"] / MiB for n in names]
    growth = [summary[n]["growth_max"] / MiB for n in names]
    ax.bar(names, held, color="#8d99ae", label="held between steps")
    bars = ax.bar(names, growth, bottom=held, color="#2a9d8f", label="growth during the steps")
    for b, h, g in zip(bars, held, growth):
        ax.text(b.get_x() + b.get_width() / 2, h + g, f"+{g:.0f}\n({g * MiB / budget:.2f}x)", ha="center",
                va="bottom", fontsize=7)
    ax.axhline(budget / MiB, color="#e76f51", lw=1.2, ls="--", label=f"budget {budget / MiB:.0f} MiB")
    ax.set_ylabel("peak RSS over the empty process (MiB)")
    ax.set_title(f"one {weight / MiB:.0f} MiB weight, budget {budget / MiB:.0f} MiB", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_ylim(0, max(h + g for h, g in zip(held, growth)) * 1.3)
    ax.legend(fontsize=7, frameon=False, loc="upper right")
    steps = [summary[n]["step_s"] for n in names]
    bx.bar(names, steps, color="#457b9d")
    for i, s in enumerate(steps):
        bx.text(i, s, f"{s:.1f} s", ha="center", va="bottom", fontsize=7)
    bx.set_ylabel("step time (median, s)")
    bx.tick_params(axis="x", labelsize=7, rotation=20)
    fig.savefig(path + ".tmp", format="png")
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench tiling", description=__doc__.split("\n")[0])
    _harness.add_options(ap, DEFAULTS)
    ap.add_argument("--budget", default="512MiB")
    ap.add_argument("--roomy", default="3GiB", help="the budget where the untiled graph fits too")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    ap.add_argument("--timeout", type=int, default=1800)
    args = ap.parse_args(argv)
    served = _harness.serve(args, worker)
    return parent(args) if served is None else served


if __name__ == "__main__":
    sys.exit(main())
