"""The planner: (graph facts, budget, profile, tier) -> Plan. Decides; never rewrites.

1. If the timeline fits the budget, the plan is empty.
2. The lower bound is the peak with every gap used and every prefetch just in time. Above the
   budget, no plan exists: BudgetError names both numbers.
3. Greedy cover: take gaps by bytes x length (big tensors away for long, cheapest per byte freed),
   each only if it frees memory at a step still over the budget. Then drop any gap the others
   make unnecessary (last taken first).
4. Prefetch distance: move each prefetch earlier until the read is hidden under the compute of the
   steps it spans, while the timeline stays within the budget.
5. Simulate: compute and the I/O channel in time; a wait whose read is not done stalls.
Deterministic: every choice breaks ties by step and buffer id.
"""
from __future__ import annotations

import numpy as np

from zinf_compile.analysis.facts import Gap, GraphFacts, paused_gc
from zinf_compile.config import tier_frees_device
from zinf_compile.cost import DeviceProfile
from zinf_compile.errors import BudgetError
from zinf_compile.plan import PLAN_VERSION, Action, ManagedParam, Plan, Step, TensorLife, TiledOp


@paused_gc
def make_plan(facts: GraphFacts, budget: int, profile: DeviceProfile, tier: str, device: str | None = None) -> Plan:
    """`device`: the device the plan is for (default: the graphs'); the CPU tier frees nothing
    when it is the CPU."""
    device = device or facts.device
    frees = tier_frees_device(tier, device)
    nbytes = {b.id: b.nbytes for b in facts.buffers}
    live = facts.live.astype(np.int64).copy()
    notes: list[str] = []
    chosen: list[Gap] = []
    if len(live) and live.max() > budget:
        if facts.lower_bound > budget:
            raise BudgetError(budget, facts.lower_bound, facts.lower_bound)
        chosen = _cover(facts.gaps, nbytes, live, budget)
    prefetch_at = _place_prefetches(facts, chosen, nbytes, live, budget, profile, tier)
    if any(b.size_expr.free_symbols for b in facts.buffers):
        notes.append("sizes are symbolic: planned at the size hints of the first compile; larger "
                     "shapes at run time need proportionally more memory")
    if not frees and chosen:
        notes.append("the CPU tier on a CPU device frees no memory: tensors stay in the same RAM. "
                     "Use offload='nvme' to lower the peak.")
    actions = []
    for group, g in enumerate(chosen):
        n = nbytes[g.buffer]
        actions.append(Action("offload", g.buffer, g.after, tier, n, group))
        actions.append(Action("prefetch", g.buffer, prefetch_at[group], tier, n, group))
        actions.append(Action("wait", g.buffer, g.before, tier, n, group))
    actions.sort(key=lambda a: (a.step, a.kind != "offload", a.group))
    compute_s, stall_s = simulate(facts, chosen, prefetch_at, nbytes, profile, tier)
    moved = sum(2 * nbytes[g.buffer] for g in chosen)
    after = live if frees else facts.live.copy()  # the CPU tier of a CPU device frees nothing
    return Plan(
        version=PLAN_VERSION,
        graphs=facts.graphs,
        device=device,
        profile=profile.name,
        budget=int(budget),
        tier=tier,  # type: ignore[arg-type]
        steps=tuple(Step(s.index, s.graph, s.node.name, _op_name(s.node), s.est_time_s, s.flops) for s in facts.steps),
        tensors=_tensor_lives(facts, {g.buffer for g in chosen}),
        actions=tuple(actions),
        timeline_before=tuple(int(x) for x in facts.live),
        timeline_after=tuple(int(x) for x in after),
        peak_before=facts.peak,
        peak_after=int(after.max()) if len(after) else 0,
        lower_bound=int(facts.lower_bound),
        bytes_moved={tier: int(moved)} if moved else {},
        predicted_compute_s=compute_s,
        predicted_stall_s=stall_s,
        notes=tuple(notes),
    )


