"""Partitioned parameters, measured: memory per rank and step time with parameters, gradients and
AdamW states on NVMe, against everything resident.

    python -m bench params [--layers 6] [--hidden 4096] [--batch 512] [--budget 320MiB]
                           [--steps 2] [--repeats 1] [--contenders auto] [--device auto]

An MLP of `layers` square Linear layers (GELU between, MSE loss) is trained with AdamW by each
contender, each in fresh processes, alternately:

    resident       torch.compile(model) (Inductor) + torch.optim.AdamW: everything in memory
    zinf-nvme      backend="zinf", options={"budget": B, "offload": "nvme", "offload_dir": <tmp>}
                   + zinf_compile.optimizer(model, AdamW): the planner shards parameters to NVMe
                   because they do not fit; gradients and AdamW states live there too
    zinf-nvme-2r   the same under torchrun --nproc-per-node 2 (gloo), the global batch split
    zinf-nvme-ib   zinf-nvme with zinf_compile.optimizer(..., step_in_backward=True): each NVMe
                   parameter stepped in the backward, on the optimizer's worker thread, as soon as
                   its gradient is whole (the gradient never reaches its file); in "auto" for the
                   GPT (bench training), nameable for the MLP
    zinf-cpu       the CPU tier instead (a contender on a GPU; on a CPU device it frees nothing)

Memory: every process reads VmRSS after its imports, before the model exists (`base`), then builds,
compiles and warms up (`held` = VmRSS then - base: compiled code and whatever the contender keeps
resident between steps), resets VmHWM and runs the measured steps (`growth` = VmHWM - VmRSS after
warm-up: the steps' working memory). Inductor's compile alone holds ~170 MiB on this machine, the
same for both contenders, so the checks separate it out:
  - zinf-nvme's growth <= 1.25 x budget, while parameters + gradients + AdamW states >= 4 x budget;
  - zinf-nvme holds at least 90% less of the model's data than resident between steps (`held`, same
    run; resident holds parameters + AdamW's two states there, its gradients freed by zero_grad):
    the data is in the files, not in memory;
  - per-rank shard bytes halve with 2 ranks.

Speed: the step-time ratio zinf-nvme / resident (median of the measured steps, same run), and the
bound max(compute, transfer): compute = the resident step time, transfer = the bytes zinf moved to
and from its files per step / the read and write bandwidths measured in the same run, in the same
folder (page cache included, as zinf sees it: files are not opened with O_DIRECT by default).

On a GPU (`--device auto`, the default, picks CUDA where torch sees one; `--device cpu` forces the
CPU) the model and its inputs live on the device and memory is torch's allocator instead:
`base` = torch.cuda.memory_allocated() before the model exists, `held` after the warm-up, the peak
= max_memory_allocated() over the measured steps (reset after the warm-up); the process's host RSS
peak is kept beside it. There the plan covers everything the allocator holds, so each zinf
contender's peak is checked against 1.25x the budget, and the CPU tier (`zinf-cpu`) frees device
memory and is a contender. Ranks use NCCL there (one GPU a rank).

Writes <out>/params.json and <out>/params.png; exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench import _harness

MiB = 2**20
CONTENDERS = ("resident", "zinf-nvme", "zinf-nvme-2r", "zinf-cpu", "zinf-nvme-ib")
LIMIT = 1.25
STATE_FACTOR = 4.0
DEFAULTS = dict(model="mlp", layers=6, hidden=4096, batch=512, seq=256, heads=16, vocab=8192, steps=2, warmup=1,
                threads=2, seed=0, lr=1e-4, device="auto")


def _build(args, device: str = "cpu"):
    """(model, inputs, loss(fn, *inputs)) of `args.model` on `device`: "mlp" (square Linear layers,
    GELU, MSE against a random target) or "gpt" (examples/gpt.py: embeddings, attention blocks, head)."""
    import torch
    from torch import nn

    if args.model == "gpt":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
        from gpt import build

        model, inputs = build(batch=args.batch, seq=args.seq, layers=args.layers, hidden=args.hidden,
                              heads=args.heads, vocab=args.vocab, seed=args.seed, device=device)
        return model, inputs, lambda fn, idx, tgt: fn(idx, tgt).loss
    torch.manual_seed(args.seed)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden), nn.GELU()]
    model = nn.Sequential(*layers).to(device)
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.batch, args.hidden, generator=g).to(device)
    y = torch.randn(args.batch, args.hidden, generator=g).to(device)
    return model, (x, y), lambda fn, x, y: torch.nn.functional.mse_loss(fn(x), y)


def worker(args) -> dict:
    import gc

    import torch
    import torch.distributed as dist

    from bench import _rss

    dev = _harness.device(args.device)
    cuda = dev.startswith("cuda")
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if cuda and distributed:  # one GPU a rank, chosen before NCCL starts
        dev = f"cuda:{int(os.environ.get('LOCAL_RANK', 0)) % torch.cuda.device_count()}"
    if cuda:
        torch.cuda.set_device(dev)
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.set_num_threads(args.threads)
    import zinf_compile  # noqa: F401  (imported before the baseline, like torch)

    meter = _harness.Meter(dev)
    gc.collect()
    _rss.trim()
    base, host_base = meter.now(), _rss.rss()
    model, inputs, loss_of = _build(args, dev)
    inputs = tuple(t.chunk(world)[rank] for t in inputs)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if args.worker == "resident":
        fn = torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    else:
        tier = "cpu" if args.worker == "zinf-cpu" else "nvme"
        options = {"budget": args.budget, "offload": tier, "offload_dir": args.offload_dir}
        fn = torch.compile(model, backend="zinf", options=options)
        opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=args.lr,
                                     step_in_backward=args.worker == "zinf-nvme-ib")

    def step() -> float:
        loss = loss_of(fn, *inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    m = _harness.measure_steps(step, args.warmup, args.steps, meter)
    peak = m["peak"]
    from zinf_compile.runtime.state import STORE

    result = dict(contender=args.worker, rank=rank, world=world, device=dev, base=base, **m, peak_over_base=peak - base,
                  host_peak_over_base=meter.host_peak() - host_base,
                  param_bytes=param_bytes, shard_bytes=sum(e.shard_nbytes for e in STORE.entries()),
                  managed=len(STORE))
    if args.worker != "resident":
        plans = [p for p in zinf_compile.last_plans() if "forward" in p.graphs]
        if plans:
            p = plans[-1]
            result["plan"] = dict(budget=p.budget, peak_before=p.peak_before, peak_after=p.peak_after,
                                  lower_bound=p.lower_bound, actions=p.action_counts(), params=len(p.params))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return result


def _bandwidth(folder: str, mib: int = 256) -> dict:
    """Write then read `mib` MiB with positional I/O in 16 MiB chunks in `folder` (as zinf does)."""
    import numpy as np

    path = tempfile.mkdtemp(prefix="bw-", dir=folder)
    f = os.path.join(path, "probe.bin")
    data = np.random.default_rng(0).integers(0, 255, mib << 20, dtype=np.uint8)
    chunk = 16 << 20
    try:
        fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o600)
        t0 = time.perf_counter()
        for off in range(0, len(data), chunk):
            os.pwrite(fd, memoryview(data[off:off + chunk]), off)
        w = len(data) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for off in range(0, len(data), chunk):
            os.preadv(fd, [memoryview(data[off:off + chunk])], off)
        r = len(data) / (time.perf_counter() - t0)
        os.close(fd)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return {"write_Bps": w, "read_Bps": r}


def _run(name: str, args) -> list[dict]:
    """Contender `name` in fresh processes: the -2r ones as zinf-nvme on two ranks (torchrun)."""
    two = name.endswith("-2r")
    return _harness.run("bench.params", name, ["--budget", args.budget, *_harness.as_argv(args, DEFAULTS)],
                        args.timeout, args.threads, worker=name[:-3] if two else name, ranks=2 if two else 1)


def _contenders(args) -> str:
    """--contenders, where "auto" is: resident and NVMe (one and two ranks) on a CPU, where the CPU
    tier is the same RAM; on CUDA the CPU tier too, and two ranks where there are two GPUs. Two
    ranks for the MLP only: `bench training` (the GPT) compares tiers, not ranks."""
    if args.contenders != "auto":
        return args.contenders
    two = "zinf-nvme-2r" if args.model == "mlp" else ""
    ib = ["zinf-nvme-ib"] if args.model == "gpt" else []
    if _harness.device(args.device).startswith("cuda"):
        import torch

        return ",".join(["resident", "zinf-cpu", "zinf-nvme"] + ib +
                        ([two] if two and torch.cuda.device_count() > 1 else []))
    return ",".join(["resident", "zinf-nvme"] + ib + ([two] if two else []))


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def parent(args) -> int:
    from zinf_compile.units import parse_bytes

    budget = parse_bytes(args.budget)
    names = [n for n in _contenders(args).split(",") if n]
    if _harness.device(args.device).startswith("cuda") and any(n.endswith("-2r") for n in names):
        import torch

        if torch.cuda.device_count() < 2:
            raise SystemExit("the -2r contenders need two GPUs (NCCL: one GPU a rank); this machine has "
                             f"{torch.cuda.device_count()}")
    bws: list[dict] = []
    runs = _harness.alternate(names, CONTENDERS, args.repeats, lambda n: _run(n, args),
                              lambda: bws.append(_bandwidth(tempfile.gettempdir())))
    summary = {}
    for n in names:
        rs = [x for x in runs if x["contender"] == n]
        summary[n] = dict(
            ranks=max(x["world"] for x in rs),
            growth_max=max(x["peak"] - x["held_after_warmup"] for x in rs),
            held_median=_median([x["held_after_warmup"] - x["base"] for x in rs]),
            peak_over_base_max=max(x["peak_over_base"] for x in rs),
            peak_over_base_median=_median([x["peak_over_base"] for x in rs]),
            step_s=_median([s for x in rs for s in x["step_s"]]),
            shard_bytes_per_rank=_median([x["shard_bytes"] for x in rs]),
            moved_per_step=_median([sum(x["moved_per_step"].values()) for x in rs]),
            read_per_step=_median([x["moved_per_step"]["read"] for x in rs]),
            written_per_step=_median([x["moved_per_step"]["written"] for x in rs]),
            final_loss=rs[0]["losses"][-1], files_left=sorted({f for x in rs for f in x["files_left"]}),
        )
    params = runs[0]["param_bytes"]
    states = 4 * params  # parameters + gradients + AdamW's two states, fp32
    bw = {k: _median([b[k] for b in bws]) for k in ("read_Bps", "write_Bps")}
    checks = {"states_vs_budget": states / budget, "states_at_least_4x_budget": states >= STATE_FACTOR * budget}
    cuda = runs[0].get("device", "cpu").startswith("cuda")
    for n in names:  # on CUDA the allocator sees only tensors: everything on the device is the plan's
        if cuda and n.startswith("zinf"):
            k = n.replace("-", "_")
            checks[f"{k}_peak_vs_budget"] = summary[n]["peak_over_base_max"] / budget
            checks[f"{k}_peak_within_1.25x_budget"] = summary[n]["peak_over_base_max"] <= LIMIT * budget
    if "zinf-nvme" in summary:
        z = summary["zinf-nvme"]
        checks["zinf_growth_vs_budget"] = z["growth_max"] / budget
        checks["zinf_growth_within_1.25x_budget"] = z["growth_max"] <= LIMIT * budget
        if "resident" in summary:
            saved = summary["resident"]["held_median"] - z["held_median"]
            between_steps = 3 * params  # parameters + exp_avg + exp_avg_sq; gradients were set to None
            checks["held_saving_vs_resident_data"] = saved / between_steps
            checks["zinf_holds_90pct_less_data"] = saved >= 0.9 * between_steps
        checks["zinf_left_no_files"] = not z["files_left"]
        if "resident" in summary:
            comp = summary["resident"]["step_s"]
            transfer = z["read_per_step"] / bw["read_Bps"] + z["written_per_step"] / bw["write_Bps"]
            checks["speed"] = dict(ratio_vs_resident=z["step_s"] / comp, compute_s=comp, transfer_s=transfer,
                                   bound_s=max(comp, transfer), ratio_vs_bound=z["step_s"] / max(comp, transfer))
    if "zinf-nvme-ib" in summary:
        ib = summary["zinf-nvme-ib"]
        checks["zinf_nvme_ib_growth_vs_budget"] = ib["growth_max"] / budget
        checks["zinf_nvme_ib_growth_within_1.25x_budget"] = ib["growth_max"] <= LIMIT * budget
        if "zinf-nvme" in summary:
            z = summary["zinf-nvme"]
            checks["speed_in_backward"] = dict(ratio_vs_zinf_nvme=ib["step_s"] / z["step_s"],
                                               moved_ratio_vs_zinf_nvme=ib["moved_per_step"] / z["moved_per_step"])
    if "zinf-cpu" in summary and "resident" in summary:  # on a CPU device that tier frees no memory
        checks["speed_cpu_tier"] = dict(ratio_vs_resident=summary["zinf-cpu"]["step_s"] / summary["resident"]["step_s"])
    if "zinf-nvme" in summary and "zinf-nvme-2r" in summary:
        one, two = summary["zinf-nvme"]["shard_bytes_per_rank"], summary["zinf-nvme-2r"]["shard_bytes_per_rank"]
        checks["shard_bytes_2r_vs_1r"] = two / one if one else None
        checks["shards_halve"] = bool(one) and abs(two / one - 0.5) < 0.01
    ok = all(v for k, v in checks.items() if isinstance(v, bool))
    record = dict(date=time.strftime("%Y-%m-%d"), machine=_machine(), args=vars(args), budget=budget,
                  device=runs[0].get("device", "cpu"), memory="torch.cuda max_memory_allocated" if cuda else "VmRSS",
                  param_bytes=params, states_bytes=states, bandwidth=bw, summary=summary, checks=checks,
                  runs=runs, ok=ok)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(record, f, indent=1)
    _draw(summary, budget, states, os.path.join(args.out, f"{args.name}.png"), cuda)
    print(_table(summary, budget, states, bw, checks))
    return 0 if ok else 1


def _machine() -> dict:
    import platform

    import torch

    out = {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
           "platform": platform.platform()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    from importlib import metadata

    for pkg in ("transformers", "accelerate"):  # bench inference's peers: pinned here, not on every machine
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def _table(summary, budget, states, bw, checks) -> str:
    lines = [f"budget {budget / MiB:.0f} MiB; parameters+gradients+AdamW states {states / MiB:.0f} MiB "
             f"= {states / budget:.1f}x the budget; files: read {bw['read_Bps'] / 1e9:.2f} GB/s, "
             f"write {bw['write_Bps'] / 1e9:.2f} GB/s",
             f"{'contender':14} {'ranks':>5} {'peak-base MiB':>14} {'held MiB':>9} {'growth MiB':>11} "
             f"{'x budget':>9} {'step s':>8} {'shard MiB/rank':>15} {'moved MiB/step':>15}"]
    for n, s in summary.items():
        lines.append(f"{n:14} {s['ranks']:>5} {s['peak_over_base_max'] / MiB:>14.0f} {s['held_median'] / MiB:>9.0f} "
                     f"{s['growth_max'] / MiB:>11.0f} {s['growth_max'] / budget:>9.2f} {s['step_s']:>8.2f} "
                     f"{s['shard_bytes_per_rank'] / MiB:>15.0f} {s['moved_per_step'] / MiB:>15.0f}")
    sp = checks.get("speed")
    if sp:
        lines.append(f"zinf-nvme / resident step time {sp['ratio_vs_resident']:.2f}x; bound max(compute "
                     f"{sp['compute_s']:.2f} s, transfer {sp['transfer_s']:.2f} s) = {sp['bound_s']:.2f} s; "
                     f"zinf / bound {sp['ratio_vs_bound']:.2f}x")
    if "speed_in_backward" in checks:
        sib = checks["speed_in_backward"]
        lines.append(f"zinf-nvme-ib / zinf-nvme step time {sib['ratio_vs_zinf_nvme']:.2f}x, bytes moved "
                     f"{sib['moved_ratio_vs_zinf_nvme']:.2f}x")
    if "speed_cpu_tier" in checks:
        lines.append(f"zinf-cpu / resident step time {checks['speed_cpu_tier']['ratio_vs_resident']:.2f}x")
    lines.append("checks: " + ", ".join(f"{k}={v if not isinstance(v, float) else round(v, 3)}"
                                        for k, v in checks.items() if not k.startswith("speed")))
    return "\n".join(lines)


def _draw(summary, budget, states, path, cuda: bool = False) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    names = list(summary)
    held = [summary[n]["held_median"] / MiB for n in names]
    growth = [summary[n]["growth_max"] / MiB for n in names]
    ax.bar(names, held, color="#8d99ae", label="held between steps (compiled code, resident data)")
    bars = ax.bar(names, growth, bottom=held, color="#2a9d8f", label="growth during the steps")
    for b, h, g in zip(bars, held, growth):
        ax.text(b.get_x() + b.get_width() / 2, h + g, f"+{g:.0f} MiB\n({g * MiB / budget:.2f}x budget)",
                ha="center", va="bottom", fontsize=8)
    vals = [h + g for h, g in zip(held, growth)]
    for i, h in enumerate(held):  # the budget bounds the growth: drawn on top of what is held
        ax.hlines(h + budget / MiB, i - 0.45, i + 0.45, color="#e76f51", lw=1.4,
                  label=f"held + budget ({budget / MiB:.0f} MiB)" if i == 0 else None)
    ax.set_ylabel("peak of torch.cuda.max_memory_allocated (MiB)" if cuda else
                  "peak RSS over the empty process, per rank (MiB)")
    ax.set_title(f"params + grads + AdamW states {states / MiB:.0f} MiB = {states / budget:.1f}x budget", fontsize=9)
    ax.set_ylim(0, max(vals + [h + budget / MiB for h in held]) * 1.25)
    ax.legend(fontsize=8, loc="upper right", frameon=False)
    fig.savefig(path + ".tmp", format="png")
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None, prog: str = "params", defaults: dict | None = None) -> int:
    """`defaults`: other defaults (bench training: the GPT); `prog` names the outputs."""
    defaults = {**DEFAULTS, "budget": "320MiB", "contenders": "auto", **(defaults or {})}
    ap = argparse.ArgumentParser(prog=f"python -m bench {prog}", description=__doc__.split("\n")[0])
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k}", type=type(v), default=defaults[k])
    ap.add_argument("--budget", default=defaults["budget"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--contenders", default=defaults["contenders"],
                    help=f"some of {', '.join(CONTENDERS)}, or auto (what the device makes meaningful)")
    ap.add_argument("--name", default=prog, help="base name of the JSON and PNG written")
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--offload-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    served = _harness.serve(args, worker)
    return parent(args) if served is None else served


if __name__ == "__main__":
    sys.exit(main())
