"""Streamed inference: a ~1B-parameter Llama whose weights stream from the NVMe tier under a budget of
a quarter of them, against keeping them in memory and against accelerate's disk_offload.

    pip install -e '.[bench]'        # transformers and accelerate, pinned (not needed for the tests)
    python -m bench inference [--layers 22] [--budget-share 0.25] [--forwards 3] [--repeats 2]
                              [--contenders eager,inductor,zinf,accelerate]

The model is transformers' LlamaForCausalLM from a LlamaConfig (TinyLlama-1.1B's shape: hidden 2048,
MLP 5632, 22 layers, 32 heads, 4 KV heads, vocab 32000), randomly initialised (seeded; no download),
fp32, batch 1, sequence 128, no KV cache, under torch.no_grad. Each contender in a fresh process,
alternately:

    eager        the model in memory, eager PyTorch
    inductor     the model in memory, torch.compile (Inductor)
    zinf         torch.compile(backend="zinf", options={"budget": share x the weights, "offload": "nvme"}):
                 the planner shards the parameters that do not fit to NVMe files (params="auto") and
                 streams them back, each fetched ahead of its use
    zinf-stream  the same with params="offload": every weight streams, none stays resident
    zinf-stream-direct  the same with o_direct=True: shard files read past the page cache into
                 page-aligned buffers (what o_direct="auto" picks when the files outgrow the cache)
    zinf-stream-bf16  zinf-stream-direct with gather_dtype="bfloat16": each weight streams from a
                 bfloat16 copy of its float32 shard (half the bytes) and is widened for the fp32
                 forward; its logits are checked against eager's with the weights rounded to bf16
                 (the eager worker computes both)
    accelerate   accelerate.disk_offload(model, dir): every weight memory-mapped from files and loaded
                 by hooks right before its module runs (what a user short of memory would pick)

Each builds the model in memory first (as a user would), sets up, runs one warm-up forward (compiles),
resets VmHWM and times `forwards` forwards. Reports the median time per forward, the peak RSS over the
empty process during the timed forwards, the bytes read per forward, and the bound
max(compute, bytes zinf reads / read bandwidth), compute being the in-memory Inductor forward and the
bandwidth measured in the same run, in the same folder (page cache included, as zinf sees it).
Logits are checked against eager's.

Regimes (`--regimes warm,cold`, both by default): warm as above; cold drops the page cache before
each timed forward (`sync; echo 3 > /proc/sys/vm/drop_caches`: root), so every file read comes from
the disk; its bound uses the device's direct read bandwidth, `dd iflag=direct bs=16M` measured in
the same run, in the same folder. Results are reported side by side.

On a GPU (`--device auto` picks CUDA where torch sees one) the model runs there (accelerate's hooks
load each weight onto it) and memory is torch's allocator: max_memory_allocated over the timed
forwards, memory_allocated before the model for the base.

Writes <out>/inference.json and <out>/inference.png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from bench import _harness
from bench.params import _bandwidth, _machine, _median

MiB = 2**20
CONTENDERS = ("eager", "inductor", "zinf", "zinf-stream", "zinf-stream-direct", "zinf-stream-bf16", "accelerate")
DEFAULTS = dict(layers=22, hidden=2048, intermediate=5632, heads=32, kv_heads=4, vocab=32000, seq=128,
                forwards=3, threads=2, seed=0, budget_share=0.25, device="auto", cold=0)


def _model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=max(256, args.seq),
                      tie_word_embeddings=False, torch_dtype=torch.float32)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(args.seed + 1))
    return model, ids


def worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import accelerate  # noqa: F401  (every contender imports the same before the baseline)
    import transformers  # noqa: F401

    import zinf_compile
    from zinf_compile.runtime.state import RUNTIME

    dev = _harness.device(args.device)
    meter = _harness.Meter(dev)
    base = meter.now()  # after a gc (and a heap trim on a CPU)
    model, ids = _model(args)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(weights * args.budget_share)
    ids = ids.to(dev)
    if args.worker != "accelerate":
        model.to(dev)  # zinf takes the weights off the device at its compile
    if args.worker == "eager":
        fn = model
    elif args.worker == "inductor":
        fn = torch.compile(model)
    elif args.worker.startswith("zinf"):
        options = {"budget": budget, "offload": "nvme", "offload_dir": args.offload_dir}
        if args.worker.startswith("zinf-stream"):
            options["params"] = "offload"  # every weight streams, none stays resident
        if args.worker in ("zinf-stream-direct", "zinf-stream-bf16"):
            options["o_direct"] = True
        if args.worker == "zinf-stream-bf16":
            options["gather_dtype"] = "bfloat16"
        fn = torch.compile(model, backend="zinf", options=options)
    else:
        from accelerate import disk_offload

        fn = disk_offload(model, os.path.join(args.offload_dir, "accelerate"), execution_device=torch.device(dev))

    def forward():
        with torch.no_grad():
            out = fn(ids, use_cache=False).logits
        if meter.cuda:
            torch.cuda.synchronize()
        return out

    t0 = time.perf_counter()
    logits = forward()
    warm = time.perf_counter() - t0
    engines = _harness.engine_bytes()
    after_warmup = meter.baseline()
    times = []
    for _ in range(args.forwards):
        if args.cold and not _harness.drop_caches():
            raise SystemExit("the cold regime drops the page cache: it needs root")
        t0 = time.perf_counter()
        forward()
        times.append(time.perf_counter() - t0)
    peak = meter.peak()
    moved = {k: (v - engines.get(k, 0)) / args.forwards for k, v in _harness.engine_bytes().items()}
    direct = [e.direct for e in RUNTIME.engines.values() if e.tier == "nvme"]
    out = dict(contender=args.worker, device=dev, cold=bool(args.cold), o_direct=any(direct), base=base, held_after_warmup=after_warmup, peak=peak, peak_over_base=peak - base,
               forward_s=times, warmup_s=warm, weights=weights, budget=budget, moved_per_forward=moved,
               logits_head=logits.reshape(-1)[:4096].cpu().tolist(), logits_absmax=float(logits.abs().max()))
    if args.worker == "eager":  # the reference of zinf-stream-bf16: the same weights rounded to bfloat16
        from zinf_compile.planner import PERSIST_BYTES

        with torch.no_grad():  # what zinf manages (params="offload"): every parameter of PERSIST_BYTES or more
            for p in model.parameters():
                if p.numel() * p.element_size() >= PERSIST_BYTES:
                    p.copy_(p.to(torch.bfloat16).to(p.dtype))
        out["logits_head_bf16"] = forward().reshape(-1)[:4096].cpu().tolist()
    plans = zinf_compile.last_plans()
    if args.worker.startswith("zinf") and plans:
        out["plans"] = [dict(graphs=p.graphs, budget=p.budget, peak_before=p.peak_before, peak_after=p.peak_after,
                             lower_bound=p.lower_bound, params=len(p.params), actions=p.action_counts(),
                             tiles=len(p.tiles), predicted_compute_s=p.predicted_compute_s,
                             predicted_stall_s=p.predicted_stall_s) for p in plans]
        from zinf_compile.runtime.state import STORE

        out["managed_bytes"] = sum(e.nbytes for e in STORE.entries())
        out["managed"] = len(STORE)
    return out


def _run(name: str, args) -> list[dict]:
    # accelerate's files are its own to keep (and removed with the folder): count zinf's only
    runs = _harness.run("bench.inference", name, _harness.as_argv(args, DEFAULTS), args.timeout, args.threads,
                        count_files=name.startswith("zinf"))
    x = runs[0]
    print(f"  {_median(x['forward_s']):.2f} s per forward, peak-base {x['peak_over_base'] / MiB:.0f} MiB", flush=True)
    return runs


def parent(args) -> int:
    try:
        import accelerate  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"bench inference needs transformers and accelerate: pip install -e '.[bench]' ({e})")
    names = [n for n in args.contenders.split(",") if n]
    regimes = [r for r in args.regimes.split(",") if r]
    if set(regimes) - {"warm", "cold"}:
        raise SystemExit(f"--regimes: expected warm and/or cold, got {args.regimes!r}")
    if "cold" in regimes and not _harness.drop_caches():
        raise SystemExit("the cold regime drops the page cache before each forward: run as root, or --regimes warm")
    folder = tempfile.gettempdir()  # the disk the workers' swap folders are on
    out: dict = {}
    for regime in regimes:
        print(f"-- {regime} regime", flush=True)
        args.cold = int(regime == "cold")
        bws: list[dict] = []

        def measure_disk():
            bw = _bandwidth(folder, mib=512)
            bw["direct_read_Bps"] = (_harness.direct_read_bandwidth(folder, mib=512) or 0) * 1e6
            bws.append(bw)

        runs = _harness.alternate(names, CONTENDERS, args.repeats, lambda n: _run(n, args), measure_disk)
        bw = {k: _median([b[k] for b in bws]) for k in ("read_Bps", "write_Bps", "direct_read_Bps")}
        out[regime] = _summarise(names, runs, bw, regime)
    first = out[regimes[0]]
    weights, budget, cuda = first["weights"], first["budget"], first["cuda"]
    ok = all(v for r in out.values() for v in r["checks"].values() if isinstance(v, bool))
    record = dict(date=time.strftime("%Y-%m-%d"), machine=_machine(), args=vars(args), weights=weights,
                  device=first["device"], memory="torch.cuda max_memory_allocated" if cuda else "VmRSS",
                  budget=budget, regimes={k: {x: v[x] for x in ("bandwidth", "summary", "checks", "runs")}
                                          for k, v in out.items()}, ok=ok)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "inference.json"), "w") as f:
        json.dump(record, f, indent=1)
    _draw(out, weights, budget, os.path.join(args.out, "inference.png"), cuda)
    for regime, r in out.items():
        print(f"== {regime} ==")
        print(_table(r["summary"], r["checks"], weights, budget, r["bandwidth"], regime))
    return 0 if ok else 1


def _summarise(names, runs, bw, regime) -> dict:
    """One regime's runs: the medians per contender and the checks against the bound and
    accelerate. The bound's transfer is zinf's bytes read per forward over the read bandwidth the
    regime sees: the page cache's (warm) or the disk's direct read bandwidth (cold)."""
    eager = next((x for x in runs if x["contender"] == "eager"), None)
    summary = {}
    for n in names:
        rs = [x for x in runs if x["contender"] == n]
        diff, ref = None, None if eager is None else eager["logits_head_bf16" if n.endswith("-bf16") else "logits_head"]
        if ref is not None:
            diff = max(max(abs(a - b) for a, b in zip(x["logits_head"], ref)) for x in rs)
        summary[n] = dict(forward_s=_median([t for x in rs for t in x["forward_s"]]),
                          peak_over_base_max=max(x["peak_over_base"] for x in rs),
                          growth_max=max(x["peak"] - x["held_after_warmup"] for x in rs),
                          held_median=_median([x["held_after_warmup"] - x["base"] for x in rs]),
                          read_per_forward=_median([x["moved_per_forward"]["read"] for x in rs]),
                          warmup_s=_median([x["warmup_s"] for x in rs]), logits_max_diff_vs_eager=diff,
                          o_direct=rs[0].get("o_direct"), managed_bytes=rs[0].get("managed_bytes"),
                          plans=rs[0].get("plans"), files_left=sorted({f for x in rs for f in x["files_left"]}))
    weights, budget = runs[0]["weights"], runs[0]["budget"]
    cuda = runs[0].get("device", "cpu").startswith("cuda")
    read_bw = bw["direct_read_Bps"] if regime == "cold" else bw["read_Bps"]
    slack = 1.2 if regime == "cold" else 1.15
    checks: dict = {}
    for name in [n for n in names if n.startswith("zinf")]:
        z, k = summary[name], name.replace("-", "_")
        compute = summary["inductor"]["forward_s"] if "inductor" in summary else None
        transfer = z["read_per_forward"] / read_bw if read_bw else None
        if compute is not None and transfer is not None:
            bound = max(compute, transfer)
            checks.update({"compute_s": compute, f"{k}_transfer_s": transfer, f"{k}_bound_s": bound,
                           f"{k}_vs_bound": z["forward_s"] / bound,
                           f"{k}_within_{str(slack).replace('.', '_')}x_bound": z["forward_s"] <= slack * bound})
        if "accelerate" in summary:
            a = summary["accelerate"]
            checks.update({f"accelerate_vs_{k}": a["forward_s"] / z["forward_s"],
                           f"{k}_1_5x_faster_than_accelerate": a["forward_s"] >= 1.5 * z["forward_s"],
                           f"{k}_peak_not_above_accelerate": z["peak_over_base_max"] <= a["peak_over_base_max"]})
        if cuda:  # the allocator holds only tensors there: all of them the plan's
            checks[f"{k}_peak_vs_budget"] = z["peak_over_base_max"] / budget
            checks[f"{k}_peak_within_1_25x_budget"] = z["peak_over_base_max"] <= 1.25 * budget
        checks[f"{k}_logits_match_eager"] = z["logits_max_diff_vs_eager"] is not None and \
            z["logits_max_diff_vs_eager"] <= 1e-3 * max(1.0, runs[0]["logits_absmax"])
        checks[f"{k}_left_no_files"] = not z["files_left"]
    for x in runs:
        x.pop("logits_head", None)
        x.pop("logits_head_bf16", None)
    return dict(summary=summary, checks=checks, bandwidth=bw, runs=runs, weights=weights, budget=budget,
                cuda=cuda, device=runs[0].get("device", "cpu"))


def _table(summary, checks, weights, budget, bw, regime="warm") -> str:
    lines = [f"weights {weights / MiB:.0f} MiB (fp32), zinf budget {budget / MiB:.0f} MiB; files: read "
             f"{bw['read_Bps'] / 1e9:.2f} GB/s (page cache), {bw['direct_read_Bps'] / 1e9:.2f} GB/s (dd iflag=direct), "
             f"write {bw['write_Bps'] / 1e9:.2f} GB/s; bound read rate: "
             f"{'dd direct' if regime == 'cold' else 'page cache'}",
             f"{'contender':18} {'s/forward':>9} {'peak-base MiB':>14} {'held MiB':>9} {'growth MiB':>11} "
             f"{'read MiB/fwd':>13} {'logits diff':>11}"]
    for n, s in summary.items():
        d = s["logits_max_diff_vs_eager"]
        lines.append(f"{n:18} {s['forward_s']:>9.2f} {s['peak_over_base_max'] / MiB:>14.0f} "
                     f"{s['held_median'] / MiB:>9.0f} {s['growth_max'] / MiB:>11.0f} "
                     f"{s['read_per_forward'] / MiB:>13.0f} {'-' if d is None else f'{d:.1e}':>11}")
    for k in [n.replace("-", "_") for n in summary if n.startswith("zinf")]:
        if f"{k}_bound_s" in checks:
            lines.append(f"{k}: bound max(compute {checks['compute_s']:.2f} s, transfer {checks[k + '_transfer_s']:.2f} "
                         f"s) = {checks[k + '_bound_s']:.2f} s; {k} / bound {checks[k + '_vs_bound']:.2f}x")
        if f"accelerate_vs_{k}" in checks:
            lines.append(f"accelerate / {k} time per forward: {checks['accelerate_vs_' + k]:.2f}x")
    lines.append("checks: " + ", ".join(f"{k}={v}" for k, v in checks.items() if isinstance(v, bool)))
    return "\n".join(lines)


def _draw(regimes: dict, weights, budget, path, cuda: bool = False) -> None:
    """Seconds per forward and peak memory per contender, the regimes side by side."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 3.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax, bx = fig.subplots(1, 2)
    names = list(next(iter(regimes.values()))["summary"])
    width = 0.8 / len(regimes)
    shades = {"warm": "#2a9d8f", "cold": "#264653"}
    for j, (regime, r) in enumerate(regimes.items()):
        xs = [i + (j - (len(regimes) - 1) / 2) * width for i in range(len(names))]
        t = [r["summary"][n]["forward_s"] for n in names]
        p = [r["summary"][n]["peak_over_base_max"] / MiB for n in names]
        ax.bar(xs, t, width, color=shades.get(regime, "#8d99ae"), label=regime)
        bx.bar(xs, p, width, color=shades.get(regime, "#8d99ae"), label=regime)
        for x, v in zip(xs, t):
            ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=6)
        bound = r["checks"].get("zinf_stream_bound_s") or r["checks"].get("zinf_bound_s")
        if bound:
            ax.axhline(bound, color=shades.get(regime, "#8d99ae"), ls="--", lw=1,
                       label=f"{regime} bound max(compute, read)")
    for a in (ax, bx):
        a.set_xticks(range(len(names)), names, fontsize=6, rotation=20)
        a.legend(fontsize=6, frameon=False)
    ax.set_ylabel("seconds per forward (median)")
    bx.axhline(budget / MiB, color="#e76f51", ls="--", lw=1)
    bx.set_ylabel("peak torch.cuda.max_memory_allocated (MiB)" if cuda else "peak RSS over the empty process (MiB)")
    fig.suptitle(f"Llama, {weights / 2**30:.1f} GiB of fp32 weights, batch 1; page cache warm and dropped "
                 "before each forward (cold)", fontsize=8)
    fig.savefig(path + ".tmp", format="png")
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench inference", description=__doc__.split("\n")[0])
    _harness.add_options(ap, DEFAULTS)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--regimes", default="warm,cold", help="warm, cold (page cache dropped before each forward: root)")
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    ap.add_argument("--timeout", type=int, default=3600)
    args = ap.parse_args(argv)
    served = _harness.serve(args, worker)
    return parent(args) if served is None else served


if __name__ == "__main__":
    sys.exit(main())