def _cover(gaps, nbytes, live: np.ndarray, budget: int) -> list[Gap]:
    """Greedy: gaps that free memory where the timeline is over budget, biggest first."""
    order = sorted(gaps, key=lambda g: (-nbytes[g.buffer] * (g.before - g.after - 1), g.after, g.buffer))
    chosen: list[Gap] = []
    for g in order:
        span = live[g.after + 1:g.before]
        if not len(span) or span.max() <= budget:
            continue
        span -= nbytes[g.buffer]
        chosen.append(g)
        if live.max() <= budget:
            break
    # drop what the others make unnecessary, most recently taken first
    for g in reversed(list(chosen)):
        span = live[g.after + 1:g.before]
        if (span + nbytes[g.buffer]).max() <= budget:
            span += nbytes[g.buffer]
            chosen.remove(g)
    chosen.sort(key=lambda g: (g.after, g.buffer))
    return chosen


def _place_prefetches(facts, chosen, nbytes, live, budget, profile, tier) -> list[int]:
    """Move each prefetch back from its use until its read is hidden, staying within budget.
    Updates `live` in place for the steps where prefetched data is already back."""
    times = np.array([s.est_time_s for s in facts.steps], dtype=np.float64)
    graph_start: dict[str, int] = {}
    for st in facts.steps:
        graph_start.setdefault(st.graph, st.index)
    at = [g.before for g in chosen]
    for i in sorted(range(len(chosen)), key=lambda i: (chosen[i].before, chosen[i].buffer)):
        g = chosen[i]
        n = nbytes[g.buffer]
        need = profile.transfer_time(n, tier, "in")
        p, hidden = g.before, 0.0
        # a prefetch runs in the graph that uses the tensor, never before that graph starts
        floor = max(g.after + 1, graph_start[facts.steps[g.before].graph])
        while p - 1 >= floor and hidden < need and live[p - 1] + n <= budget:
            p -= 1
            live[p] += n
            hidden += times[p]
        at[i] = p
    return at


def simulate(facts: GraphFacts, chosen, prefetch_at, nbytes, profile, tier) -> tuple[float, float]:
    """(compute seconds, stall seconds): steps run back to back; reads queue on one channel and
    start at their prefetch step; a wait stalls until its read is done. Writes are synchronous."""
    starts: dict[int, list[int]] = {}
    waits: dict[int, list[int]] = {}
    offloads: dict[int, list[int]] = {}
    for i, g in enumerate(chosen):
        starts.setdefault(prefetch_at[i], []).append(i)
        waits.setdefault(g.before, []).append(i)
        offloads.setdefault(g.after, []).append(i)
    clock = channel = stall = compute = 0.0
    done: dict[int, float] = {}
    for s in facts.steps:
        for i in starts.get(s.index, ()):
            channel = max(channel, clock) + profile.transfer_time(nbytes[chosen[i].buffer], tier, "in")
            done[i] = channel
        for i in waits.get(s.index, ()):
            if done[i] > clock:
                stall += done[i] - clock
                clock = done[i]
        clock += s.est_time_s
        compute += s.est_time_s
        for i in offloads.get(s.index, ()):
            w = profile.transfer_time(nbytes[chosen[i].buffer], tier, "out")
            stall += w
            clock += w
    return compute, stall


def _op_name(node) -> str:
    t = node.target
    return str(t) if not hasattr(t, "__name__") or hasattr(t, "overloadpacket") else t.__name__


def _tensor_lives(facts: GraphFacts, moved: set[int]) -> tuple[TensorLife, ...]:
    """Tensors worth showing: the moved ones and the larger ones (all of them for small graphs)."""
    bufs = [b for b in facts.buffers if b.device == facts.device]
    if len(bufs) > 2000:
        keep = sorted(bufs, key=lambda b: -b.nbytes)[:2000]
        bufs = sorted({*keep, *(b for b in bufs if b.id in moved)}, key=lambda b: b.id)
    movable = {g.buffer for g in facts.gaps}
    return tuple(_life(b, b.id in movable) for b in bufs)


