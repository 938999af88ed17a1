"""The driver: every pass of a compile, in order, for training, inference and offline planning.

    training (AOT's joint graph)               inference (Inductor's post-grad graph)
    insert-gathers   every candidate parameter  insert-gathers
    reduce-grads
    partition        -> forward, backward
    drop-reduced-outputs
    sink-gathers                                sink-gathers
        analyse; planner A+B: managed parameters, tiles
    keep-resident    the others                 keep-resident
    allreduce-grads  (several ranks)
    tile-matmuls                                tile-matmuls
        analyse; planner C: fetches, activation moves, recomputes -> the Plan
    recompute        saved tensors rebuilt in backward
    insert-offloads                             insert-offloads
    fetch-ahead                                 fetch-ahead
    (pin-order runs later, in Inductor's post-grad hook, on each graph)

The backend's hooks and `zinf plan` call `compile_joint` / `compile_inference`; nothing else lists
passes. After every pass the driver lints the graphs, runs the verifier's invariants, times the
pass and (with ZINF_DUMP_DIR) dumps the graphs; after the last, the re-analysed peak must be within
the budget. A pass named in ZINF_DISABLE_PASSES is skipped (debugging only).
"""
from __future__ import annotations

import dataclasses
import linecache
import os
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch.fx as fx

from zinf_compile import records
from zinf_compile.analysis import analyze, graph_specs
from zinf_compile.analysis.facts import paused_gc
from zinf_compile.analysis.params import param_facts
from zinf_compile.cost import DeviceProfile, step_cost
from zinf_compile.ir import ParamMeta
from zinf_compile.plan import Plan
from zinf_compile.planner import (DeviceModel, decide_params, decide_tiles, make_plan, managed_floor,
                                  resident_timeline, tiled_ops)

Graphs = dict[str, fx.GraphModule]


@dataclass(frozen=True)
class Request:
    """Everything a compile's decisions depend on, as plain values."""

    profile: DeviceProfile
    model: DeviceModel
    budget: int | None = None  # bytes; None with `budget_fraction`
    budget_fraction: float | None = None  # a share of the graphs' peak with every parameter resident
    params_mode: str = "auto"
    # (placeholder index, meta, managed already) of each parameter zinf may manage
    candidates: tuple[tuple[int, ParamMeta, bool], ...] = ()
    allreduce: tuple[int, ...] = ()  # primal indices whose gradients are averaged if kept resident
    group: str | None = None  # the process group's name (several ranks)
    tiling: str = "auto"
    max_tile_bytes: int | None = None
    engine_key: int = 0
    verify: bool = True
    dump_dir: str | None = None
    disabled: frozenset[str] = frozenset()
    trace_device: str | None = None  # where the traced tensors are, when not the model's device (offline)
    codegen: bool = True  # regenerate each module's code after the passes (off offline: nothing runs them)


@dataclass
class Compiled:
    graphs: Graphs
    plan: Plan
    managed: frozenset[int]  # the pids the plan manages
    reports: list = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # per pass, and "analyse+plan"
    simulated_peak: int | None = None
    record: records.CompileRecord | None = None


class _Driver:
    def __init__(self, req: Request, nfo: int) -> None:
        from zinf_compile.passes import PassContext

        self.req = req
        self.ctx = PassContext(num_fwd_outputs=nfo, engine_key=req.engine_key)
        self.reports: list = []
        self.seconds: dict[str, float] = {}
        self.dumps: list[tuple[str, dict[str, str]]] = []
        self.source_mark = _source_mark()  # torch.fx's sources filed from here on are this compile's

    def run(self, graphs: Graphs, passes) -> None:
        from zinf_compile.passes.verifier import check_invariants

        for p in passes:
            if p.name in self.req.disabled:
                continue
            t0 = time.perf_counter()
            report = p.apply(graphs, self.ctx)
            for gm in graphs.values():
                gm.graph.lint()
            self.seconds[p.name] = self.seconds.get(p.name, 0.0) + time.perf_counter() - t0
            self.reports.append(report)
            if self.req.verify:
                check_invariants(graphs, self.ctx, p.name)
            if self.req.dump_dir:
                self.dumps.append((p.name, {r: gm.print_readable(print_output=False) for r, gm in graphs.items()}))

    def finish(self, graphs: Graphs) -> None:
        """The Python code of each module, once, after the last pass: passes read the graphs, not
        the code (regenerating it after every pass cost ~0.3 s per pass on a 4,700-node GPT, and
        once per batch of passes 8.8 of 113 s on a 128-layer one)."""
        t0 = time.perf_counter()
        for gm in graphs.values():
            recompile(gm)
        self.seconds["recompile"] = self.seconds.get("recompile", 0.0) + time.perf_counter() - t0

    def facts(self, graphs: Graphs):
        return analyze(graph_specs(graphs, self.ctx.num_fwd_outputs), device=self.req.trace_device or self.req.model.device,
                       step_cost=step_cost(self.req.profile))


