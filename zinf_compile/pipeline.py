"""The driver: graphs -> facts -> plan -> passes (verified after each) -> record and dumps."""
from __future__ import annotations

import dataclasses
import os
import time
import warnings

import torch
import torch.fx as fx

from zinf_compile import records
from zinf_compile.analysis.facts import GraphSpec, analyze
from zinf_compile.config import tier_frees_device
from zinf_compile.cost import load_profile, step_cost
from zinf_compile.planner import choose_tiles, make_plan, managed_params, tiled_ops_of, with_param_actions
from zinf_compile.runtime.params import world


def graph_specs(graphs: dict[str, fx.GraphModule], num_fwd_outputs: int) -> list[GraphSpec]:
    """Specs for an inference graph, or a forward/backward pair linked by the saved tensors."""
    if "inference" in graphs:
        return [GraphSpec("inference", graphs["inference"])]
    fw, bw = graphs["forward"], graphs["backward"]
    fw_out = next(iter(fw.graph.find_nodes(op="output")))
    flat: list = []
    fx.node.map_arg(fw_out.args[0], flat.append)
    # AOT autograd hands the saved tensors to the backward by position: the forward's outputs after
    # the user's are the saved tensors (then symints), and the backward's tensor placeholders start
    # with the same tensors in the same order (after symints), then the tangents.
    saved_fw = [n for n in flat[num_fwd_outputs:] if isinstance(n.meta.get("val"), torch.Tensor)]
    bw_tensors = [p for p in bw.graph.find_nodes(op="placeholder")
                  if isinstance(p.meta.get("val"), torch.Tensor)]
    saved = dict(zip(bw_tensors[:len(saved_fw)], saved_fw))
    return [GraphSpec("forward", fw, num_user_outputs=num_fwd_outputs), GraphSpec("backward", bw, saved=saved)]


def plan_graphs(graphs: dict[str, fx.GraphModule], num_fwd_outputs: int, budget: int, profile, tier: str,
                device: str = "cpu"):
    """Facts and plan for captured graphs, rewriting nothing (the offline `zinf plan`)."""
    facts = analyze(graph_specs(graphs, num_fwd_outputs), device=device, step_cost=step_cost(profile))
    # traced on `device`, planned for the target: its device decides what a tier frees
    plan = make_plan(facts, budget, profile, tier, device=profile.device)
    if profile.device != device:
        plan = dataclasses.replace(plan, notes=(*plan.notes, f"traced on {device}, planned for {profile.name}"))
    return facts, plan


def copy_graphs(graphs: dict[str, fx.GraphModule]) -> dict[str, fx.GraphModule]:
    import copy

    with warnings.catch_warnings():  # torch's pytree warns about its own specs while they are copied
        warnings.simplefilter("ignore", FutureWarning)
        return {k: copy.deepcopy(m) for k, m in graphs.items()}


def tile_choices(graphs: dict[str, fx.GraphModule], num_fwd_outputs: int, tiling: str, max_tile_bytes: int | None,
                 budget: int | None, budget_fraction: float | None, profile, tier: str, device: str) -> list[dict]:
    """The tilings to try, in order (pid -> row ranges; {}: none): the planner's choice
    (planner.choose_tiles), then twice and four times as many tiles in case the plan of the tiled
    graphs still does not fit (the choice is an estimate: a tiled op's output, say, is not in it)."""
    from zinf_compile.passes.tiling import candidates, split_bounds

    if tiling == "off":
        return [{}]
    cands: dict = {}
    for gm in graphs.values():
        for pid, c in candidates(gm.graph).items():
            cands[pid] = c if pid not in cands else dataclasses.replace(
                cands[pid], uses=cands[pid].uses + c.uses, grads=cands[pid].grads + c.grads,
                others=cands[pid].others + c.others, k_bytes=cands[pid].k_bytes + c.k_bytes)
    if not cands:
        return [{}]
    if tiling == "force":
        counts = choose_tiles(None, 0, cands, profile, tier, max_tile_bytes)  # type: ignore[arg-type]
        return [{pid: split_bounds(cands[pid].rows, n) for pid, n in counts.items()}]
    facts = analyze(graph_specs(graphs, num_fwd_outputs), device=device, step_cost=step_cost(profile))
    if budget_fraction is not None:
        budget = int(facts.peak * budget_fraction)
    counts = choose_tiles(facts, int(budget), cands, profile, tier)
    if not counts:
        return [{}]
    out: list[dict] = []
    from zinf_compile.planner import MAX_TILES

    for f in (1, 2, 4):
        choice = {pid: split_bounds(cands[pid].rows, min(n * f, MAX_TILES)) for pid, n in counts.items()}
        if choice not in out:
            out.append(choice)
    return out


def room_by_node(graphs: dict[str, fx.GraphModule], num_fwd_outputs: int, budget: int | None,
                 budget_fraction: float | None, device: str, profile) -> dict[fx.Node, int]:
    """Each step's node -> the budget less the bytes live there without any plan. A plan only
    takes bytes away from that timeline (an offload frees a tensor for part of its life), so
    whatever holds no more than this at a step keeps the step within the budget."""
    facts = analyze(graph_specs(graphs, num_fwd_outputs), device=device, step_cost=step_cost(profile))
    if budget_fraction is not None:
        budget = int(facts.peak * budget_fraction)
    if budget is None:
        return {}
    return {st.node: int(budget - facts.live[i]) for i, st in enumerate(facts.steps)}