def _life(b, movable: bool) -> TensorLife:
    from zinf_compile.analysis.sizes import shape_str

    val = b.aliases[0].meta.get("val")
    if isinstance(val, (list, tuple)):
        val = next((v for v in val if hasattr(v, "shape")), None)
    return TensorLife(
        id=b.id, name=b.aliases[0].name, graph=b.graph, role=b.role,  # type: ignore[arg-type]
        nbytes=b.nbytes, size_expr=str(b.size_expr),
        shape=shape_str(val) if val is not None else "?", dtype=str(getattr(val, "dtype", "?")).replace("torch.", ""),
        def_step=b.def_step, use_steps=b.use_steps, movable=movable,
    )


def with_param_actions(plan: Plan, facts: GraphFacts, params: dict, profile: DeviceProfile | None = None) -> Plan:
    """The plan plus each managed parameter's fetch, gather, release and reduce actions, read off
    the graphs the parameter passes inserted. `params`: pid -> ManagedParam.

    With a profile, the parameters' traffic joins bytes_moved and the predicted stall: a gather
    waits for what of its shard's read the steps since its fetch (none without one) did not hide;
    a reduce waits for its shard's write. (Parameter reads are not queued behind activation
    prefetches in this estimate.)"""
    import dataclasses

    buffer_of = {}
    for b in facts.buffers:
        for n in b.aliases:
            buffer_of.setdefault(n, b)
    actions = list(plan.actions)
    for st in facts.steps:
        z = st.node.meta.get("zinf", {})
        kind, pid = z.get("kind"), z.get("pid")
        if kind not in ("gather", "reduce", "fetch") or pid not in params:
            continue
        mp = params[pid]
        part = _part_of(st.node, mp)  # a tile's share of the weight (1 when whole)
        if kind == "fetch":
            b = buffer_of.get(st.node)
            if b is not None:
                actions.append(Action("fetch", b.id, st.index, mp.tier, int(mp.shard_nbytes * part), -1 - pid))
        elif kind == "gather":
            b = buffer_of.get(st.node)
            if b is None:
                continue
            actions.append(Action("gather", b.id, st.index, mp.tier, int(mp.nbytes * part), -1 - pid))
            actions.append(Action("release", b.id, b.end_step, mp.tier, int(mp.nbytes * part), -1 - pid))
        else:
            b = buffer_of.get(st.node.args[0])
            if b is not None:
                actions.append(Action("reduce", b.id, st.index, mp.tier, int(mp.nbytes * part), -1 - pid))
    actions.sort(key=lambda a: (a.step, a.kind != "offload", a.group))
    moved, stall = dict(plan.bytes_moved), plan.predicted_stall_s
    if profile is not None:
        times = np.cumsum([0.0] + [st.est_time_s for st in facts.steps])
        fetched_at: dict[int, int] = {}
        for a in actions:  # in step order
            if a.group >= 0:
                continue  # an activation's offload/prefetch/wait: simulated by make_plan already
            mp = params[-1 - a.group]
            shard = int(mp.shard_nbytes * a.nbytes / mp.nbytes) if mp.nbytes else 0  # a tile's share
            if a.kind == "fetch":
                fetched_at[a.group] = a.step
            elif a.kind == "gather":
                start = fetched_at.pop(a.group, a.step)
                hidden = times[a.step] - times[start]
                stall += max(0.0, profile.transfer_time(shard, mp.tier, "in") - hidden)
                moved[mp.tier] = moved.get(mp.tier, 0) + shard
            elif a.kind == "reduce":
                stall += profile.transfer_time(shard, mp.tier, "out")
                moved[mp.tier] = moved.get(mp.tier, 0) + shard
    have = {t.id for t in plan.tensors}
    extra = sorted({a.tensor for a in actions} - have)
    tensors = tuple(sorted((*plan.tensors, *(_life(facts.buffers[i], False) for i in extra)), key=lambda t: t.id))
    return dataclasses.replace(plan, actions=tuple(actions), tensors=tensors, bytes_moved=moved,
                               predicted_stall_s=float(stall),
                               params=tuple(sorted(params.values(), key=lambda m: m.pid)))