# torch.fx keeps the source of every module it generates code for, for the life of the process (its
# _EvalCacheLoader and linecache, so tracebacks show the lines), under a name of its own,
# "<eval_with_key>.N[ from ...]" with N counting up; a content-addressed name (profiler metadata on)
# may be shared by other modules and is left alone. A compile's passes make modules that die with
# it (the partitioner's, records' copies) and regenerate code (`finish`): ~110 KiB of source per
# compile of a 2-layer GPT stayed after the model and its compile were gone (bench soak).
_EVAL_KEY = "<eval_with_key>."


def _eval_key_number(key) -> int | None:
    if not isinstance(key, str) or not key.startswith(_EVAL_KEY):
        return None
    n = key[len(_EVAL_KEY):].split(" ", 1)[0]
    return int(n) if n.isdigit() else None


def _fx_loader():
    """torch.fx's source store, or None where this torch has none of that shape: releasing sources
    is housekeeping, never a reason for a compile to fail (torch 2.11 on the GPU machines too)."""
    from torch.fx import graph_module

    loader = getattr(graph_module, "_loader", None)
    ok = isinstance(getattr(loader, "eval_cache", None), dict) and isinstance(getattr(loader, "next_id", None), int)
    return loader if ok else None


def _source_mark() -> int | None:
    loader = _fx_loader()
    return None if loader is None else loader.next_id


def _source_key(gm: fx.GraphModule) -> str | None:
    """The name torch.fx filed the source of `gm`'s current code under, if one of its own."""
    fwd = type(gm).__dict__.get("forward")
    key = getattr(getattr(fwd, "__code__", None), "co_filename", None)
    return key if _eval_key_number(key) is not None else None


def _forget_source(key: str) -> None:
    loader = _fx_loader()
    if loader is not None:
        loader.eval_cache.pop(key, None)
    linecache.cache.pop(key, None)


def release_source(gm: fx.GraphModule) -> None:
    """The source of `gm`'s current code goes when `gm` does."""
    key = _source_key(gm)
    if key is not None:
        weakref.finalize(gm, _forget_source, key).atexit = False


def forget_sources_since(mark: int | None, live) -> None:
    """Forget the sources torch.fx filed since `mark` (`_source_mark()`), but those of the modules
    in `live`, tied to their lives instead. The others belong to modules the compile made and
    dropped, or to code a module replaced: nothing runs them again (a frame of one that does runs
    as before; a traceback shows no lines for it)."""
    loader = _fx_loader()
    if loader is None or mark is None:
        return
    keep = set()
    for gm in live:
        release_source(gm)
        keep.add(_source_key(gm))
    for key in [k for k in list(loader.eval_cache) if k not in keep]:
        n = _eval_key_number(key)
        if n is not None and n >= mark:
            _forget_source(key)


def recompile(gm: fx.GraphModule) -> None:
    """gm.recompile(), forgetting the source of the code it replaces (no graph runs that code again)."""
    old = _source_key(gm)
    gm.recompile()
    if old is not None and old != _source_key(gm):
        _forget_source(old)


