"""Memory, measured: peak RSS growth of training steps with and without zinf's NVMe offload.

    python -m bench memory [--steps 3] [--budget 64MiB] [--repeats 1] [--out bench/results]

A ReLU MLP whose activations saved for backward are several times the budget is trained for a few
SGD steps by each contender, each in its own fresh subprocess:

    eager       plain PyTorch
    inductor    torch.compile(model)                       (the default backend)
    zinf-nvme   torch.compile(model, backend="zinf", options={"budget": B, "offload": "nvme",
                                                              "offload_dir": <fresh mkdtemp>})

After two warm-up steps (compiles happen there) the worker calls glibc's malloc_trim(0), reads
VmRSS as the baseline, resets the high-water mark (writes 5 to /proc/self/clear_refs), runs the
measured steps and reads VmHWM. growth = VmHWM - baseline: the most memory the steps added on top
of what was already resident (parameters, gradients, compiled code, the input batch).

The claim checked: zinf's growth stays within 1.25x the budget while eager's is over 2x.
Every contender runs with the same thread count and the same malloc environment: by default
MALLOC_MMAP_THRESHOLD_=131072 (see DEFAULT_MALLOC_ENV for why; `--malloc-env none` for glibc's
defaults, under which VmHWM also counts freed heap that glibc keeps resident).
Writes <out>/memory.json (every run, the plans, the checks) and <out>/memory.png; exits 1 when a
check fails.

`python -m bench.memory --worker NAME ...` runs one contender and prints its result as JSON (the
benchmark runs each through bench/_harness.py, which collects the result from a file).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from bench import _harness

MiB = 2**20
CONTENDERS = ("eager", "inductor", "zinf-nvme")
ZINF_LIMIT = 1.25  # zinf's growth / budget must be <= this
EAGER_FLOOR = 2.0  # eager's growth / budget must be > this
SAVED_FACTOR = 3.0  # saved activations must be >= this x the budget

# The model: sizes chosen so that (at the default budget of 64 MiB)
#   saved activations  = layers x batch x hidden x 4 B = 28 x 8 MiB = 224 MiB  (3.5x the budget)
#   params + grads     = 2 x 28 x 64 KiB = 3.5 MiB; the input 8 MiB; the largest step ~ 3 x 8 MiB
# so zinf's lower bound (33.8 MiB) stays well under the budget (BudgetError names it otherwise).
# Narrow layers keep the parameters small and the compute per activation byte low: hidden 512 x
# batch 4096 has the same activations but a lower bound of 73 MiB (params and grads are 48 MiB).
DEFAULTS = dict(layers=28, hidden=128, batch=16384, seed=0, lr=1e-3, warmup=2, threads=2)

# glibc raises its mmap threshold dynamically (up to 32 MiB) after the first large free; from then
# on every activation comes from the brk heap, and the heap keeps freed chunks resident until a trim.
# VmHWM then counts every heap address a step ever touched, not the bytes live at once, and the
# result depends on where first-fit happened to place each tensor. Pinning the threshold at glibc's
# own initial value (128 KiB) keeps large tensors in their own mappings, returned on free, so RSS
# follows the live bytes. Applied to every contender alike; `--malloc-env none` measures with
# glibc's defaults instead.
DEFAULT_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_=131072",)


# ------------------------------------------------------------------------------------------------
# worker: one contender, one process
# ------------------------------------------------------------------------------------------------
def _build(args):
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self, layers: int, hidden: int) -> None:
            super().__init__()
            self.body = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(hidden, hidden), nn.ReLU())])

        def forward(self, x):
            return self.body(x).pow(2).mean()

    torch.manual_seed(args.seed)
    model = MLP(args.layers, args.hidden)
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.batch, args.hidden, generator=g)
    return model, x


def saved_activation_bytes(model, x) -> int:
    """Bytes of the distinct storages autograd saves for backward in one eager forward, parameters
    and the input excluded: what a training step adds between its forward and its backward."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params.add(x.untyped_storage().data_ptr())
    seen: dict[int, object] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s  # held until the forward ends, so no address is reused
        # pack nothing: a saved output packed as itself would hold its own grad_fn (a cycle
        # through C++ that the garbage collector cannot see), and no backward will unpack it
        return None

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
        loss = model(x)
    del loss
    total = sum(s.nbytes() for s in seen.values())
    seen.clear()
    return total


