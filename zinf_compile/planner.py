"""The planner: facts, budget, device model and profile -> decisions. Decides; never rewrites.

Every lever is decided here from facts, in this order, each on the timeline the earlier ones leave:

A. Parameters (`decide_params`), on the facts of graphs where every candidate is gathered: the
   timeline of any choice is the analysed one plus, for each parameter kept resident, its
   `ParamFact.resident_delta`. "auto" keeps all resident when what no offload can free (the floor)
   fits; else manages the largest first until it fits, then drops those the others make
   unnecessary (as the activation cover does).
B. Tiles (`decide_tiles`): where a step reading a weight whole cannot fit, the least count of row
   tiles that fits, then the cheapest up to 4x that; the tiled timeline is modelled (the whole
   weight and its whole gradient replaced by the tiles live at their matmuls), and twice and four
   times as many tiles are taken where the model still does not fit.
C. `make_plan`, on the facts of the rewritten graphs:
   1. Fetches: each NVMe shard read starts as far ahead of its gather as hides it (never past the
      previous read of the same graph), where a fetched shard holds device memory only over steps
      with room for it above the floor.
   2. If the timeline fits the budget, no activation moves. The lower bound is the floor's peak
      (every gap used, every prefetch just in time); above the budget no plan exists: BudgetError
      names both numbers.
   3. Greedy cover (`choose_levers`): stretches a storage can be away, by bytes x length, each only
      if it frees memory at a step still over the budget, by the cheaper lever: offload (the
      transfer out and back) or, for a saved tensor the backward can rebuild from what it has,
      recompute (the chain's compute); then drop any the others make unnecessary (last first).
   4. Prefetch distance (one walk for activations and shards, `_ahead`): back from the use until
      the read is hidden under the compute of the steps it spans, within the budget.
   5. Simulate: compute and one I/O channel in time; a wait or gather whose read is not done
      stalls; writes are synchronous.
Deterministic: every choice breaks ties by step, buffer id and parameter id.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from zinf_compile import ir
from zinf_compile.analysis.facts import Gap, GraphFacts, paused_gc
from zinf_compile.analysis.recompute import Recompute
from zinf_compile.analysis.params import ParamFact, buffer_index, parameter_reads
from zinf_compile.config import tier_frees_device
from zinf_compile.cost import DeviceProfile
from zinf_compile.errors import BudgetError
from zinf_compile.plan import PLAN_VERSION, Action, ManagedParam, Plan, Step, TensorLife, TiledOp

# Parameters smaller than this stay resident when zinf manages parameters (the bookkeeping and the
# latency of a gather outweigh the bytes; DeepSpeed's stage3_param_persistence_threshold is the same idea)
PERSIST_BYTES = 64 << 10
TILE_OVERHEAD_S = 50e-6  # one tile's fixed cost: an op dispatch, a read request, a kernel launch
MAX_TILES = 64  # past this a matmul is all overhead; a weight that needs more tiles is not tiled
TILE_RETRY_FACTORS = (1, 2, 4)  # more tiles where the modelled timeline still does not fit
SHOWN_TENSORS = 2000  # the plan lists every tensor of smaller graphs, the largest of bigger ones


@dataclass(frozen=True)
class DeviceModel:
    """What the runtime does, as the planner needs it; computed once per compile (the session's
    engine, or the target offline)."""

    device: str  # "cpu" | "cuda": where the graphs compute
    tier: str  # where managed parameters and offloaded activations go
    world: int = 1
    maps_files: bool = False  # gathers map the shard files (a CPU device, buffered I/O)

    @property
    def frees_device(self) -> bool:
        return tier_frees_device(self.tier, self.device)

    @property
    def fetch_holds_memory(self) -> bool:
        """A shard fetched ahead is device memory until its gather: not where the gather maps the
        file (the fetch is the kernel's read-ahead), nor on a GPU (it lands in host memory)."""
        return not (self.maps_files or tier_frees_device("cpu", self.device))


def direct_io(option: bool | str, file_bytes: int, cache_bytes: int) -> bool:
    """Whether the swap files are O_DIRECT: as the option says, or ("auto") when the bytes the run
    keeps in them outgrow the page cache that is free for them. Then every pass reads the disk,
    and direct reads reach its bandwidth (0.8-1.2 GB/s here against 0.35-0.45 through a mapping or
    0.3-0.9 buffered, cold); while they fit, buffered files serve every later pass from memory
    (10-30 GB/s mapped) and direct reads would go to the disk each time."""
    if option != "auto":
        return bool(option)
    return file_bytes > cache_bytes


# -- A. parameters --------------------------------------------------------------------------------

@paused_gc
def decide_params(facts: GraphFacts, params: dict[int, ParamFact], budget: int, mode: str,
                  forced: frozenset[int] = frozenset()) -> frozenset[int]:
    """Which of `params` (all managed in the analysed graphs) stay managed. `forced`: managed
    already (an earlier compile took them over). "offload": all; "resident": only the forced;
    "auto": the fewest, largest first, whose management brings the floor within the budget, or
    all of them when none does."""
    if mode == "offload" or not params:
        return frozenset(params)
    if mode == "resident":
        return frozenset(p for p in params if p in forced)
    n = len(facts.steps)
    deltas = {pid: pf.resident_delta(n, floor=True) for pid, pf in params.items() if pid not in forced}
    floor = _floor(facts).copy()
    for d in deltas.values():
        floor += d
    if not len(floor) or floor.max() <= budget:
        return frozenset(forced)
    chosen: list[int] = []
    for pid in sorted(deltas, key=lambda p: (-params[p].nbytes, p)):
        if not (deltas[pid][floor > budget] > 0).any():
            continue  # managing it frees nothing where the floor is over (a shard kept beside its gathers)
        floor -= deltas[pid]
        chosen.append(pid)
        if floor.max() <= budget:
            break
    if floor.max() > budget:
        return frozenset(params)
    dropped = True
    while dropped:  # drop what the others make unnecessary, last taken first, until none is
        dropped = False
        for pid in reversed(list(chosen)):
            if (floor + deltas[pid]).max() <= budget:
                floor += deltas[pid]
                chosen.remove(pid)
                dropped = True
    return frozenset(chosen) | forced


def resident_timeline(facts: GraphFacts, params: dict[int, ParamFact]) -> np.ndarray:
    """The live timeline with every parameter resident: the graphs as compiled without zinf (the
    base of a budget given as a share)."""
    live = facts.live.astype(np.int64).copy()
    for pf in params.values():
        live += pf.resident_delta(len(live), floor=False)
    return live


def managed_floor(facts: GraphFacts, params: dict[int, ParamFact], managed: frozenset[int]) -> np.ndarray:
    floor = _floor(facts).copy()
    for pid, pf in params.items():
        if pid not in managed:
            floor += pf.resident_delta(len(floor), floor=True)
    return floor


def _floor(facts: GraphFacts) -> np.ndarray:
    return facts.floor if facts.floor is not None else facts.live


# -- B. tiles -------------------------------------------------------------------------------------

def choose_tiles(floor: np.ndarray | None, step_of: dict, budget: int, cands: dict, profile: DeviceProfile,
                 tier: str, max_tile_bytes: int | None = None) -> dict[int, int]:
    """How many row tiles each candidate weight gets (pid -> count; absent: not tiled).

    `cands`: pid -> passes.tiling.Candidate. With `max_tile_bytes`, every weight larger than that,
    in tiles no larger. Otherwise only the weights whose matmuls stand at a step where the floor is
    over the budget: at such a step i, tiling takes the whole weight (or its whole gradient) off
    the floor and puts back k tiles of it (the one in use and the next, fetched ahead; one for a
    gradient tile), so it needs k * W / T <= budget - (floor[i] - W). The count is the one with the
    least predicted time between that least count and 4x it: each tile costs TILE_OVERHEAD_S; the
    first tile's read is not hidden by an earlier tile; a K split re-reads and re-writes its float32
    sum once per tile."""
    out: dict[int, int] = {}
    if max_tile_bytes is not None:
        for pid, c in cands.items():
            if c.nbytes > max_tile_bytes:  # forced: as asked, up to one row per tile
                out[pid] = min(c.rows, -(-c.nbytes // max_tile_bytes))
        return out
    if floor is None or not len(floor) or floor.max() <= budget:
        return out
    for pid, c in sorted(cands.items()):
        need = 1
        for m in (*c.uses, *c.grads):
            i = step_of.get(m)
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


def tiled_floor(facts: GraphFacts, floor: np.ndarray, cands: dict, counts: dict[int, int],
                params: dict[int, ParamFact]) -> np.ndarray:
    """The floor once the weights in `counts` are tiled: a tiled weight is no longer gathered whole
    (unless something else reads the whole gather) and its gradient never whole; k tiles of it are
    live at each of its matmuls (the one in use and the next; one gradient tile)."""
    where = buffer_index(facts)
    out = floor.copy()
    for pid, k in counts.items():
        c = cands[pid]
        if not c.others and pid in params:
            for iv in params[pid].gathered_floor:
                out[iv.start:iv.end + 1] -= iv.nbytes
        tile = -(-c.nbytes // k)
        for m in c.uses:
            if m in facts.step_of:
                out[facts.step_of[m]] += 2 * tile
        for m in c.grads:
            if m in facts.step_of and m in where:
                b = facts.buffers[where[m]]
                out[max(b.def_step, 0):b.end_step + 1] -= b.nbytes
                out[facts.step_of[m]] += tile
    return out


def decide_tiles(facts: GraphFacts, floor: np.ndarray, budget: int, cands: dict, params: dict[int, ParamFact],
                 profile: DeviceProfile, tier: str, mode: str = "auto",
                 max_tile_bytes: int | None = None) -> dict[int, int]:
    """The tile counts (pid -> count): `choose_tiles`, then twice and four times as many (at most
    MAX_TILES) where the modelled floor is still over the budget; the first that fits, else the
    last tried (make_plan then names the lower bound)."""
    if mode == "off" or not cands:
        return {}
    counts = choose_tiles(floor, facts.step_of, budget, cands, profile, tier,
                          max_tile_bytes if mode == "force" else None)
    if mode == "force" or not counts:
        return counts
    tried = counts
    for f in TILE_RETRY_FACTORS:
        tried = {pid: min(n * f, MAX_TILES, cands[pid].rows) for pid, n in counts.items()}
        if tiled_floor(facts, floor, cands, tried, params).max() <= budget:
            return tried
    return tried


def tiled_ops(cands: dict, counts: dict[int, int], roles: dict) -> tuple[TiledOp, ...]:
    """The plan's record of the tiled matmuls: one per matmul of each tiled weight.
    `roles`: fx.Graph -> its role."""
    from zinf_compile.passes.tiling import MATMULS

    out = []
    for pid, k in sorted(counts.items()):
        c = cands[pid]
        rows = -(-c.rows // k)
        shape, tile_nbytes = (rows, *c.shape[1:]), rows * (c.nbytes // c.rows)
        for m, axis in c.axes:
            out.append(TiledOp(roles.get(m.graph, "?"), m.name, MATMULS[m.target], axis, k, c.name, m in c.grads,
                               shape, tile_nbytes))
    return tuple(out)


# -- C. fetches and activation moves ----------------------------------------------------------------

@dataclass(frozen=True)
class Fetch:
    read_step: int  # the step that reads the shard (gather, tile rows, this rank's shard)
    at: int  # the step the read starts before
    buffer: int
    pid: int
    nbytes: int  # bytes read from the tier
    held: int  # device bytes the fetched shard holds from `at` to `read_step`


def _ahead(times: np.ndarray, use: int, lo: int, need: float, fits) -> int:
    """The step a read that `use` waits for starts before: back from `use` over the steps'
    compute until the read (`need` seconds) is hidden, never before `lo`, only over steps where
    fits(step) (which may record that the data is there from then on)."""
    p, hidden = use, 0.0
    while p - 1 >= lo and hidden < need and fits(p - 1):
        p -= 1
        hidden += times[p]
    return p


def place_fetches(facts: GraphFacts, params: dict[int, ParamFact], floor: np.ndarray, budget: int,
                  profile: DeviceProfile, model: DeviceModel) -> tuple[list[Fetch], int]:
    """Each NVMe shard read started ahead of its gather (step C.1), and how many were started later
    than hides them (or not at all) for want of room. Updates `floor` with what fetches hold."""
    if model.tier != "nvme" or not params:
        return [], 0
    times = np.array([s.est_time_s for s in facts.steps], dtype=np.float64)
    where = buffer_index(facts)
    graph_start: dict[str, int] = {}
    for st in facts.steps:
        graph_start.setdefault(st.graph, st.index)
    out: list[Fetch] = []
    held_back = 0
    prev: dict[str, int] = {}
    for r in parameter_reads(facts):
        st = facts.steps[r]
        m = ir.meta(st.node)
        pf = params.get(m.pid)
        lo = max(prev.get(st.graph, graph_start[st.graph] - 1) + 1, graph_start[st.graph])
        prev[st.graph] = r
        if pf is None or st.node not in where:
            continue
        nbytes = pf.read_nbytes
        if m.rows is not None:
            rows = st.node.args[0].meta["val"].shape[0]
            nbytes = nbytes * (m.rows[1] - m.rows[0]) // rows
        held = nbytes if model.fetch_holds_memory else 0
        if held and floor[r] + held > budget:
            held_back += 1
            continue  # no room where the fetched shard and the gathered weight meet
        need = profile.transfer_time(nbytes, "nvme", "in")
        at = _ahead(times, r, lo, need, lambda t: not held or floor[t] + held <= budget)
        if at - 1 >= lo and times[at:r].sum() < need:
            held_back += 1  # the walk stopped at a step without room
        if at == r:
            continue
        floor[at:r] += held
        out.append(Fetch(r, at, where[st.node], m.pid, nbytes, held))
    return out, held_back


@paused_gc
def make_plan(facts: GraphFacts, budget: int, profile: DeviceProfile, tier: str, device: str | None = None,
              params: dict[int, ParamFact] | None = None, model: DeviceModel | None = None,
              tiles: tuple[TiledOp, ...] = ()) -> Plan:
    """The plan for analysed graphs (step C). `device`: the device the plan is for (default: the
    graphs'); the CPU tier frees nothing when it is the CPU. `params`: the managed parameters in
    the graphs (their reads fetched ahead on the NVMe tier, their actions in the plan); `model`:
    the runtime's behaviour (default: the device and tier, one rank, files read)."""
    device = device or facts.device
    params = params or {}
    model = model or DeviceModel(device, tier)
    frees = tier_frees_device(tier, device)
    nbytes = {b.id: b.nbytes for b in facts.buffers}
    floor = _floor(facts).astype(np.int64).copy()
    fetches, held_back = place_fetches(facts, params, floor, budget, profile, model)
    live = facts.live.astype(np.int64).copy()
    for f in fetches:
        live[f.at:f.read_step] += f.held
    lower_bound = int(floor.max()) if len(floor) else 0
    notes: list[str] = []
    chosen: list[Gap] = []
    rebuilt: list[Recompute] = []
    if len(live) and live.max() > budget:
        if lower_bound > budget:
            raise BudgetError(budget, lower_bound, lower_bound)
        chosen, rebuilt = choose_levers(facts, nbytes, live, budget, profile, tier, frees)
    prefetch_at = _place_prefetches(facts, chosen, nbytes, live, budget, profile, tier)
    if any(b.size_expr.free_symbols for b in facts.buffers):
        notes.append("sizes are symbolic: planned at the size hints of the first compile; larger "
                     "shapes at run time need proportionally more memory")
    if held_back:
        notes.append(f"fetches: {held_back} shard read(s) started later than hides them, or just in time, "
                     "for want of room")
    if not frees and chosen:
        notes.append("the CPU tier on a CPU device frees no memory: tensors stay in the same RAM. "
                      "Use offload='nvme' to lower the peak.")
    actions = []
    for group, g in enumerate(chosen):
        n = nbytes[g.buffer]
        actions.append(Action("offload", g.buffer, g.after, tier, n, group))
        actions.append(Action("prefetch", g.buffer, prefetch_at[group], tier, n, group))
        actions.append(Action("wait", g.buffer, g.before, tier, n, group))
    for group, r in enumerate(rebuilt):
        actions.append(Action("recompute", r.buffer, r.before, "device", r.nbytes, group))
    param_actions, reads, writes = _param_actions(facts, params, fetches, profile)
    actions += param_actions
    actions.sort(key=lambda a: (a.step, a.kind != "offload", a.kind == "recompute", a.group))
    compute_s, stall_s = simulate(facts, chosen, prefetch_at, nbytes, profile, tier, reads, writes,
                                  [(r.before, r.est_time_s) for r in rebuilt])
    moved = {tier: sum(2 * nbytes[g.buffer] for g in chosen)} if chosen else {}
    for a in param_actions:  # each gather reads its shard (or a tile's share) once, each reduce writes it
        if a.kind in ("gather", "reduce"):
            moved[a.tier] = moved.get(a.tier, 0) + _tier_bytes(a, params)
    if not frees:  # the CPU tier of a CPU device frees nothing; a recompute frees all the same
        after = facts.live.astype(np.int64).copy()
        for r in rebuilt:
            _apply_recompute(after, r, +1)
    else:
        after = live
    if rebuilt:
        notes.append(f"recompute: {len(rebuilt)} saved tensor(s) rebuilt in backward "
                     f"({sum(r.nbytes for r in rebuilt)} bytes not kept, "
                     f"{sum(r.est_time_s for r in rebuilt) * 1e3:.3f} ms of compute predicted)")
    shown = {g.buffer for g in chosen} | {r.buffer for r in rebuilt} | {a.tensor for a in param_actions}
    return Plan(
        version=PLAN_VERSION,
        graphs=facts.graphs,
        device=device,
        profile=profile.name,
        budget=int(budget),
        tier=tier,  # type: ignore[arg-type]
        steps=tuple(Step(s.index, s.graph, s.node.name, _op_name(s.node), s.est_time_s, s.flops) for s in facts.steps),
        tensors=_tensor_lives(facts, shown),
        actions=tuple(actions),
        timeline_before=tuple(int(x) for x in facts.live),
        timeline_after=tuple(int(x) for x in after),
        peak_before=facts.peak,
        peak_after=int(after.max()) if len(after) else 0,
        lower_bound=lower_bound,
        bytes_moved={k: int(v) for k, v in moved.items() if v},
        predicted_compute_s=compute_s,
        predicted_stall_s=stall_s,
        notes=tuple(notes),
        params=tuple(ManagedParam(pid, pf.name, pf.nbytes, pf.read_nbytes, model.tier, model.world)  # type: ignore[arg-type]
                     for pid, pf in sorted(params.items())),
        tiles=tiles,
    )


def _tier_bytes(a: Action, params: dict[int, ParamFact]) -> int:
    """Bytes a gather or reduce moves from or to its tier (a tile's share of the shard)."""
    pf = params[-1 - a.group]
    return int(pf.read_nbytes * a.nbytes / pf.nbytes) if pf.nbytes else 0


def _param_actions(facts: GraphFacts, params: dict[int, ParamFact], fetches: list[Fetch], profile: DeviceProfile):
    """The managed parameters' actions (fetch, gather, release, reduce; group -1 - pid), and their
    transfers for the simulation: reads (start step, read step, seconds), writes (step, seconds)."""
    if not params:
        return [], [], []
    where = buffer_index(facts)
    fetched = {f.read_step: f for f in fetches}
    actions, reads, writes = [], [], []
    for f in fetches:
        actions.append(Action("fetch", f.buffer, f.at, "nvme", f.nbytes, -1 - f.pid))
    for st in facts.steps:
        m = ir.meta(st.node)
        if isinstance(m, ir.GatherMeta) and m.part == "whole" and m.pid in params and st.node in where:
            pf = params[m.pid]
            b = facts.buffers[where[st.node]]
            share = _share(st.node, m)
            tier = _tier_of(st.node)
            actions.append(Action("gather", b.id, st.index, tier, int(pf.nbytes * share), -1 - m.pid))
            actions.append(Action("release", b.id, b.end_step, tier, int(pf.nbytes * share), -1 - m.pid))
        if ir.is_shard_read(st.node) and m.pid in params:
            pf = params[m.pid]
            share = _share(st.node, m)
            f = fetched.get(st.index)
            reads.append((f.at if f else st.index, st.index,
                          profile.transfer_time(int(pf.read_nbytes * share), _tier_of(st.node), "in")))
        elif isinstance(m, ir.ReduceMeta) and not m.part and m.pid in params:
            pf = params[m.pid]
            g = st.node
            while isinstance(ir.meta(g), ir.ReduceMeta):
                g = g.args[0]
            if g not in where:
                continue
            share = _share(st.node, m, 1)
            tier = _tier_of(st.node)
            actions.append(Action("reduce", where[g], st.index, tier, int(pf.nbytes * share), -1 - m.pid))
            writes.append((st.index, profile.transfer_time(int(pf.read_nbytes * share), tier, "out")))
    return actions, reads, writes


def _share(node, m, param_arg: int = 0) -> float:
    """The share of its weight a tile's gather or reduce moves (1 when whole): its rows over the
    weight's (the parameter is the op's argument `param_arg`)."""
    if m.rows is None:
        return 1.0
    return (m.rows[1] - m.rows[0]) / node.args[param_arg].meta["val"].shape[0]


def _tier_of(node) -> str:
    """The tier of the managed parameter a zinf op reads or reduces into."""
    for a in node.args:
        if hasattr(a, "meta") and ir.param(a) is not None:
            return ir.param(a).tier
    return "nvme"


def _apply_recompute(live: np.ndarray, r: Recompute, sign: int) -> None:
    """A recompute's effect on a timeline (sign +1: taken; -1: given back): its storage gone from
    its last forward step to its rebuild, the chain's intermediates held at the rebuild."""
    live[r.after + 1:r.before] -= sign * r.nbytes
    live[r.before] += sign * r.temp_nbytes


def offload_cost(n: int, profile: DeviceProfile, tier: str, frees: bool) -> float:
    """What moving n bytes out and back costs, to weigh against a recompute: the write (synchronous)
    and the read (on the one I/O channel the fetches share); unbounded where the tier frees nothing."""
    if not frees:
        return math.inf
    return profile.transfer_time(n, tier, "out") + profile.transfer_time(n, tier, "in")


def choose_levers(facts: GraphFacts, nbytes, live: np.ndarray, budget: int, profile: DeviceProfile, tier: str,
                  frees: bool = True) -> tuple[list[Gap], list[Recompute]]:
    """The gaps to offload and the saved tensors to recompute (step C.3), `live` updated.

    Each stretch a storage can be away is one candidate (a gap, a recompute, or both: a saved
    tensor's gap across forward and backward is the stretch its recompute frees). Greedy over the
    stretches by bytes x length, each only if it frees memory at a step still over the budget:
    first the recomputes whose chain costs less than moving the tensor out and back (or that have
    no gap), then the gaps (a recompute where its gap is shut out). A recompute excludes every gap
    of its own storage and the gaps of its leaves that span its rebuild, and the recompute of a
    leaf. Then drop what the others make unnecessary (last taken first). If the
    result does not fit (a preferred recompute shut out gaps the floor counts on), the same with
    only the recomputes the floor counts (analysis.recompute.in_floor)."""
    from zinf_compile.analysis.recompute import in_floor

    start = live.copy()
    gaps, recs = _cover_with(facts.gaps, facts.recomputes, nbytes, live, budget, profile, tier, frees,
                             facts.rebuild_gaps)
    if live.max() > budget and recs:
        live[:] = start
        only = in_floor(facts.recomputes, facts.gaps)
        gaps, recs = _cover_with(facts.gaps, only, nbytes, live, budget, profile, tier, frees)
    return gaps, recs


def _cover_with(gaps, recomputes, nbytes, live, budget, profile, tier, frees,
                cut_gaps=()) -> tuple[list[Gap], list[Recompute]]:
    from zinf_compile.analysis.recompute import conflicts

    cuts: dict[tuple[int, int], list[Gap]] = {}  # (buffer, after) -> its gap cut at each rebuild, longest first
    for c in sorted(cut_gaps, key=lambda c: -c.before):
        cuts.setdefault((c.buffer, c.after), []).append(c)
    rec_of = {(r.buffer, r.after, r.before): r for r in recomputes}
    gap_of = {(g.buffer, g.after, g.before): g for g in gaps}
    keys = sorted({*rec_of, *gap_of}, key=lambda k: (-nbytes[k[0]] * (k[2] - k[1] - 1), k[1], k[0], k[2]))
    taken: list = []  # Gap | Recompute, in the order taken
    # indexes of what is taken, so that each check looks only at the storages it concerns
    rec_near: dict[int, list[Recompute]] = {}  # buffer -> taken recomputes of it or reading it
    gaps_of: dict[int, list[Gap]] = {}  # buffer -> its taken gaps
    rebuilt: set[int] = set()
    read_by_rebuilt: set[int] = set()

    def allowed_gap(g) -> bool:
        return not any(conflicts(t, g) for t in rec_near.get(g.buffer, ()))

    def allowed_rec(r) -> bool:
        if r.buffer in rebuilt or r.buffer in gaps_of or r.buffer in read_by_rebuilt:
            return False
        if any(lb in rebuilt or any(conflicts(r, g) for g in gaps_of.get(lb, ())) for lb in r.leaf_buffers):
            return False
        # its intermediates add to the step it rebuilds for: only where that stays within the budget
        return r.temp_nbytes == 0 or live[r.before] + r.temp_nbytes <= budget

    def take(t) -> None:
        taken.append(t)
        if isinstance(t, Gap):
            live[t.after + 1:t.before] -= nbytes[t.buffer]
            gaps_of.setdefault(t.buffer, []).append(t)
            return
        _apply_recompute(live, t, +1)
        rebuilt.add(t.buffer)
        read_by_rebuilt.update(t.leaf_buffers)
        for b in {t.buffer, *t.leaf_buffers}:
            rec_near.setdefault(b, []).append(t)

    def over(k) -> bool:
        span = live[k[1] + 1:k[2]]
        return bool(len(span)) and span.max() > budget

    # first the recomputes cheaper than moving (a leaf's gap taken first would shut them out)
    for k in keys:
        r = rec_of.get(k)
        if r is None or live.max() <= budget or not over(k) or not allowed_rec(r):
            continue
        if k not in gap_of or r.est_time_s < offload_cost(r.nbytes, profile, tier, frees):
            take(r)
    for k in keys:
        if live.max() <= budget:
            break
        if not over(k):
            continue
        r, g = rec_of.get(k), gap_of.get(k)
        if g is not None and allowed_gap(g):
            take(g)
        elif r is not None and allowed_rec(r):
            take(r)
        elif g is not None:  # shut out by a rebuild that reads it: the leaf back for the chain
            cut = next((c for c in cuts.get((g.buffer, g.after), ()) if allowed_gap(c)), None)
            if cut is not None and cut.before - cut.after >= 2 and g.buffer not in gaps_of:
                take(cut)
    # drop what the others make unnecessary, most recently taken first
    for t in reversed(list(taken)):
        if isinstance(t, Recompute):
            back = live.copy()
            _apply_recompute(back, t, -1)
            if back.max() <= budget:
                live[:] = back
                taken.remove(t)
            continue
        span = live[t.after + 1:t.before]
        if (span + nbytes[t.buffer]).max() <= budget:
            span += nbytes[t.buffer]
            taken.remove(t)
    chosen = sorted((t for t in taken if isinstance(t, Gap)), key=lambda g: (g.after, g.buffer))
    rebuilt = sorted((t for t in taken if isinstance(t, Recompute)), key=lambda r: (r.before, r.buffer))
    return chosen, rebuilt


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

        def fits(t, n=n) -> bool:
            if live[t] + n > budget:
                return False
            live[t] += n
            return True

        # a prefetch runs in the graph that uses the tensor, never before that graph starts
        lo = max(g.after + 1, graph_start[facts.steps[g.before].graph])
        at[i] = _ahead(times, g.before, lo, profile.transfer_time(n, tier, "in"), fits)
    return at


def simulate(facts: GraphFacts, chosen, prefetch_at, nbytes, profile, tier, reads=(), writes=(),
             recomputes=()) -> tuple[float, float]:
    """(compute seconds, stall seconds): steps run back to back; reads queue on one channel and
    start at their prefetch (or fetch) step; a wait (or gather) stalls until its read is done.
    Writes (offloads, gradient reduces) are synchronous. `reads`: more (start, use, seconds),
    `writes`: more (step, seconds), beside the activation moves of `chosen`; `recomputes`: (step,
    seconds) of compute run right before a step (a chain rebuilding a saved tensor)."""
    starts: dict[int, list[int]] = {}
    waits: dict[int, list[int]] = {}
    outs: dict[int, float] = {}
    xfers = [(prefetch_at[i], g.before, profile.transfer_time(nbytes[g.buffer], tier, "in"))
             for i, g in enumerate(chosen)] + list(reads)
    for i, (s, u, _) in enumerate(xfers):
        starts.setdefault(s, []).append(i)
        waits.setdefault(u, []).append(i)
    for g in chosen:
        outs[g.after] = outs.get(g.after, 0.0) + profile.transfer_time(nbytes[g.buffer], tier, "out")
    for s, w in writes:
        outs[s] = outs.get(s, 0.0) + w
    extra: dict[int, float] = {}  # recomputes: the chain's compute right before its step
    for s, c in recomputes:
        extra[s] = extra.get(s, 0.0) + c
    clock = channel = stall = compute = 0.0
    done: dict[int, float] = {}
    for s in facts.steps:
        for i in starts.get(s.index, ()):
            channel = max(channel, clock) + xfers[i][2]
            done[i] = channel
        more = extra.get(s.index, 0.0)
        clock += more
        compute += more
        for i in waits.get(s.index, ()):
            if done[i] > clock:
                stall += done[i] - clock
                clock = done[i]
        clock += s.est_time_s
        compute += s.est_time_s
        w = outs.get(s.index, 0.0)
        stall += w
        clock += w
    return compute, stall


def _op_name(node) -> str:
    t = node.target
    try:
        return _OP_NAMES[t]
    except (KeyError, TypeError):  # TypeError: an unhashable target
        name = str(t) if not hasattr(t, "__name__") or hasattr(t, "overloadpacket") else t.__name__
    try:
        _OP_NAMES[t] = name
    except TypeError:
        pass
    return name


_OP_NAMES: dict = {}  # target -> its name in the plan (str() of an OpOverload is not free: 7k per plan)


def _tensor_lives(facts: GraphFacts, shown: set[int]) -> tuple[TensorLife, ...]:
    """Tensors worth showing: those the plan acts on and the larger ones (all for small graphs)."""
    bufs = [b for b in facts.buffers if b.device == facts.device or b.id in shown]
    if len(bufs) > SHOWN_TENSORS:
        keep = sorted(bufs, key=lambda b: -b.nbytes)[:SHOWN_TENSORS]
        bufs = sorted({*keep, *(b for b in bufs if b.id in shown)}, key=lambda b: b.id)
    movable = {g.buffer for g in facts.gaps}
    return tuple(_life(b, b.id in movable) for b in bufs)


def _life(b, movable: bool) -> TensorLife:
    from zinf_compile.analysis.sizes import shape_str

    val = b.aliases[0].meta.get("val")
    if isinstance(val, (list, tuple)):
        val = next((v for v in val if hasattr(v, "shape")), None)
    return TensorLife(
        id=b.id, name=b.aliases[0].name, graph=b.graph, role=b.role,  # type: ignore[arg-type]
        nbytes=b.nbytes, size_expr=str(b.size_expr) if b.size_expr.free_symbols else str(int(b.size_expr)),
        shape=shape_str(val) if val is not None else "?", dtype=str(getattr(val, "dtype", "?")).replace("torch.", ""),
        def_step=b.def_step, use_steps=b.use_steps, movable=movable,
    )