def _forget_zinf_fake_dispatch() -> None:
    """Drop the entries FakeTensorMode's dispatch cache (class-wide, never cleared) holds for zinf's
    ops: their arguments carry a compile's constants (parameter ids, engine key, tickets), so an
    entry never serves a later compile; ~18 per compile of a 2-layer GPT otherwise stay forever.
    Run when a compile starts: the entries of the compile before it go."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache = getattr(FakeTensorMode, "cache", None)
    if not isinstance(cache, dict):
        return  # a torch without that cache (housekeeping only, as _fx_loader)

    def zinf_op(k) -> bool:
        key = getattr(k, "key", None)
        return isinstance(key, tuple) and bool(key) and getattr(key[0], "namespace", None) == "zinf"

    for k in [k for k in list(cache) if zinf_op(k)]:
        cache.pop(k, None)


@paused_gc  # the passes and the partitioner make many small objects; a collection walks every graph node
def compile_joint(joint: fx.GraphModule, joint_inputs, kwargs: dict, partition_fn: Callable, req: Request) -> Compiled:
    """AOT's joint graph -> planned forward and backward graphs."""
    from zinf_compile.passes import DropReducedOutputs, InsertGathers, ReduceGrads, SinkGathers, partition_pass

    _forget_zinf_fake_dispatch()
    d = _Driver(req, kwargs["num_fwd_outputs"])
    graphs: Graphs = {"joint": joint}
    cands = tuple((i, m) for i, m, _ in req.candidates)
    d.run(graphs, [InsertGathers(cands, recompute=True, world=req.model.world, group=req.group),
                   ReduceGrads(cands, world=req.model.world, group=req.group),
                   partition_pass(partition_fn, joint_inputs, kwargs),
                   *([DropReducedOutputs()] if cands else []), SinkGathers()])
    return _plan_and_apply(d, graphs)


@paused_gc
def compile_inference(gm: fx.GraphModule, req: Request) -> Compiled:
    """An inference graph, planned in place."""
    from zinf_compile.passes import InsertGathers, SinkGathers

    _forget_zinf_fake_dispatch()
    d = _Driver(req, -1)
    graphs: Graphs = {"inference": gm}
    cands = tuple((i, dataclasses.replace(m, requires_grad=False)) for i, m, _ in req.candidates)
    d.run(graphs, [InsertGathers(cands, world=req.model.world, group=req.group), SinkGathers()])
    return _plan_and_apply(d, graphs)


def _plan_and_apply(d: _Driver, graphs: Graphs) -> Compiled:
    from zinf_compile.passes import AllReduceGrads, FetchAhead, InsertOffloads, KeepResident, Recompute, TileMatmuls
    from zinf_compile.passes.tiling import merged_candidates, split_bounds
    from zinf_compile.passes.verifier import check_budget

    req = d.req
    t0 = time.perf_counter()
    facts = d.facts(graphs)
    pfacts = param_facts(facts, req.model.world)
    budget = req.budget
    if req.budget_fraction is not None or budget is None:
        budget = int(resident_timeline(facts, pfacts).max() * (req.budget_fraction or 1.0))
    forced = frozenset(m.pid for _, m, already in req.candidates if already)
    managed = decide_params(facts, pfacts, budget, req.params_mode, forced)
    decisions = [_params_decision(facts, pfacts, managed, forced, budget, req.params_mode)] if pfacts else []
    counts: dict[int, int] = {}
    tiles = ()
    if managed and req.model.world == 1 and req.tiling != "off":
        kept = {pid: pf for pid, pf in pfacts.items() if pid in managed}
        cands = {pid: c for pid, c in merged_candidates(gm for gm in graphs.values()).items() if pid in managed}
        floor = managed_floor(facts, pfacts, managed)
        counts = decide_tiles(facts, floor, budget, cands, kept, req.profile, req.model.tier, req.tiling,
                              req.max_tile_bytes)
        tiles = tiled_ops(cands, counts, {gm.graph: role for role, gm in graphs.items()})
    d.seconds["decide"] = time.perf_counter() - t0
    resident = frozenset(pfacts) - managed
    allreduce = tuple(sorted(set(req.allreduce) | {i for i, m, _ in req.candidates
                                                   if m.pid in resident and m.requires_grad}))
    d.run(graphs, [KeepResident(resident),
                   *([AllReduceGrads(allreduce, req.model.world, req.group)]
                     if req.model.world > 1 and "backward" in graphs else []),
                   TileMatmuls(tuple((pid, tuple(split_bounds(cands[pid].rows, n))) for pid, n in sorted(counts.items())))
                   if counts else TileMatmuls()])
    t0 = time.perf_counter()
    facts = d.facts(graphs)
    pfacts = {pid: pf for pid, pf in param_facts(facts, req.model.world).items() if pid in managed}
    plan = make_plan(facts, budget, req.profile, req.model.tier, device=req.model.device, params=pfacts,
                     model=req.model, tiles=tiles)
    if req.trace_device and req.trace_device != req.model.device:
        plan = dataclasses.replace(plan, notes=(*plan.notes, f"traced on {req.trace_device}, planned for "
                                                             f"{req.profile.name}"))
    if counts:
        decisions.append(f"tiles: {len(counts)} weight(s) tiled ({', '.join(f'{pfacts[p].name} x{n}' for p, n in sorted(counts.items()))})")
    plan = dataclasses.replace(plan, notes=(*decisions, *plan.notes))
    d.seconds["plan"] = time.perf_counter() - t0
    d.ctx.plan, d.ctx.facts = plan, facts
    d.run(graphs, [*([Recompute()] if plan.recomputes() else []), InsertOffloads(),
                   FetchAhead(req.model.fetch_holds_memory)])
    if req.codegen:
        d.finish(graphs)
    peak = check_budget(graphs, d.ctx, plan) if req.verify else None
    if not req.model.frees_device and plan.moves():
        warnings.warn("zinf: offload='cpu' on a CPU device frees no memory (the tensors stay in the same "
                      "RAM); the plan still runs. Use offload='nvme' to lower the peak.", stacklevel=2)
    out = Compiled(graphs, plan, managed, d.reports, d.seconds, peak)
    if req.engine_key or req.dump_dir:
        out.record = records.add(plan, d.reports, graphs, peak)
        if req.dump_dir:
            _dump(req.dump_dir, out.record, d)
    forget_sources_since(d.source_mark, [*graphs.values(), *(out.record.graphs.values() if out.record else ())])
    return out


