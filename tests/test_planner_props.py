"""Property tests of the analysis, the planner and the offload rewrite on random graphs.

Each example is a small random program of torch ops (elementwise, mm, clone, sum, views) traced
with make_fx into one "inference" FX graph whose nodes carry fake values. Every property is checked
against a brute-force oracle that does not share code with zinf:

* the memory timeline and the per-step working set, from storages found by *running* the graph
  for real (every value kept alive, so equal storage pointers mean a shared storage);
* the gaps, checked against the storages' real def/use steps;
* the lower bound: the minimum peak over every subset of the gaps, with each gap's bytes absent
  strictly inside it;
* the planner: feasible exactly when some subset of gaps is, its timeline_after recomputed from
  its actions, deterministic, JSON round trip;
* the rewrite: InsertOffloads + verify, then the rewritten graph run with a real NVMe engine gives
  bitwise the original outputs and leaves no swap files behind;
* recompute, on forward/backward pairs of differentiated programs (section 6): the lower bound is
  the peak of a usable set of levers and no lower than the brute-force optimum over every usable
  subset of gaps and recomputes; plans fit, use compatible levers, and their timeline is the
  levers' effects; the rewrite (Recompute, InsertOffloads) runs bit for bit like the original.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
import torch.fx as fx
from hypothesis import assume, event, given
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from props import props
from zinf_compile.analysis.facts import GraphSpec, analyze
from zinf_compile.cost import BUILTIN, step_cost
from zinf_compile.errors import BudgetError
from zinf_compile.passes import InsertOffloads, PassContext, check_invariants, verify
from zinf_compile.plan import Plan
from zinf_compile.planner import make_plan
from zinf_compile.runtime import close_all, register_engine
from zinf_compile.runtime import ops as zops
from zinf_compile.units import format_bytes

PROFILE = BUILTIN["cpu"]
# the same machine with a very slow disk: every read takes longer than the whole graph, so each
# prefetch is pushed back as far as the budget allows (exercises prefetch placement)
SLOW_DISK = replace(PROFILE, name="cpu-slow-disk", nvme_read_bw=1e3, nvme_write_bw=1e3)
TIER = "nvme"
MAX_GAPS = 12  # 2**12 subsets for the brute-force lower bound

PROPS = props(40)  # the default keeps the file under a minute on CI


# -- random programs -----------------------------------------------------------------------------

DIMS = (2, 3, 4, 8)
UNARY = ("relu", "neg", "clone", "sum", "t", "slice")
BINARY = ("add", "mul", "mm")


@dataclass(frozen=True)
class Program:
    """Inputs of `input_shapes`; each op (name, operand indices, parameter) appends one value;
    the graph returns the values at `outputs`."""

    input_shapes: tuple[tuple[int, ...], ...]
    ops: tuple[tuple[str, tuple[int, ...], int], ...]
    outputs: tuple[int, ...]
    seed: int

    def fn(self):
        ops = self.ops
        outputs = self.outputs

        def program(*inputs):
            vals = list(inputs)
            for name, args, param in ops:
                vals.append(_apply(name, [vals[i] for i in args], param))
            return tuple(vals[i] for i in outputs)

        return program

    def inputs(self) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed)
        return [torch.randn(s, generator=g) for s in self.input_shapes]


def _apply(name: str, args: list[torch.Tensor], param: int) -> torch.Tensor:
    if name == "relu":
        return torch.relu(args[0])
    if name == "neg":
        return torch.neg(args[0])
    if name == "clone":
        return args[0].clone()
    if name == "sum":
        return args[0].sum()
    if name == "t":
        return args[0].t()  # a view: shares the storage
    if name == "slice":
        return args[0][:param]  # a view covering part of the storage
    if name == "add":
        return args[0] + args[1]
    if name == "mul":
        return args[0] * args[1]
    if name == "mm":
        return torch.mm(args[0], args[1])
    raise AssertionError(name)


@st.composite
def programs(draw, min_ops: int = 4, max_ops: int = 12, hold: bool = False) -> Program:
    """Random programs. With `hold`, the first op makes a fresh tensor that the last op reads
    again, so (almost always) there is a long gap around the peak: something worth offloading."""
    shapes: list[tuple[int, ...]] = []
    for _ in range(draw(st.integers(1, 3))):
        shapes.append((draw(st.sampled_from(DIMS)), draw(st.sampled_from(DIMS))))
    n_inputs = len(shapes)
    ops = []
    n_ops = draw(st.integers(min_ops, max_ops)) - (1 if hold else 0)
    for k in range(n_ops):
        # any earlier value may be an operand: far-back ones make the long gaps
        a = draw(st.integers(0, len(shapes) - 1))
        sa = shapes[a]
        fresh = hold and k == 0  # no view: the held tensor has a storage of its own
        name = draw(st.sampled_from(tuple(o for o in UNARY + BINARY if not (fresh and o in ("t", "slice")))))
        args, param, out = (a,), 0, sa
        if name in ("add", "mul"):
            ok = [i for i, s in enumerate(shapes) if s == sa or s == () or sa == ()]
            b = draw(st.sampled_from(ok))
            args, out = (a, b), (sa if sa != () else shapes[b])
        elif name == "mm":
            ok = [i for i, s in enumerate(shapes) if len(sa) == 2 and len(s) == 2 and s[0] == sa[1]]
            if ok:
                b = draw(st.sampled_from(ok))
                args, out = (a, b), (sa[0], shapes[b][1])
            else:
                name = "relu"
        elif name == "sum":
            out = ()
        elif name == "t":
            out = sa[::-1]
        elif name == "slice":
            if sa == ():
                name = "clone"
            else:
                param = draw(st.integers(1, sa[0]))
                out = (param, *sa[1:])
        ops.append((name, args, param))
        shapes.append(out)
    if hold:
        ops.append(("sum", (n_inputs,), 0))
        shapes.append(())
    last = len(shapes) - 1
    extra = draw(st.lists(st.integers(0, last - 1), max_size=2, unique=True))
    outputs = tuple(sorted({last, *extra}))
    assume(any(o >= n_inputs for o in outputs))
    return Program(tuple(shapes[:n_inputs]), tuple(ops), outputs, draw(st.integers(0, 2**16)))


def trace(prog: Program) -> fx.GraphModule:
    return make_fx(prog.fn(), tracing_mode="fake")(*prog.inputs())


def facts_of(gm: fx.GraphModule):
    return analyze([GraphSpec("inference", gm)], device="cpu", step_cost=step_cost(PROFILE))


# -- the brute-force oracles -----------------------------------------------------------------------


class _Recorder(fx.Interpreter):
    """Runs the graph for real and keeps every value alive, so no storage is ever reused."""

    def __init__(self, gm):
        super().__init__(gm, garbage_collect_values=False)
        self.values: dict[fx.Node, object] = {}

    def run_node(self, n):
        out = super().run_node(n)
        self.values[n] = out
        return out


@dataclass
class RealStorages:
    steps: list[fx.Node]
    step_of: dict[fx.Node, int]
    storage_of: dict[fx.Node, int]  # node -> storage pointer of its real value
    nbytes: dict[int, int]
    inputs: set[int]  # storages of graph inputs
    outputs: set[int]  # storages of graph outputs
    defs: dict[int, int]  # first step writing a tensor of the storage
    events: dict[int, set[int]]  # steps that define or read the storage
    uses: dict[int, set[int]]  # steps that read it
    aliases: dict[int, list[fx.Node]]


def real_storages(gm: fx.GraphModule, inputs) -> RealStorages:
    rec = _Recorder(gm)
    rec.run(*inputs)
    nodes = list(gm.graph.nodes)
    steps = [n for n in nodes if n.op == "call_function"]
    step_of = {n: i for i, n in enumerate(steps)}
    storage_of, nbytes, aliases = {}, {}, {}
    for n in nodes:
        v = rec.values.get(n)
        if isinstance(v, torch.Tensor):
            key = v.untyped_storage().data_ptr()
            assert key != 0, "the generator makes no empty tensors"
            storage_of[n] = key
            nbytes[key] = v.untyped_storage().nbytes()
            aliases.setdefault(key, []).append(n)
    inputs_s = {storage_of[n] for n in nodes if n.op == "placeholder"}
    out_node = next(n for n in nodes if n.op == "output")
    outputs_s = {storage_of[n] for n in out_node.all_input_nodes}
    defs, events, uses = {}, {}, {}
    for n in steps:
        s = step_of[n]
        key = storage_of[n]
        defs.setdefault(key, s)
        events.setdefault(key, set()).add(s)
        for a in n.all_input_nodes:
            events.setdefault(storage_of[a], set()).add(s)
            uses.setdefault(storage_of[a], set()).add(s)
    return RealStorages(steps, step_of, storage_of, nbytes, inputs_s, outputs_s, defs, events, uses, aliases)


def oracle_live(r: RealStorages) -> list[int]:
    """Bytes live during each step: inputs always; any other storage from the first step that
    writes it to the last step that reads it (to the end, for a graph output)."""
    n = len(r.steps)
    live = []
    for s in range(n):
        total = 0
        for key, size in r.nbytes.items():
            if key in r.inputs:
                alive = True
            else:
                first = r.defs[key]
                last = n - 1 if key in r.outputs else max(r.events[key])
                alive = first <= s <= last
            total += size if alive else 0
        live.append(total)
    return live


def oracle_working_set(r: RealStorages) -> list[int]:
    """Bytes each step reads and writes: the storages of its result and of its operands."""
    out = []
    for n in r.steps:
        touched = {r.storage_of[n], *(r.storage_of[a] for a in n.all_input_nodes)}
        out.append(sum(r.nbytes[k] for k in touched))
    return out


def gap_matrix(facts) -> np.ndarray:
    """Row i: the bytes gap i takes off each step (strictly between its two events)."""
    m = np.zeros((len(facts.gaps), len(facts.live)), dtype=np.int64)
    for i, g in enumerate(facts.gaps):
        m[i, g.after + 1:g.before] = facts.buffers[g.buffer].nbytes
    return m


def subset_peaks(facts) -> np.ndarray:
    """The peak for every subset of the gaps (bit i of the subset's index: gap i is used)."""
    k = len(facts.gaps)
    masks = (np.arange(2**k)[:, None] >> np.arange(k)[None, :]) & 1
    return (facts.live[None, :] - masks @ gap_matrix(facts)).max(axis=1)


def plan_timeline(facts, plan: Plan) -> list[int]:
    """The timeline the plan's actions give: a tensor is away after its offload's step until
    right before its prefetch's step."""
    live = facts.live.astype(np.int64).copy()
    groups = _groups(plan)
    for acts in groups.values():
        off, pre = acts["offload"], acts["prefetch"]
        live[off.step + 1:pre.step] -= off.nbytes
    return [int(x) for x in live]


def _groups(plan: Plan) -> dict[int, dict[str, object]]:
    groups: dict[int, dict[str, list]] = {}
    for a in plan.moves():
        groups.setdefault(a.group, {}).setdefault(a.kind, []).append(a)
    for g, acts in groups.items():
        assert sorted(acts) == ["offload", "prefetch", "wait"], f"group {g}: {acts}"
        assert all(len(v) == 1 for v in acts.values()), f"group {g}: {acts}"
    return {g: {k: v[0] for k, v in acts.items()} for g, acts in groups.items()}


# -- 1. the generator -----------------------------------------------------------------------------


@PROPS
@given(programs())
def test_generated_graphs_have_real_metadata(prog):
    gm = trace(prog)
    steps = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert 4 <= len(steps) <= 12
    for n in gm.graph.nodes:
        if n.op != "output":
            assert isinstance(n.meta.get("val"), torch.Tensor), n.format_node()
    # the trace computes what the program computes
    eager = prog.fn()(*prog.inputs())
    got = gm(*prog.inputs())
    assert len(got) == len(eager)
    for a, b in zip(got, eager):
        assert a.shape == b.shape and torch.equal(a, b)


# -- 2. the timeline ------------------------------------------------------------------------------


@PROPS
@given(programs())
def test_timeline_matches_brute_force(prog):
    gm = trace(prog)
    facts = facts_of(gm)
    r = real_storages(gm, prog.inputs())
    assert [step.node for step in facts.steps] == r.steps
    assert [int(x) for x in facts.live] == oracle_live(r)
    assert [int(x) for x in facts.working_set] == oracle_working_set(r)
    assert facts.peak == max(oracle_live(r))
    # one buffer per real storage, of the storage's size, holding exactly its aliases
    assert sorted(b.nbytes for b in facts.buffers) == sorted(r.nbytes.values())
    for b in facts.buffers:
        keys = {r.storage_of[a] for a in b.aliases}
        assert len(keys) == 1, b
        key = keys.pop()
        assert b.nbytes == r.nbytes[key]
        assert set(b.aliases) == set(r.aliases[key])
        assert set(b.use_steps) == r.uses.get(key, set())
        assert b.role == ("input" if key in r.inputs else "output" if key in r.outputs else "activation")


# -- 3. the gaps and the lower bound --------------------------------------------------------------


@PROPS
@given(programs())
def test_gaps_are_real_and_complete(prog):
    gm = trace(prog)
    facts = facts_of(gm)
    r = real_storages(gm, prog.inputs())
    found = set()
    for g in facts.gaps:
        b = facts.buffers[g.buffer]
        key = r.storage_of[g.source]
        assert r.storage_of[g.target] == key and r.storage_of[b.aliases[0]] == key
        assert key not in r.inputs and key not in r.outputs, "inputs and outputs never move"
        ev = r.events[key]
        assert g.after in ev and g.before in r.uses[key] and g.before - g.after >= 2
        assert not any(g.after < s < g.before for s in ev), f"{g} has a use inside"
        # the tensor read before the gap covers the whole storage, densely
        v = g.source.meta["val"]
        assert v.numel() * v.element_size() == b.nbytes
        assert sorted(g.dim_order) == list(range(v.dim()))
        found.add((key, g.after, g.before))
        # several aliases read after the gap (views): each rebuilt on the waited storage
        assert all(r.storage_of[v] == key for v in g.views)
        if g.views:
            event("gap read through several aliases")
    # complete for storages whose first tensor covers them densely (views of it or not): every
    # stretch of 2+ steps without a use
    for key, al in r.aliases.items():
        if key in r.inputs or key in r.outputs:
            continue
        v = al[0].meta["val"]
        if v.numel() * v.element_size() != r.nbytes[key] or v.storage_offset() != 0:
            continue
        ev = sorted(r.events[key])
        for a, c in zip(ev, ev[1:]):
            if c - a >= 2:
                assert (key, a, c) in found, f"missing gap of {al[0].name}: ({a}, {c})"


@PROPS
@given(programs())
def test_lower_bound_is_min_over_gap_subsets(prog):
    facts = facts_of(trace(prog))
    assume(len(facts.gaps) <= MAX_GAPS)
    peaks = subset_peaks(facts)
    assert int(peaks[0]) == facts.peak  # the empty subset
    assert int(peaks.min()) == facts.lower_bound
    ws = facts.working_set
    assert facts.lower_bound >= (int(ws.max()) if len(ws) else 0)
    assert facts.lower_bound <= facts.peak


# -- 4. the planner --------------------------------------------------------------------------------


def _check_plan_shape(facts, plan: Plan, budget: int) -> None:
    gaps = {(g.buffer, g.after, g.before) for g in facts.gaps}
    spans = []
    for acts in _groups(plan).values():
        off, pre, wai = acts["offload"], acts["prefetch"], acts["wait"]
        assert off.step < pre.step <= wai.step, acts
        assert off.tensor == pre.tensor == wai.tensor
        assert off.nbytes == pre.nbytes == wai.nbytes == facts.buffers[off.tensor].nbytes
        assert off.tier == pre.tier == wai.tier == TIER
        assert (off.tensor, off.step, wai.step) in gaps, "every offload uses a gap of the facts"
        spans.append((off.tensor, off.step, wai.step))
    assert len(set(spans)) == len(spans), "a gap is used once"
    assert plan.budget == budget
    assert list(plan.timeline_before) == [int(x) for x in facts.live]
    assert list(plan.timeline_after) == plan_timeline(facts, plan)
    assert plan.peak_after == max(plan.timeline_after, default=0)
    assert plan.lower_bound == facts.lower_bound
    moved = sum(2 * a.nbytes for a in plan.actions if a.kind == "offload")
    assert plan.bytes_moved == ({TIER: moved} if moved else {})
    assert plan.predicted_compute_s == pytest.approx(sum(step.est_time_s for step in facts.steps))
    assert plan.predicted_stall_s >= 0
    # no offload is redundant: with every prefetch just in time, taking any one of them back
    # breaks the budget
    jit = facts.live.astype(np.int64).copy()
    for b, off, wai in spans:
        jit[off + 1:wai] -= facts.buffers[b].nbytes
    assert jit.max(initial=0) <= budget
    for b, off, wai in spans:
        back = jit.copy()
        back[off + 1:wai] += facts.buffers[b].nbytes
        assert back.max() > budget, f"offloading tensor {b} in ({off}, {wai}) is unnecessary"


def _budgets(facts):
    lo, hi = facts.lower_bound, facts.peak
    return st.one_of(st.just(lo), st.just(hi), st.integers(lo, hi))


@PROPS
@given(programs(hold=True), st.data(), st.sampled_from([PROFILE, SLOW_DISK]))
def test_plan_fits_any_budget_from_lower_bound_to_peak(prog, data, profile):
    facts = facts_of(trace(prog))
    assume(facts.lower_bound < facts.peak)  # something to offload
    budget = data.draw(_budgets(facts), label="budget")
    plan = make_plan(facts, budget, profile, TIER)
    event(f"groups: {min(len(plan.actions) // 3, 3)}")
    early = any(g["prefetch"].step < g["wait"].step for g in _groups(plan).values())
    event(f"a prefetch before its wait's step: {early}")
    assert plan.peak_after <= budget
    if facts.peak <= budget:
        assert plan.is_empty()
    _check_plan_shape(facts, plan, budget)
    # deterministic, and a JSON value
    assert make_plan(facts, budget, profile, TIER) == plan
    assert make_plan(facts_of(trace(prog)), budget, profile, TIER) == plan  # a fresh trace too
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


@PROPS
@given(programs(), st.data())
def test_budget_below_lower_bound_names_it(prog, data):
    facts = facts_of(trace(prog))
    assume(facts.lower_bound > 0)
    budget = data.draw(st.integers(0, facts.lower_bound - 1), label="budget")
    with pytest.raises(BudgetError) as e:
        make_plan(facts, budget, PROFILE, TIER)
    assert format_bytes(facts.lower_bound) in str(e.value)
    assert e.value.lower_bound == facts.lower_bound and e.value.budget == budget


@PROPS
@given(programs(hold=True), st.data())
def test_planner_feasible_iff_some_gap_subset_is(prog, data):
    facts = facts_of(trace(prog))
    assume(len(facts.gaps) <= MAX_GAPS)
    best = int(subset_peaks(facts).min())  # the brute-force optimum
    budget = data.draw(st.one_of(st.sampled_from([best - 1, best, facts.peak]),
                                 st.integers(0, facts.peak + 64)), label="budget")
    feasible = best <= budget
    try:
        plan = make_plan(facts, budget, PROFILE, TIER)
    except BudgetError:
        assert not feasible, f"no plan for budget {budget}, but the gaps reach {best}"
        return
    assert feasible, f"a plan for budget {budget} below the optimum {best}"
    assert plan.peak_after <= budget
    _check_plan_shape(facts, plan, budget)


# -- 5. the rewrite, run for real -----------------------------------------------------------------

ENGINE_KEY = 7_000_001
def _bits(t: torch.Tensor) -> torch.Tensor:
    assert t.dtype == torch.float32
    return t.view(torch.int32)  # compares NaNs and signed zeros bit for bit


@PROPS
@given(programs(hold=True), st.data(), st.sampled_from([PROFILE, SLOW_DISK]))
def test_rewritten_graph_runs_bitwise_equal_with_nvme_engine(prog, data, profile):
    gm = trace(prog)
    inputs = prog.inputs()
    expected = gm(*inputs)  # the original graph, before the pass rewrites it in place
    facts = facts_of(gm)
    assume(facts.lower_bound < facts.peak)  # something to offload
    lo, hi = facts.lower_bound, facts.peak
    budget = data.draw(st.one_of(st.just(lo), st.integers(lo, hi - 1)), label="budget")
    plan = make_plan(facts, budget, profile, TIER)
    n_groups = len(_groups(plan))
    assert n_groups > 0
    event(f"offloaded tensors: {min(n_groups, 3)}{'+' if n_groups >= 3 else ''}")
    offs = [g["offload"] for g in _groups(plan).values()]
    moved = {(g.buffer, g.after): g for g in facts.gaps}
    orders = [moved[(o.tensor, o.step)].dim_order for o in offs]
    event(f"a transposed tensor moved: {any(list(d) != sorted(d) for d in orders)}")
    event(f"a tensor moved twice: {len({o.tensor for o in offs}) < len(offs)}")

    ctx = PassContext(num_fwd_outputs=len(prog.outputs), engine_key=ENGINE_KEY, plan=plan, facts=facts)
    report = InsertOffloads().apply({"inference": gm}, ctx)
    gm.recompile()
    peak = verify(ctx, len(prog.outputs), report.name, {"inference": gm})
    assert peak <= budget
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(zops.offload) == targets.count(zops.prefetch) == targets.count(zops.wait) == n_groups

    with tempfile.TemporaryDirectory(prefix="zinf-props-") as tmp:
        try:
            eng = register_engine(ENGINE_KEY, "nvme", tmp, 2, False)
            got = gm(*inputs)
            assert eng.stats["offloads"] == eng.stats["prefetches"] == eng.stats["waits"] == n_groups
            assert len(got) == len(expected)
            for a, b in zip(got, expected):
                assert a.shape == b.shape and a.stride() == b.stride()
                assert torch.equal(_bits(a), _bits(b))
            del got
            assert eng.live_tickets() == 0, "every handle is released once the graph returns"
        finally:
            close_all()
        left = [os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs]
        assert left == [], f"swap files left behind: {left}"
        assert os.listdir(tmp) == [], "the swap folder is removed on close"


def test_verify_accepts_plan_at_lower_bound_on_cpu():
    """Handles (one int64 each) are bookkeeping: neither the planner nor the verifier counts them,
    so a plan that sits exactly at the lower bound verifies."""
    # x: 16 B input. relu(x) at step 0 is read again at step 3: gap (0, 3). Steps 1, 2 make dead
    # 16 B tensors, so the peak (48 B) is inside the gap and the lower bound is 36 B (step 3).
    prog = Program(((2, 2),), (("relu", (0,), 0), ("relu", (0,), 0), ("relu", (0,), 0), ("sum", (1,), 0)),
                   (4,), seed=0)
    gm = trace(prog)
    facts = facts_of(gm)
    assert [int(x) for x in facts.live] == [32, 48, 48, 36] and facts.lower_bound == 36
    plan = make_plan(facts, facts.lower_bound, PROFILE, TIER)
    assert plan.peak_after == 36 and len(_groups(plan)) == 1
    ctx = PassContext(num_fwd_outputs=1, engine_key=ENGINE_KEY, plan=plan, facts=facts)
    report = InsertOffloads().apply({"inference": gm}, ctx)
    gm.recompile()
    assert verify(ctx, 1, report.name, {"inference": gm}) == 36


def test_dense_dim_order_adds_no_guards():
    """The layout check runs on every candidate gap: it must not guard symbolic sizes (review
    found torch's own density check guarding `Eq(s//4, 1)`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from zinf_compile.analysis.sizes import dense_dim_order

    env = ShapeEnv()
    with FakeTensorMode(shape_env=env) as mode:
        x = mode.from_tensor(torch.empty(64, 4), symbolic_context=None)
    sym = env.create_symintnode(env.create_symbol(64, source=torch._dynamo.source.ConstantSource("s")), hint=64)
    with mode:
        t = torch.empty(sym // 4, 4)
        tt = torch.empty(sym - 3, 4).t()
    before = len(env.guards)
    assert dense_dim_order(t) == [0, 1]
    assert dense_dim_order(tt) == [1, 0]
    assert dense_dim_order(x[:, ::2]) is None
    assert len(env.guards) == before


# -- 6. recompute, on forward/backward pairs -------------------------------------------------------
#
# The same random programs, differentiated: AOT's joint graph split by torch's default partition
# (it saves every value the backward reads, recomputing nothing itself), so saved outputs of cheap
# ops are common. The levers are every gap and every recompute candidate; the oracle tries every
# subset of them that can be used together (no lever of a storage twice, no leaf away or rebuilt
# when a chain reads it; a leaf's gap cut short at a rebuild is a lever too) and applies each one's effect directly: a gap's bytes absent strictly
# inside it, a recompute's storage absent from its last forward step to its rebuild and its chain's
# intermediates present at the rebuild.

MAX_LEVERS = 14  # 2**14 subsets, checked at once with numpy


@st.composite
def joint_programs(draw) -> Program:
    """Programs with a saved value the backward can rebuild: A = mm(x, w), B = cheap(A),
    C = B * A (its backward reads both), sometimes a second link D = cheap(C), E = D * C; then
    random ops; B is read again at the end (a long stretch to free around the peak)."""
    n, k, m = (draw(st.sampled_from(DIMS)) for _ in range(3))
    cheap = ("neg", "clone")  # relu's backward saves its output under a second name (detach): no candidate
    ops = [("mm", (0, 1), 0), (draw(st.sampled_from(cheap)), (2,), 0), ("mul", (3, 2), 0)]
    shapes: list[tuple[int, ...]] = [(n, k), (k, m), (n, m), (n, m), (n, m)]
    links = [4]
    if draw(st.booleans()):
        ops += [(draw(st.sampled_from(cheap)), (4,), 0), ("mul", (5, 4), 0)]
        shapes += [(n, m), (n, m)]
        links.append(6)
    for _ in range(draw(st.integers(1, 4))):
        a = draw(st.integers(2, len(shapes) - 1))
        name = draw(st.sampled_from(("relu", "neg", "clone", "add", "mul", "t")))
        args, out = (a,), shapes[a]
        if name in ("add", "mul"):
            args = (a, draw(st.sampled_from([i for i, sh in enumerate(shapes) if i >= 2 and sh == shapes[a]])))
        elif name == "t":
            out = shapes[a][::-1]
        ops.append((name, args, 0))
        shapes.append(out)
    last = len(shapes) - 1
    ops.append(("sum", (3,), 0))
    outputs = tuple(sorted({*links, last, last + 1}))  # the links' products feed the loss: not dead code
    return Program(((n, k), (k, m)), tuple(ops), outputs, draw(st.integers(0, 2**16)))


@dataclass
class Joint:
    fw: fx.GraphModule
    bw: fx.GraphModule
    num_fwd_outputs: int
    prog: Program


def trace_joint(prog: Program) -> Joint:
    from functorch.compile import aot_function, default_partition, nop

    cap: dict = {}

    def part(joint, joint_inputs, **kw):
        fw, bw = default_partition(joint, joint_inputs, **kw)
        cap.update(fw=fw, bw=bw, n=kw["num_fwd_outputs"])
        return fw, bw

    inputs = [t.requires_grad_() for t in prog.inputs()]
    outs = aot_function(prog.fn(), nop, nop, partition_fn=part)(*inputs)
    sum(o.sum() for o in outs).backward()
    return Joint(cap["fw"], cap["bw"], cap["n"], prog)


def joint_facts(j: Joint, profile=PROFILE):
    from zinf_compile.analysis.graphs import graph_specs

    return analyze(graph_specs({"forward": j.fw, "backward": j.bw}, j.num_fwd_outputs), device="cpu",
                   step_cost=step_cost(profile))


def _conflict(x, y) -> bool:
    """Whether levers x and y cannot be used together (the oracle's own statement of the rule)."""
    from zinf_compile.analysis.recompute import Recompute

    if isinstance(x, Recompute) and isinstance(y, Recompute):
        return x is not y and (x.buffer in y.leaf_buffers or y.buffer in x.leaf_buffers)
    if isinstance(y, Recompute):
        x, y = y, x
    if isinstance(x, Recompute):  # y a gap: of its storage, or of a leaf, away across the rebuild
        return y.buffer == x.buffer or (y.buffer in x.leaf_buffers and y.after < x.before < y.before)
    # two gaps of one storage that overlap (a leaf's gap and the same cut short at a rebuild)
    return x is not y and x.buffer == y.buffer and x.after < y.before and y.after < x.before


def _compatible(levers) -> bool:
    return not any(_conflict(x, y) for i, x in enumerate(levers) for y in levers[i + 1:])


def lever_peaks(facts) -> tuple[np.ndarray, np.ndarray, list]:
    """(peak, usable) for every subset of the levers (bit i: lever i used), and the levers."""
    levers = [*facts.gaps, *facts.rebuild_gaps, *facts.recomputes]
    k, n = len(levers), len(facts.live)
    effect = np.zeros((k, n), dtype=np.int64)  # bytes each lever takes off each step
    for i, x in enumerate(levers):
        if hasattr(x, "chain"):
            effect[i, x.after + 1:x.before] = x.nbytes
            effect[i, x.before] -= x.temp_nbytes
        else:
            effect[i, x.after + 1:x.before] = facts.buffers[x.buffer].nbytes
    clash = np.array([[_conflict(x, y) for y in levers] for x in levers], dtype=np.int64).reshape(k, k)
    masks = (np.arange(2**k)[:, None] >> np.arange(k)[None, :]) & 1
    peaks = (facts.live[None, :] - masks @ effect).max(axis=1)
    usable = ((masks @ clash) * masks).sum(axis=1) == 0
    return peaks, usable, levers


def _with_recompute(data):
    """A forward/backward pair with a recompute candidate."""
    j = trace_joint(data.draw(joint_programs(), label="program"))
    facts = joint_facts(j)
    assume(facts.recomputes and len(facts.gaps) + len(facts.rebuild_gaps) + len(facts.recomputes) <= MAX_LEVERS)
    return j, facts


@props(25)
@given(st.data())
def test_recompute_lower_bound_and_plan_against_brute_force(data):
    j, facts = _with_recompute(data)
    peaks, usable, levers = lever_peaks(facts)
    best = int(peaks[usable].min())
    # the floor is the peak of one usable set of levers (every gap, the recomputes it can add)
    assert facts.lower_bound in {int(p) for p in peaks[usable]}
    assert best <= facts.lower_bound <= facts.peak
    # the edges, and (most often) inside, where the planner has a choice to make
    where = [best - 1, facts.lower_bound, facts.peak, *(best + (facts.peak - best) * q // 8 for q in range(1, 8))]
    budget = where[data.draw(st.integers(0, len(where) - 1), label="budget")]
    try:
        plan = make_plan(facts, budget, PROFILE, TIER)
    except BudgetError:
        assert budget < facts.lower_bound, f"no plan for {budget} >= the lower bound {facts.lower_bound}"
        return
    assert budget >= best, f"a plan for budget {budget} below the brute-force optimum {best}"
    assert plan.peak_after <= budget
    recs = {(a.tensor, a.step): a for a in plan.recomputes()}
    assert len(recs) == len(plan.recomputes()), "a tensor is rebuilt once"
    assert sorted(a.group for a in plan.recomputes()) == list(range(len(recs)))
    event(f"recomputes chosen: {min(len(recs), 2)}")
    by_key = {(r.buffer, r.before): r for r in facts.recomputes}
    chosen = [by_key[k] for k in recs]
    gaps = {(g.buffer, g.after, g.before): g for g in (*facts.gaps, *facts.rebuild_gaps)}
    moved = [gaps[(a.tensor, a.step, w.step)] for a in plan.actions if a.kind == "offload"
             for w in plan.actions if w.kind == "wait" and w.group == a.group]
    assert _compatible([*moved, *chosen]), "the plan's levers can be used together"
    # its timeline: the facts' with each lever's effect (prefetches count from their step on)
    live = facts.live.astype(np.int64).copy()
    for r in chosen:
        live[r.after + 1:r.before] -= r.nbytes
        live[r.before] += r.temp_nbytes
    for acts in _groups(plan).values():
        live[acts["offload"].step + 1:acts["prefetch"].step] -= acts["offload"].nbytes
    assert list(plan.timeline_after) == [int(x) for x in live]
    assert plan.predicted_compute_s == pytest.approx(sum(s.est_time_s for s in facts.steps)
                                                     + sum(r.est_time_s for r in chosen))
    assert make_plan(facts, budget, PROFILE, TIER) == plan
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


@props(20)
@given(st.data())
def test_recompute_rewrite_runs_bitwise_equal(data):
    """The plan applied (recompute, then offloads) to the forward and backward, verified, run for
    real with an NVMe engine: the user's outputs and every gradient bit for bit as before, the
    forward saving fewer tensors, and the re-analysed peak within the budget."""
    from zinf_compile.passes import Recompute

    j, facts = _with_recompute(data)
    inputs = j.prog.inputs()
    fw_out = j.fw(*inputs)
    n = j.num_fwd_outputs
    tangents = [torch.ones(p.meta["val"].shape) for p in j.bw.graph.find_nodes(op="placeholder")
                if p.name.startswith("tangents")]  # AOT's names: one per output that needs a gradient
    expected = (list(fw_out[:n]), list(j.bw(*fw_out[n:], *tangents)))
    peaks, usable, _ = lever_peaks(facts)
    where = [facts.lower_bound + (facts.peak - facts.lower_bound) * q // 8 for q in range(2, 8)]
    budget = where[data.draw(st.integers(0, len(where) - 1), label="budget")]
    plan = make_plan(facts, budget, PROFILE, TIER)
    assume(plan.recomputes())
    event(f"with offloads: {bool(plan.moves())}")
    graphs = {"forward": j.fw, "backward": j.bw}
    ctx = PassContext(num_fwd_outputs=n, engine_key=ENGINE_KEY, plan=plan, facts=facts)
    saved_before = len(fw_out) - n
    for p in (Recompute(), InsertOffloads()):
        report = p.apply(graphs, ctx)
        for gm in graphs.values():
            gm.graph.lint()
            gm.recompile()
        check_invariants(graphs, ctx, report.name)
    assert verify(ctx, n, report.name, graphs) <= budget
    with tempfile.TemporaryDirectory(prefix="zinf-props-") as tmp:
        try:
            register_engine(ENGINE_KEY, "nvme", tmp, 2, False)
            out = j.fw(*inputs)
            assert len(out) - n == saved_before - len(plan.recomputes())
            grads = j.bw(*out[n:], *tangents)
            for a, b in zip([*out[:n], *grads], [*expected[0], *expected[1]]):
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.shape == b.shape and torch.equal(_bits(a), _bits(b))
            del out, grads
        finally:
            close_all()