def _part_of(node, mp: ManagedParam) -> float:
    """The share of its weight a tile op (gather_rows, fetch_rows, reduce_grad_rows) moves."""
    rows = node.meta.get("zinf", {}).get("rows")
    if rows is None and node.meta.get("zinf", {}).get("kind") == "fetch":
        rows = tuple(node.args[3:5]) if len(node.args) >= 5 else None
    if rows is None:
        return 1.0
    p = node.args[1] if node.meta["zinf"].get("kind") == "reduce" else node.args[0]
    n_rows = p.meta["val"].shape[0]
    return (rows[1] - rows[0]) / n_rows


def managed_params(graphs, world: int = 1) -> dict[int, ManagedParam]:
    """The managed parameters of graphs the parameter passes rewrote, from their placeholders."""
    out: dict[int, ManagedParam] = {}
    for gm in graphs:
        for n in gm.graph.find_nodes(op="placeholder"):
            z = n.meta.get("zinf", {})
            if z.get("kind") != "param" or z["pid"] in out:
                continue
            val = n.meta["val"]
            nbytes = int(val.numel()) * val.element_size()
            from zinf_compile.passes.params import stored_nbytes

            shard = stored_nbytes(val.numel(), val.element_size(), z.get("master"))
            out[z["pid"]] = ManagedParam(z["pid"], z["name"], nbytes, -(-shard // world), z["tier"], world)
    return out


def try_param_choices(mode: str, big: list, forced: list, nbytes, attempt, on_fail=None):
    """The planner's choice of managed parameters, cheapest first, for the backend and `zinf plan`.

    `big`: the parameters zinf may manage (those already managed among them), `forced`: those it
    must. mode "offload": all of `big`; "resident": only `forced`; "auto": `forced`, then the fewest
    more (largest first) that free the shortfall the failed plan reported, then all of `big`.
    attempt(chosen, last) plans one choice and raises BudgetError when it does not fit;
    on_fail(chosen, error) hears of each failed try. Items are opaque; nbytes(item) is their size."""
    if mode == "offload":
        tries: list = [big]
    elif mode == "resident" or not big:
        tries = [forced]
    else:
        tries = [forced, None, big]
    err: BudgetError | None = None
    for i, chosen in enumerate(tries):
        if chosen is None:
            chosen = _fewest(big, forced, max(err.lower_bound, err.best_peak) - err.budget, nbytes)
            if len(chosen) == len(big):
                continue
        try:
            return attempt(chosen, i == len(tries) - 1)
        except BudgetError as e:
            if on_fail is not None:
                on_fail(chosen, e)
            if i == len(tries) - 1:
                raise
            err = e
    raise err  # pragma: no cover  (the last try raises)


def _fewest(big: list, forced: list, need: int, nbytes) -> list:
    """`forced` and then the largest of `big` until what they free, less the largest (gathered
    whole while it is used), covers `need`; in `big`'s order."""
    chosen = list(forced)
    for c in sorted(big, key=lambda c: -nbytes(c)):  # stable: ties keep big's order
        have = sum(map(nbytes, chosen)) - max(map(nbytes, chosen), default=0)
        if have >= need:
            break
        if c not in chosen:
            chosen.append(c)
    return [c for c in big if c in chosen]


def fetch_holds_device_memory(device: str, mapped: bool) -> bool:
    """Whether an NVMe shard fetched ahead is device memory until its gather: not where the gather
    maps the file (`mapped`: a CPU device, buffered I/O; the fetch is the kernel's read-ahead), nor
    on a GPU (the shard lands in host memory); so only on a CPU device with O_DIRECT files."""
    return not (mapped or tier_frees_device("cpu", device))


def prefetch_param_gathers(graphs, profile: DeviceProfile, tier: str, device: str, world: int = 1,
                           mapped: bool = False, room=None) -> list:
    """Fetch NVMe shards ahead of their gathers in each fx.Graph, as far as the cost model says
    hides the read (PrefetchGathers); a CPU-tier shard is in host memory already: nothing to do.
    `mapped`: gathers map the shard's file (a CPU device, buffered I/O): a fetch only asks the
    kernel to read ahead into its page cache, and holds no memory of the process until the gather.
    `room`: node -> bytes free at its step (pipeline.room_by_node); a fetch that holds memory then
    spans only steps with room for it."""
    if tier != "nvme":
        return []
    from zinf_compile.cost import step_cost
    from zinf_compile.passes.params import PrefetchGathers

    cost = step_cost(profile)
    holds = fetch_holds_device_memory(device, mapped)
    return [PrefetchGathers()(g, lambda n: cost(n)[1],
                              lambda b: profile.transfer_time(-(-b // world), "nvme", "in"),
                              lambda b: -(-b // world) if holds else 0, room) for g in graphs]


# -- memory-centric tiling ------------------------------------------------------------------------

TILE_OVERHEAD_S = 50e-6  # one tile's fixed cost: an op dispatch, a read request, a kernel launch
MAX_TILES = 64  # past this a matmul is all overhead; a weight that needs more tiles is not tiled


def choose_tiles(facts: GraphFacts, budget: int, cands: dict, profile: DeviceProfile, tier: str,
                 max_tile_bytes: int | None = None) -> dict[int, int]:
    """How many row tiles each candidate weight gets (pid -> count; absent: not tiled).

    `cands`: pid -> passes.tiling.Candidate (merged over the graphs facts covers). With
    `max_tile_bytes`, every weight larger than that, in tiles no larger. Otherwise only where the
    graphs cannot fit at all (their lower bound is over the budget), and only the weights whose
    matmuls stand at a step over it: at such a step i, tiling takes the whole weight (or its whole
    gradient) off what must stay live (floor[i]) and puts back k tiles of it (the one in use and
    the next, fetched ahead; one for a gradient tile), so it needs k * W / T <= budget - (floor[i]
    - W). The count is the one with the least predicted time between that least count and 4x it:
    each tile costs TILE_OVERHEAD_S; the first tile's read is not hidden by an earlier tile; a K
    split re-reads and re-writes its float32 sum once per tile."""
    import math

    out: dict[int, int] = {}
    if max_tile_bytes is not None:
        for pid, c in cands.items():
            if c.nbytes > max_tile_bytes:  # forced: as asked, up to one row per tile
                out[pid] = min(c.rows, -(-c.nbytes // max_tile_bytes))
        return out
    floor = facts.floor
    if floor is None or not len(floor) or facts.lower_bound <= budget:
        return out
    for pid, c in cands.items():
        need = 1
        for m in (*c.uses, *c.grads):
            i = facts.step_of.get(m)
            if i is None or floor[i] <= budget:
                continue
            k = 2 if m in c.uses else 1
            room = budget - (int(floor[i]) - c.nbytes)
            # no room even without the weight: tiling it cannot make this step fit
            need = max(need, math.ceil(k * c.nbytes / room) if room > 0 else MAX_TILES + 1)
        if need <= 1 or need > min(MAX_TILES, c.rows):
            continue
        def cost(t, c=c):
            return (t * TILE_OVERHEAD_S + profile.transfer_time(c.nbytes // t, tier, "in")
                    + (t - 1) * 2 * c.k_bytes / profile.mem_bw)

        top = min(c.rows, 4 * need, MAX_TILES)
        out[pid] = min(range(min(need, c.rows), top + 1), key=lambda t: (cost(t), t))
    return out


def tiled_ops_of(graphs) -> tuple[TiledOp, ...]:
    """The plan's record of the tiled matmuls in rewritten graphs ({role: GraphModule})."""
    from zinf_compile.passes.tiling import tiled_ops

    return tuple(TiledOp(**t) for t in tiled_ops(graphs.items()))