def _params_decision(facts, pfacts, managed, forced, budget: int, mode: str) -> str:
    """One line saying which parameters the planner manages, and why."""
    from zinf_compile.units import format_bytes

    floor = int(managed_floor(facts, pfacts, frozenset(forced)).max()) if len(facts.steps) else 0
    what = f"{len(managed)} of {len(pfacts)} candidate parameter(s) managed"
    if mode != "auto":
        return f"parameters ({mode}): {what}"
    if not managed - forced:
        return f"parameters (auto): all resident fit (floor {format_bytes(floor)} <= budget {format_bytes(budget)})"
    return (f"parameters (auto): all resident need {format_bytes(floor)} > budget {format_bytes(budget)}; {what}, "
            "largest first")


def _dump(dump_dir: str, rec, d: _Driver) -> None:
    folder = os.path.join(dump_dir, f"compile-{os.getpid()}-{rec.index:03d}")
    os.makedirs(folder, exist_ok=True)
    rec.plan.save(os.path.join(folder, "plan.json"))
    for i, (name, texts) in enumerate(d.dumps):
        for role, text in texts.items():
            with open(os.path.join(folder, f"{i:02d}-{name}.{role}.txt"), "w") as f:
                f.write(text)
    with open(os.path.join(folder, "passes.txt"), "w") as f:
        for name, s in d.seconds.items():
            f.write(f"{name}: {s:.4f} s\n")
        for r in d.reports:
            f.write(f"{r}\n" + "".join(f"  {c}\n" for c in r.changes))


def plan_graphs(graphs: Graphs, num_fwd_outputs: int, budget: int, profile: DeviceProfile, tier: str,
                device: str = "cpu"):
    """Facts and plan for graphs as they are (no parameter managed), rewriting nothing."""
    facts = analyze(graph_specs(graphs, num_fwd_outputs), device=device, step_cost=step_cost(profile))
    # traced on `device`, planned for the target: its device decides what a tier frees
    plan = make_plan(facts, budget, profile, tier, device=profile.device)
    if profile.device != device:
        plan = dataclasses.replace(plan, notes=(*plan.notes, f"traced on {device}, planned for {profile.name}"))
    return facts, plan
