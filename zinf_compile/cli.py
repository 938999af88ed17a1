"""`zinf plan | show | calibrate`: plan offline, draw a plan, measure this machine."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from zinf_compile.errors import ZinfError


def _progress(msg: str) -> None:
    print(f"zinf: {msg}", file=sys.stderr, flush=True)


def cmd_plan(args: argparse.Namespace) -> int:
    from zinf_compile.capture import load_factory, parse_args, plan_offline
    from zinf_compile.cost import load_profile
    from zinf_compile.report import summary_rows, write_report
    from zinf_compile.units import format_bytes, parse_bytes

    t0 = time.perf_counter()
    profile = load_profile(args.target, "cpu")
    budget = parse_bytes(args.budget, "--budget") if args.budget else profile.capacity
    tier = args.offload if args.offload != "auto" else ("nvme" if profile.device == "cpu" else "cpu")
    factory = load_factory(args.factory)
    kwargs = parse_args(args.arg or [])
    params = args.params
    max_tile = parse_bytes(args.max_tile_bytes, "--max-tile-bytes") if args.max_tile_bytes else None
    tiling = "force" if max_tile else args.tiling
    _progress(f"capturing and planning {args.factory} {kwargs} under FakeTensorMode "
              f"({'inference' if args.inference else 'training'}) for {args.target}, budget "
              f"{args.budget or 'capacity'}, parameters {params}")
    result = plan_offline(factory, kwargs, budget, profile, tier, params=params, inference=args.inference,
                          device="cpu", tiling=tiling, max_tile_bytes=max_tile, gather_dtype=args.gather_dtype)
    plan = result.plan
    for note in plan.notes:
        if note.startswith(("parameters", "tiles")):
            _progress(note)
    planning = sum(result.seconds.values())
    t2 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    plan_path = os.path.join(args.out, "plan.json")
    plan.save(plan_path)
    files = write_report(plan, args.out, title=f"zinf plan: {args.factory} {kwargs}") if not args.no_report else {}
    t3 = time.perf_counter()
    rows = summary_rows(plan)
    if not plan.params:
        total = sum(p.nbytes for p in result.params)
        rows.append(("managed parameters", f"none ({len(result.params)} parameters, {format_bytes(total)}, "
                                           "stay resident)"))
    rows.append(("planning time", f"{planning:.2f} s for {len(plan.steps)} steps (passes and planner; "
                                  f"capture and planning {t2 - t0:.1f} s, report {t3 - t2:.1f} s)"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    print(f"wrote {plan_path}" + (f" and {files['html']}" if files else ""))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from zinf_compile.plan import Plan
    from zinf_compile.report import summary_rows, write_report

    plan = Plan.load(args.plan)
    out = args.out or os.path.dirname(os.path.abspath(args.plan))
    os.makedirs(out, exist_ok=True)
    files = write_report(plan, out, title=f"zinf plan: {os.path.basename(args.plan)}")
    for k, v in summary_rows(plan):
        print(f"  {k}: {v}")
    for kind, path in files.items():
        print(f"wrote {kind}: {path}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from zinf_compile.calibrate import calibrate
    from zinf_compile.cost import CALIBRATED_PATH

    out = args.out or CALIBRATED_PATH
    prof = calibrate(args.offload_dir, device=args.device, progress=_progress, mib=args.mib)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(prof.to_json(), f, indent=1)
    for k, v in prof.to_json().items():
        print(f"  {k}: {v:.3g}" if isinstance(v, float) else f"  {k}: {v}")
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zinf", description="ZeRO-Infinity as a compiler: plan, show, calibrate")
    sub = p.add_subparsers(dest="cmd", required=True)

    pl = sub.add_parser("plan", help="plan a model offline (FakeTensorMode: nothing is allocated)")
    pl.add_argument("factory", help="FILE.py:FN or MODULE:FN returning (model, example_inputs)")
    pl.add_argument("--arg", action="append", metavar="KEY=VALUE", help="keyword argument for the factory")
    pl.add_argument("--budget", help="device memory budget, e.g. 2GiB (default: the target's capacity)")
    pl.add_argument("--target", default="cpu", help="device profile: cpu, h100-80gb, h200, or a JSON path")
    pl.add_argument("--offload", default="auto", choices=["auto", "cpu", "nvme"])
    pl.add_argument("--params", default="auto", choices=["auto", "offload", "resident"],
                    help="parameters (ZeRO-3): 'auto' manages them when the plan does not fit with them resident "
                         "(largest first, then all), 'offload' always (those of 64 KiB or more), 'resident' never")
    pl.add_argument("--gather-dtype", choices=["bfloat16", "float16"],
                    help="managed parameters' gathers read a copy in this dtype (half the bytes of float32)")
    pl.add_argument("--tiling", default="auto", choices=["auto", "off"],
                    help="memory-centric tiling of managed weights too large to gather whole (default auto)")
    pl.add_argument("--max-tile-bytes", metavar="SIZE",
                    help="tile every managed weight larger than SIZE into tiles of at most SIZE (forces tiling)")
    pl.add_argument("--inference", action="store_true", help="plan the forward alone, without gradients")
    pl.add_argument("--out", default=".", help="where plan.json and report.html go (default: here)")
    pl.add_argument("--no-report", action="store_true", help="write plan.json only")
    pl.set_defaults(fn=cmd_plan)

    sh = sub.add_parser("show", help="draw a plan: timeline, lanes, annotated graph, HTML report")
    sh.add_argument("plan", help="a plan.json written by `zinf plan` or ZINF_DUMP_DIR")
    sh.add_argument("--out", help="where the pictures go (default: next to the plan)")
    sh.set_defaults(fn=cmd_show)

    ca = sub.add_parser("calibrate", help="measure this machine and write a device profile")
    ca.add_argument("--out", help="profile path (default: ~/.cache/zinf/profile-local.json, used by profile='auto')")
    ca.add_argument("--offload-dir", default=None, help="where to measure NVMe bandwidth (default: temp dir)")
    ca.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ca.add_argument("--mib", type=int, default=256, help="size of each copy and file transfer measured")
    ca.set_defaults(fn=cmd_calibrate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ZinfError as e:
        print(f"zinf: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