def _plan_summary(plan) -> dict:
    saved = sum(t.nbytes for t in plan.tensors if t.role == "saved")
    moved = sum(a.nbytes for a in plan.actions if a.kind == "offload")
    after = list(plan.timeline_after)
    at = max(range(len(after)), key=after.__getitem__) if after else 0
    peak_step = plan.steps[at] if plan.steps else None
    return {
        "graphs": list(plan.graphs),
        "budget": plan.budget,
        "peak_before": plan.peak_before,
        "peak_after": plan.peak_after,
        "lower_bound": plan.lower_bound,
        "action_counts": plan.action_counts(),
        "offloaded_bytes": moved,
        "saved_bytes": saved,
        "live_at_start": plan.timeline_before[0] if plan.timeline_before else 0,
        "peak_after_step": {"index": at, "graph": peak_step.graph, "name": peak_step.name, "op": peak_step.op}
        if peak_step else None,
        "steps": len(plan.steps),
        "bytes_moved": dict(plan.bytes_moved),
        "predicted_compute_s": plan.predicted_compute_s,
        "predicted_stall_s": plan.predicted_stall_s,
        "notes": list(plan.notes),
    }


def _files_under(path: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            out.append(os.path.relpath(os.path.join(dirpath, name), path))
    return sorted(out)




def _zinf_options(pairs: list[str]) -> dict:
    """KEY=VALUE pairs into zinf options (ints and booleans converted)."""
    out: dict = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        low = value.lower()
        out[key] = True if low == "true" else False if low == "false" else int(value) if value.isdigit() else value
    return out


def worker(args) -> dict:
    import gc

    import torch

    from bench import _rss

    why = _rss.can_measure()
    if why:
        raise SystemExit(f"cannot measure memory here: {why}")
    torch.set_num_threads(args.threads)
    model, x = _build(args)
    result: dict = {"contender": args.worker, "pid": os.getpid(), "threads": torch.get_num_threads()}
    if args.worker == "eager":
        fn = model
    elif args.worker == "inductor":
        fn = torch.compile(model)
    elif args.worker == "zinf-nvme":
        import zinf_compile

        zinf_compile.reset()
        options = {"budget": args.budget, "offload": "nvme", "offload_dir": args.offload_dir}
        options.update(_zinf_options(args.zinf_option or []))
        result["zinf_options"] = {k: v for k, v in options.items() if k != "offload_dir"}
        fn = torch.compile(model, backend="zinf", options=options)
    else:
        raise SystemExit(f"unknown contender {args.worker!r}; expected one of {', '.join(CONTENDERS)}")
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = fn(x)
        loss.backward()
        opt.step()
        return float(loss.detach())

    losses, times = [], []
    for _ in range(args.warmup):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    result["warmup_s"] = times[:]
    gc.collect()
    base = _rss.baseline()  # malloc_trim(0); VmRSS; reset VmHWM
    heap_at_base = _rss.mallinfo()
    step_s, hwm_after = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        losses.append(step())
        step_s.append(time.perf_counter() - t0)
        hwm_after.append(_rss.hwm())
    peak = _rss.hwm()
    heap_after = _rss.mallinfo()
    result.update(
        heap_at_baseline=heap_at_base,
        heap_after_steps=heap_after,
        baseline_rss=base,
        hwm=peak,
        growth=peak - base,
        growth_after_step=[h - base for h in hwm_after],
        rss_end=_rss.rss(),
        losses=losses,
        step_s=step_s,
    )
    if args.worker == "eager":  # after the measurement, so every contender's history is alike
        result["saved_activation_bytes"] = saved_activation_bytes(model, x)
    if args.worker == "zinf-nvme":
        import importlib

        import zinf_compile

        zstate = importlib.import_module("zinf_compile.runtime.state")

        plans = [p for p in zinf_compile.last_plans() if "forward" in p.graphs]
        result["plans"] = [_plan_summary(p) for p in plans]
        result["engine_stats"] = [dict(e.stats) for e in zstate.RUNTIME.engines.values()]
        result["swap_files_during_run"] = _files_under(args.offload_dir)
        result["swap_bytes_on_disk"] = _harness.disk_usage(args.offload_dir)
        del fn, model, opt
        gc.collect()
        zstate.close_all()
        result["files_left_after_close"] = _files_under(args.offload_dir)
    return result


# ------------------------------------------------------------------------------------------------
# parent: run the contenders alternately, each in a fresh process; table, JSON, picture
# ------------------------------------------------------------------------------------------------
def _run_worker(name: str, args, env_extra: dict) -> dict:
    argv = ["--steps", str(args.steps), "--budget", args.budget, *_harness.as_argv(args, DEFAULTS)]
    if name == "zinf-nvme":
        for opt in args.zinf_option or []:
            argv += ["--zinf-option", opt]
    res = _harness.run("bench.memory", name, argv, int(args.timeout), args.threads, env_extra=env_extra)[0]
    # the worker has exited: its swap folder must be empty (zinf removes its files at close / exit)
    res["files_left_after_exit"] = res.pop("files_left")
    return res


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(runs: list[dict], budget: int) -> dict:
    out = {}
    for name in CONTENDERS:
        rs = [r for r in runs if r["contender"] == name]
        if not rs:
            continue
        growth = [r["growth"] for r in rs]
        step = [s for r in rs for s in r["step_s"]]
        out[name] = {
            "runs": len(rs),
            "growth_median": _median(growth),
            "growth_min": min(growth),
            "growth_max": max(growth),
            "ratio_median": _median(growth) / budget,
            "ratio_max": max(growth) / budget,
            "baseline_rss_median": _median([r["baseline_rss"] for r in rs]),
            "step_s_median": _median(step),
            "final_loss": rs[0]["losses"][-1],
        }
    ind = out.get("inductor", {}).get("step_s_median")
    for v in out.values():
        v["time_vs_inductor"] = v["step_s_median"] / ind if ind else None
    return out


def _fmt_table(summary: dict, budget: int, saved: int, env_note: str) -> str:
    rows = [("contender", "growth MiB", "min..max MiB", "growth/budget", "step s", "vs inductor",
             "baseline MiB", "final loss")]
    for name, s in summary.items():
        rows.append((
            name,
            f"{s['growth_median'] / MiB:.1f}",
            f"{s['growth_min'] / MiB:.1f}..{s['growth_max'] / MiB:.1f}",
            f"{s['ratio_median']:.2f}x",
            f"{s['step_s_median']:.2f}",
            f"{s['time_vs_inductor']:.2f}x" if s["time_vs_inductor"] else "-",
            f"{s['baseline_rss_median'] / MiB:.0f}",
            f"{s['final_loss']:.6g}",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    head = (f"budget {budget / MiB:.1f} MiB; saved activations {saved / MiB:.1f} MiB "
            f"= {saved / budget:.2f}x the budget; {env_note}")
    return head + "\n" + "\n".join(lines)


def _draw(summary: dict, budget: int, path: str, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    names = list(summary)
    vals = [summary[n]["growth_median"] / MiB for n in names]
    lo = [(summary[n]["growth_median"] - summary[n]["growth_min"]) / MiB for n in names]
    hi = [(summary[n]["growth_max"] - summary[n]["growth_median"]) / MiB for n in names]
    colors = ["#2a9d8f" if n.startswith("zinf") else "#8d99ae" for n in names]
    spread = any(summary[n]["runs"] > 1 for n in names)
    bars = ax.bar(names, vals, color=colors, yerr=[lo, hi] if spread else None, capsize=4)
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f} MiB\n{v * MiB / budget:.2f}x",
                ha="center", va="bottom", fontsize=8)
    ax.axhline(budget / MiB, color="#e76f51", ls="-", lw=1.2, label=f"budget {budget / MiB:.0f} MiB")
    ax.axhline(ZINF_LIMIT * budget / MiB, color="#e76f51", ls="--", lw=1.2,
               label=f"{ZINF_LIMIT}x budget")
    ax.set_ylabel("peak RSS growth over the measured steps (MiB)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, max(vals + [ZINF_LIMIT * budget / MiB]) * 1.25)
    ax.legend(fontsize=8, loc="upper left", frameon=False)
    fig.savefig(path + ".tmp", format="png")
    os.replace(path + ".tmp", path)


def _env_for_workers(args) -> tuple[dict, dict]:
    """(what the workers' environment gets set, what of it changes the measurement: the record)."""
    extra = {}
    chosen = DEFAULT_MALLOC_ENV if args.malloc_env is None else args.malloc_env
    for kv in chosen:
        if kv.lower() in ("none", "default", ""):
            continue
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise SystemExit(f"--malloc-env: expected KEY=VALUE or 'none', got {kv!r}")
        extra[k] = v
    env = dict(extra)
    # what the workers inherit besides: it changes the measurement, so it goes into the record
    extra.update({k: v for k, v in os.environ.items()
                  if (k.startswith("MALLOC_") or k == "GLIBC_TUNABLES") and k not in extra})
    return env, extra


def parent(args) -> int:
    from zinf_compile.units import parse_bytes

    budget = parse_bytes(args.budget)
    env, extra = _env_for_workers(args)
    names = [c for c in args.contenders.split(",") if c]
    if "eager" not in names:
        names.insert(0, "eager")  # eager measures the saved activations and is the reference
    done: dict[str, int] = {}

    def run_one(name: str) -> list[dict]:
        res = _run_worker(name, args, env)
        res["repeat"] = done[name] = done.get(name, -1) + 1
        print(f"  growth {res['growth'] / MiB:7.1f} MiB ({res['growth'] / budget:.2f}x budget), "
              f"steps {', '.join(f'{s:.2f}' for s in res['step_s'])} s", flush=True)
        return [res]

    t0 = time.perf_counter()
    runs = _harness.alternate(names, CONTENDERS, args.repeats, run_one)
    total = time.perf_counter() - t0
    saved = max(r["saved_activation_bytes"] for r in runs if r["contender"] == "eager")
    assert saved >= SAVED_FACTOR * budget, (
        f"the model's saved activations ({saved / MiB:.1f} MiB) are under {SAVED_FACTOR}x the budget "
        f"({budget / MiB:.1f} MiB): the benchmark would measure nothing; raise --layers/--batch")
    summary = summarize(runs, budget)
    env_note = ("malloc env: " + " ".join(f"{k}={v}" for k, v in extra.items())) if extra else "malloc env: glibc defaults"
    env_note += f"; {args.threads} threads; {args.steps} measured steps after {args.warmup} warm-up"
    table = _fmt_table(summary, budget, saved, env_note)
    print()
    print(table)

    checks = {}
    if "zinf-nvme" in summary:
        z = summary["zinf-nvme"]
        checks["zinf_within_1.25x_budget"] = z["ratio_max"] <= ZINF_LIMIT
        zr = [r for r in runs if r["contender"] == "zinf-nvme"]
        checks["zinf_swap_files_cleaned"] = all(not r["files_left_after_exit"] for r in zr)
        checks["zinf_used_swap_files"] = all(r["swap_files_during_run"] for r in zr)
        p = zr[0]["plans"][0] if zr[0].get("plans") else None
        if p:
            print(f"\nzinf plan (training): peak {p['peak_before'] / MiB:.1f} -> {p['peak_after'] / MiB:.1f} MiB, "
                  f"lower bound {p['lower_bound'] / MiB:.1f} MiB, live at start {p['live_at_start'] / MiB:.1f} MiB, "
                  f"actions {p['action_counts']}, offloaded {p['offloaded_bytes'] / MiB:.1f} MiB per step; "
                  f"predicted growth over the step's start {(p['peak_after'] - p['live_at_start']) / MiB:.1f} MiB")
        print(f"zinf swap folder: {len(zr[0]['swap_files_during_run'])} entries during the run "
              f"({zr[0]['swap_bytes_on_disk'] / MiB:.1f} MiB on disk), "
              f"{len(zr[0]['files_left_after_exit'])} left after exit")
    if "eager" in summary:
        checks["eager_over_2x_budget"] = summary["eager"]["growth_min"] / budget > EAGER_FLOOR
    eager_losses = next(r["losses"] for r in runs if r["contender"] == "eager")
    checks["losses_match_eager"] = all(
        all(abs(a - b) <= 1e-3 * max(abs(b), 1e-12) for a, b in zip(r["losses"], eager_losses)) for r in runs)
    checks[f"saved_activations_at_least_{SAVED_FACTOR:g}x_budget"] = saved >= SAVED_FACTOR * budget
    print("\nchecks: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in checks.items()))
    print(f"total {total:.0f} s")

    os.makedirs(args.out, exist_ok=True)
    record = {
        "benchmark": "memory",
        "command": "python -m bench memory " + " ".join(args.argv),
        "budget": budget,
        "saved_activation_bytes": saved,
        "model": {k: getattr(args, k) for k in DEFAULTS},
        "steps": args.steps,
        "repeats": args.repeats,
        "malloc_env": extra,
        "threads": args.threads,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": _torch_version(), "glibc": _glibc()},
        "summary": summary,
        "checks": checks,
        "table": table,
        "runs": runs,
        "total_s": total,
    }
    json_path = os.path.join(args.out, "memory.json")
    with open(json_path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(json_path + ".tmp", json_path)
    png = os.path.join(args.out, "memory.png")
    malloc = " ".join(f"{k}={v}" for k, v in extra.items()) or "glibc defaults"
    _draw(summary, budget, png,
          f"MLP {args.layers}x{args.hidden}, batch {args.batch}: saved activations "
          f"{saved / MiB:.0f} MiB ({saved / budget:.1f}x budget)\n"
          f"median of {args.repeats} run(s) x {args.steps} steps; malloc: {malloc}")
    print(f"wrote {json_path} and {png}")
    return 0 if all(checks.values()) else 1


def _torch_version() -> str:
    import torch

    return torch.__version__


def _glibc() -> str:
    from bench import _rss

    return _rss.glibc_version()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="measured steps after warm-up (default 3)")
    p.add_argument("--budget", default="64MiB", help="zinf's device memory budget (default 64MiB)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each contender, alternating (default 1)")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="where memory.json/.png go")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset")
    p.add_argument("--malloc-env", action="append", default=None, metavar="KEY=VALUE",
                   help="environment for every worker alike (repeatable); default "
                        f"{' '.join(DEFAULT_MALLOC_ENV)}; 'none' = glibc's defaults")
    p.add_argument("--timeout", type=float, default=600, help="seconds per worker")
    p.add_argument("--zinf-option", action="append", default=None, metavar="KEY=VALUE",
                   help="an extra zinf option, e.g. malloc_mmap_threshold=0 (repeatable)")
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k}", type=type(v), default=v, help=f"(default {v})")
    p.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    p.add_argument("--offload-dir", dest="offload_dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.worker:
        return _harness.run_worker(args, worker, needs_dir=args.worker == "zinf-nvme")
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