def fit_tiled(graphs: dict[str, fx.GraphModule], choices: list[dict], attempt, prefetch=None, reports=(),
              on_fail=None, room_aware: bool = False):
    """Plan the first tiling in `choices` that fits: each tiles a copy of `graphs` (TileParams),
    then, with `prefetch` (prefetch(graphs, aware) -> reports: fetch shards ahead), tries on a copy
    fetching every shard as far ahead as hides its read; where that breaks the budget and a fetched
    shard holds device memory (`room_aware`), fetching only over steps with room for it
    (aware=True; None when that changes nothing); else gathering just in time.
    attempt(graphs, reports) plans and raises BudgetError when they do not fit; on_fail(tiles,
    fetched_ahead, error) hears of each failure. Returns (the graphs planned, attempt's result);
    raises the last BudgetError."""
    from zinf_compile.errors import BudgetError
    from zinf_compile.passes.tiling import TileParams

    err: BudgetError | None = None
    for tiles in choices:
        done = list(reports)
        g = graphs
        if tiles:
            g = copy_graphs(graphs)
            for gm in g.values():
                done.append(TileParams()(gm.graph, tiles))
                gm.recompile()

        def ahead(aware: bool, g=g, done=done):
            trial = copy_graphs(g)
            rep = prefetch(trial, aware)
            return None if rep is None else (trial, done + rep)

        tries = [(lambda: (g, done), False)]
        if prefetch is not None:  # on copies: the graphs just in time stay as they are
            tries[:0] = [(lambda: ahead(False), True)] + [(lambda: ahead(True), True)] * room_aware
        for make, fetched in tries:
            made = make()
            if made is None:
                continue
            gs, rep = made
            try:
                return gs, attempt(gs, rep)
            except BudgetError as e:
                err = e
                if on_fail is not None:
                    on_fail(tiles, fetched, e)
    assert err is not None
    raise err


def plan_and_rewrite(session, graphs: dict[str, fx.GraphModule], num_fwd_outputs: int, pre_reports=()):
    from zinf_compile.passes import PIPELINE, PassContext, verify

    cfg = session.cfg
    specs = graph_specs(graphs, num_fwd_outputs)
    profile = load_profile(cfg.profile, session.device)
    t0 = time.perf_counter()
    try:
        facts = analyze(specs, device=session.device, step_cost=step_cost(profile))
        budget = session.budget
        if cfg.budget_fraction is not None:
            budget = int(facts.peak * cfg.budget_fraction)
        plan = make_plan(facts, budget, profile, session.tier)
        params = managed_params(graphs.values(), world()[1])
        if params:
            plan = with_param_actions(plan, facts, params, profile)
        tiles = tiled_ops_of(graphs)
        if tiles:
            plan = dataclasses.replace(plan, tiles=tiles)
        ctx = PassContext(graphs=graphs, facts=facts, plan=plan, engine_key=session.engine_key)
        before = {role: gm.print_readable(print_output=False) for role, gm in graphs.items()} if cfg.dump_dir else {}
        reports, peak = list(pre_reports), None
        for p in PIPELINE:
            reports.append(p(ctx))
            if cfg.verify:
                peak = verify(ctx, num_fwd_outputs, p.name)
    except BaseException:
        eng = session.engine
        if eng.live_tickets() == 0 and (eng._swap is None or eng._swap.file_count() == 0):
            # leave no empty swap folder behind a failed compile (a BudgetError is also how a
            # parameter choice is retried); a folder holding any file (parameter shards, optimizer
            # states) stays: its descriptors are in use
            eng.close()
        raise
    if not tier_frees_device(session.tier, session.device) and plan.moves():
        warnings.warn("zinf: offload='cpu' on a CPU device frees no memory (the tensors stay in the same "
                      "RAM); the plan still runs. Use offload='nvme' to lower the peak.", stacklevel=2)
    rec = records.add(plan, reports, graphs, peak)
    if cfg.dump_dir:
        _dump(cfg.dump_dir, rec, before, time.perf_counter() - t0)
    return plan


def _dump(dump_dir: str, rec, before: dict[str, str], seconds: float) -> None:
    d = os.path.join(dump_dir, f"compile-{os.getpid()}-{rec.index:03d}")
    os.makedirs(d, exist_ok=True)
    rec.plan.save(os.path.join(d, "plan.json"))
    for role, gm in rec.graphs.items():
        with open(os.path.join(d, f"{role}.before.txt"), "w") as f:
            f.write(before.get(role, ""))
        with open(os.path.join(d, f"{role}.after.txt"), "w") as f:
            f.write(gm.print_readable(print_output=False))
    with open(os.path.join(d, "passes.txt"), "w") as f:
        f.write(f"planned and rewritten in {seconds:.3f} s\n")
        for r in rec.reports:
            f.write(f"{r}\n" + "".join(f"  {c}\n" for c in r.changes))
